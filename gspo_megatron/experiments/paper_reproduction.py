"""The GSPO paper's section-5 comparisons on a tiny MoE: plan, run and collect the training runs.

For every seed: one cold-start SFT run (``trainer.num_steps=0``; its HF export is the common
start), then one RL run per variant from that start, at equal rollout compute (same steps,
prompts and samples per step):

    gspo_learner   GSPO, clip 3e-4 / 4e-4, old log-probs recomputed by the learner
    gspo_engine    GSPO, old log-probs taken from the rollout engine (paper section 5.4)
    grpo           GRPO (token ratios, clip 0.2 / 0.27), old log-probs recomputed
    grpo_replay    GRPO + Routing Replay (the paper's fix for GRPO on MoE models)

Each run is a ``gspo-train`` process on ``configs/paper_tiny_moe.yaml`` with overrides, writing
``<out>/<variant>/seed<k>/metrics.jsonl`` and ``timing.json`` (start, wall time, load); a run
whose metrics already reach its last step is not run again, so an interrupted reproduction
continues where it stopped. ``comparison.py`` turns the rows into the figure and the table,
``paper_report.py`` into docs/paper_reproduction.md. Entry point: ``tools/reproduce_paper.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "paper_tiny_moe.yaml"
GRPO_CLIP = ("algo.loss=grpo", "algo.clip_eps_low=0.2", "algo.clip_eps_high=0.27")
VARIANTS: Dict[str, tuple] = {
    "gspo_learner": ("algo.loss=gspo", "algo.old_logprob_source=learner"),
    "gspo_engine": ("algo.loss=gspo", "algo.old_logprob_source=rollout"),
    "grpo": GRPO_CLIP + ("algo.old_logprob_source=learner",),
    "grpo_replay": GRPO_CLIP + ("algo.old_logprob_source=learner", "algo.routing_replay=learner"),
    "grpo_r3": GRPO_CLIP + ("algo.old_logprob_source=learner", "algo.routing_replay=rollout"),
}
BF16_ENGINE = ("rollout.embedded_dtype=bf16",)
"""A bf16 rollout engine beside the fp32 learner: the train / inference mismatch R3 is about."""
VARIANTS.update({f"{name}_bf16": VARIANTS[name] + BF16_ENGINE
                 for name in ("grpo", "grpo_replay", "grpo_r3")})
NUM_EXPERTS, TOPK = 8, 2


@dataclass(frozen=True)
class Settings:
    """One reproduction: where, which seeds and variants, how long, how many runs at once."""

    out: Path
    seeds: Sequence[int] = (1, 2, 3)
    variants: Sequence[str] = tuple(VARIANTS)
    num_steps: int = 200
    num_sft_steps: int = 1200
    """A cap: the cold start stops at ``trainer.sft_stop_loss`` (tiny_cpu.yaml)."""
    eval_every_steps: int = 20
    jobs: int = 2
    """Runs at once; each gets ``$OMP_NUM_THREADS`` threads if set, else ``max(1, cpus // jobs)``."""
    extra: Sequence[str] = ()
    """Overrides added to every run (e.g. a smaller eval set for a smoke test)."""
    num_layers: int = 2
    """Depth of the tiny MoE (``tools/volatility_vs_depth.py`` varies it)."""


@dataclass
class RunSpec:
    """One ``gspo-train`` process."""

    name: str
    run_dir: Path
    overrides: List[str] = field(default_factory=list)
    last_step: int = 0

    def done(self) -> bool:
        rows = read_rows(self.run_dir)
        return bool(rows) and rows[-1].get("step") == self.last_step and \
            (self.run_dir / "hf_export" / "config.json").is_file()


def read_rows(run_dir: Path) -> List[dict]:
    """The run's ``metrics.jsonl`` rows ([] when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_assets(out: Path, num_train: int = 4000, num_eval: int = 200, num_layers: int = 2) -> Path:
    """The 8-expert top-2 tiny Qwen3-MoE (``num_layers`` deep), tokenizer and addition data under
    ``out/assets``."""
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.model import TinyModelSpec
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    root = out / "assets"
    if not (root / "model" / "config.json").is_file():
        make_tiny_assets(root, task=AdditionTaskConfig(num_train=num_train, num_eval=num_eval),
                         spec=TinyModelSpec(num_layers=num_layers, num_experts=NUM_EXPERTS,
                                            num_experts_per_tok=TOPK))
    return root


def _common(s: Settings, assets: Path, seed: int) -> List[str]:
    return [f"data.train_path={assets / 'data' / 'train.jsonl'}",
            f"data.eval_path={assets / 'data' / 'eval.jsonl'}", f"trainer.seed={seed}",
            f"trainer.eval_every_steps={s.eval_every_steps}", *s.extra]


def cold_start_runs(s: Settings, assets: Path) -> List[RunSpec]:
    return [RunSpec(f"sft seed {seed}", s.out / "sft" / f"seed{seed}",
                    [f"model.hf_path={assets / 'model'}", "trainer.num_steps=0",
                     f"trainer.num_sft_steps={s.num_sft_steps}", *_common(s, assets, seed)],
                    last_step=0) for seed in s.seeds]


def rl_runs(s: Settings, assets: Path) -> List[RunSpec]:
    runs = []
    for seed in s.seeds:
        start = s.out / "sft" / f"seed{seed}" / "hf_export"
        for variant in s.variants:
            runs.append(RunSpec(f"{variant} seed {seed}", s.out / variant / f"seed{seed}",
                                [f"model.hf_path={start}", "trainer.num_sft_steps=0",
                                 f"trainer.num_steps={s.num_steps}", *_common(s, assets, seed),
                                 *VARIANTS[variant]], last_step=s.num_steps))
    return runs


def _write_timing(spec: RunSpec, started: float, seconds: float, threads: int, jobs: int) -> None:
    """``<run_dir>/timing.json``: when the run started, its wall time and the machine's load
    (the report quotes them; a skipped, already complete run keeps the one it had)."""
    timing = {"started_unix": started, "wall_s": seconds, "threads": threads, "jobs": jobs,
              "num_cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]}
    (spec.run_dir / "timing.json").write_text(json.dumps(timing) + "\n")


def _launch(spec: RunSpec, threads: int, jobs: int = 1) -> float:
    """Run one ``gspo-train`` process (log in ``<run_dir>.log``); seconds taken."""
    if spec.done():
        log.info("%s: already complete", spec.name)
        return 0.0
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "metrics.jsonl").unlink(missing_ok=True)  # an interrupted run starts over
    cmd = [sys.executable, "-m", "gspo_megatron.cli.train", str(CONFIG),
           f"logging.run_dir={spec.run_dir}", *spec.overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    start, started = time.perf_counter(), time.time()
    log.info("%s: started", spec.name)
    with open(f"{spec.run_dir}.log", "w") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0 or not spec.done():
        raise RuntimeError(f"{spec.name} failed (exit {code}); see {spec.run_dir}.log")
    seconds = time.perf_counter() - start
    _write_timing(spec, started, seconds, threads, jobs)
    log.info("%s: done in %.0f s", spec.name, seconds)
    return seconds


def run_all(specs: List[RunSpec], jobs: int) -> None:
    """Run ``specs`` at most ``jobs`` at a time; raise after all finished if any failed."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // max(jobs, 1)))
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = [pool.submit(_launch, spec, threads, jobs) for spec in specs]
        errors = [str(f.exception()) for f in futures if f.exception() is not None]
    if errors:
        raise RuntimeError("; ".join(errors))


def reproduce(s: Settings) -> Dict[str, Dict[int, List[dict]]]:
    """Assets, cold starts, RL runs; returns ``{variant: {seed: rows}}``."""
    unknown = [v for v in s.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    assets = write_assets(s.out, num_layers=s.num_layers)
    run_all(cold_start_runs(s, assets), s.jobs)
    run_all(rl_runs(s, assets), s.jobs)
    return {v: {seed: read_rows(s.out / v / f"seed{seed}") for seed in s.seeds}
            for v in s.variants}
