"""GSPO training at Qwen3-30B-A3B's real widths on CPU against the real SGLang server: where the
learner's memory goes, the step time split, peak memory of learner and server, and what
``gspo-plan --host`` predicted for them (issue 39 item 7).

    flock /tmp/bigmem.lock python benchmarks/bench_real_width_train.py \\
        --assets /tmp/i39c/q30l1 --work /tmp/real_width_train --doc docs/real_geometry.md

Three measurements, one after another (never two at once), on the 1-layer checkpoint of
``tools/make_qwen3_assets.py`` (``--assets``; written there when missing):

1. **breakdown** (a process of its own, for each of ``--breakdown-freeze``): the training
   ``Learner`` of ``configs/qwen3_30b_a3b_1layer_cpu.yaml`` built and run piece by piece, its
   owned memory (RssAnon + RssShmem) read after each piece and its peak inside each: imports and
   the gloo group; the model (bf16); DDP's fp32 gradient buffers; the distributed optimizer's fp32
   main weights; the HF weights loaded; a log-prob pass over a step's 16 sequences; two GSPO
   train steps (the first creates Adam's moments); the weight sync's gather of every parameter
   into HF buckets. Without the freeze it stops before the first optimizer step (Adam's moments
   would not fit beside the rest on a 24 GiB machine: their size is counted instead).
2. **train**: ``gspo-train`` with that config for ``--steps`` GSPO steps, the trainer starting the
   real SGLang 0.5.23 CPU server itself (disaggregated, weights broadcast after every update and
   verified on the server). Owned memory of the trainer's process tree is sampled every 0.1 s,
   the server's processes (under the launcher's wrapper) apart from the learner's (the trainer,
   whose reward scoring runs in threads), per phase of the run: start-up (server start, learner
   build, weight load), the GSPO steps (from the first step's start to the last step's metrics
   row), the end (the HF export; the config saves no final checkpoint, ``checkpoint.save_final``).
   The step time split comes from the run's own metrics rows.
3. **plan**: ``gspo-plan CONFIG --host --json`` with the same overrides: the predicted peak of
   the learner process and of the server, compared with the measured ones (within +-20%).

The command, conditions and numbers go into the marked section of ``--doc``.
Exit code 0: every prediction within 20%; 1: one is not (the section is still written); 2: usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.owned_memory import (SplitMemorySampler, command_line, owned_bytes,  # noqa: E402
                                     run_measured)

GIB = 2 ** 30
CONFIG = REPO / "configs" / "qwen3_30b_a3b_1layer_cpu.yaml"
TOLERANCE = 0.20
BEGIN = "<!-- bench_real_width_train: begin (written by the benchmark; do not edit) -->"
END = "<!-- bench_real_width_train: end -->"
SERVER_MARKS = ("gspo_megatron.distributed.child_processes", "keyed_launch.py",
                "sglang.launch_server", "sglang::")
"""A server's processes: the parent-death wrapper the trainer starts it under
(``rollout/sglang/launcher.py``), which execs the keyed launcher or ``sglang.launch_server``
(so the wrapper's own command line is seen only for a moment), and SGLang's ``sglang::scheduler``
/ ``sglang::detokenizer``."""
SPLIT_KEYS = {"generate": "time/rollout_wait_s", "old log-probs": "time/old_logprobs_s",
              "train": "time/update_s", "expert volatility": "time/expert_volatility_s",
              "weight sync": "time/weight_sync_s", "sync verify": "time/sync_verify_s",
              "step": "time/step_s"}


def run_overrides(assets: Path, run_dir: Path, sglang_python: str, *extra: str) -> List[str]:
    """The config's paths pointed at ``assets`` and ``run_dir``."""
    return [f"model.hf_path={assets / 'model'}", f"data.train_path={assets / 'data' / 'train.jsonl'}",
            f"logging.run_dir={run_dir}", f"rollout.sglang.python={sglang_python}", *extra]


# ---- 1. where the learner's memory goes ----------------------------------------------------

class Marks:
    """Owned bytes of this process after each named piece, and the peak inside it (a sampling
    thread, every 20 ms)."""

    def __init__(self, limit_bytes: float = float("inf")) -> None:
        self.limit_bytes = limit_bytes
        """Above it the process prints every thread's stack and exits (a guard for a shared
        machine: the kernel's OOM killer would say nothing about where the memory went)."""
        self.rows: List[dict] = []
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = owned_bytes(os.getpid())
            with self._lock:
                self._peak = max(self._peak, now)
            if now > self.limit_bytes:
                import faulthandler

                print(f"owned memory {now / GIB:.2f} GiB > limit {self.limit_bytes / GIB:.2f} "
                      f"GiB after '{self.rows[-1]['label'] if self.rows else 'start'}'; stacks:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)
            self._stop.wait(0.02)

    def mark(self, label: str, **extra) -> None:
        now = owned_bytes(os.getpid())
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        self.rows.append({"label": label, "owned": now, "peak": peak, **extra})
        print(f"{label}: owned {now / GIB:.2f} GiB, peak {peak / GIB:.2f}", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _rollout_like_batch(cfg, num_seqs: int, response_len: int, seed: int = 0):
    """``num_seqs`` chat-templated training prompts with random responses of ``response_len``
    tokens and +-1 advantages: the shapes of one step of the config."""
    import torch

    from gspo_megatron.data.dataset import load_prompt_dataset
    from gspo_megatron.learner.batch import SequenceBatch
    from gspo_megatron.trainer.preflight import load_tokenizer

    tok = load_tokenizer(cfg.model.hf_path)
    records = load_prompt_dataset(cfg.data.train_path, tok, cfg.data).records
    gen = torch.Generator().manual_seed(seed)
    n = cfg.rollout.n_samples_per_prompt
    prompts = [records[i // n].prompt_token_ids for i in range(num_seqs)]
    tokens = [torch.tensor(list(p) + torch.randint(0, 151_000, (response_len,), generator=gen)
                           .tolist()) for p in prompts]
    return SequenceBatch(token_ids=tokens, prompt_lens=[len(p) for p in prompts],
                         advantages=[1.0 if i % 2 else -1.0 for i in range(num_seqs)])


def _state_numel(learner) -> Dict[str, int]:
    """Elements in DDP's grad buffers, the optimizer's main weights and Adam's moments."""
    grad = sum(b.grad_data.numel() for c in learner.model
               for b in [*c.buffers, *c.expert_parallel_buffers])
    main = moments = 0
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        for group in getattr(opt, "shard_fp32_from_float16_groups", []):
            main += sum(p.numel() for p in group)
        for state in opt.optimizer.state.values():
            moments += sum(v.numel() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
    return {"grad_buffer": grad, "main_params": main, "adam_moments": moments}


def breakdown_main(work: Path, assets: Path, freeze: List[str], stop_before_step: bool,
                   limit_gib: float) -> None:
    """Phase 1 in this process: see the module docstring; writes ``breakdown_<freeze>.json``."""
    marks = Marks(limit_gib * GIB)
    import torch

    import gspo_megatron.learner.learner as learner_module
    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.checkpoint.gather import iter_hf_buckets
    from gspo_megatron.checkpoint.learner_hf import load_hf_into_learner, unwrapped_chunks
    from gspo_megatron.config import load_config
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.trainer.batching import take_sequences
    from gspo_megatron.weight_sync.buckets import Bucket

    cfg = load_config(CONFIG, run_overrides(assets, work / "unused", "python",
                                            f"optimizer.freeze=[{','.join(freeze)}]"))
    runtime = init_distributed(cfg.parallel, seed=0)
    marks.mark("imports + gloo process group")

    def marked(fn, label):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            marks.mark(label)
            return out
        return wrapper

    originals = {n: getattr(learner_module, n) for n in ("build_gpt_model", "wrap_ddp", "build_optimizer")}
    learner_module.build_gpt_model = marked(originals["build_gpt_model"], "model built (bf16)")
    learner_module.wrap_ddp = marked(originals["wrap_ddp"], "DDP: fp32 grad buffers")
    learner_module.build_optimizer = marked(originals["build_optimizer"],
                                            "distributed optimizer: fp32 main weights")
    try:
        learner = learner_module.Learner(cfg, runtime, total_steps=8)
    finally:
        for name, fn in originals.items():
            setattr(learner_module, name, fn)
    load_hf_into_learner(learner, cfg.model.hf_path)
    marks.mark("HF weights loaded")
    num_seqs = cfg.batch.num_prompts_per_step * cfg.rollout.n_samples_per_prompt
    batch = _rollout_like_batch(cfg, num_seqs, cfg.rollout.max_new_tokens)
    old = learner.compute_logprobs(batch).logprobs
    batch.old_logprobs = old
    marks.mark(f"log-prob pass ({num_seqs} sequences)")
    half = num_seqs // cfg.batch.num_mini_batches
    minis = [take_sequences(batch, list(range(i, i + half))) for i in range(0, num_seqs, half)]
    loss = get_policy_loss(cfg.algo.loss)
    if stop_before_step:
        learner.forward_backward(minis[0], loss)
        marks.mark("forward + backward (no optimizer step)")
    else:
        for i, mini in enumerate(minis[:2]):
            learner.train_step(mini, loss)
            marks.mark(f"GSPO train step {i + 1}" + (" (creates Adam's moments)" if i == 0 else ""))
        for items in iter_hf_buckets(unwrapped_chunks(learner), learner.model_cfg,
                                     cfg.rollout.weight_sync.bucket_bytes):
            flat = Bucket.from_items(items).flatten()  # what the broadcast transport sends
            del flat, items
        marks.mark("weight sync: every parameter gathered into HF buckets and flattened")
    marks.close()
    params = [p for c in unwrapped_chunks(learner) for p in c.parameters()]
    out = {"marks": marks.rows, "freeze": freeze, "stop_before_step": stop_before_step,
           "params": sum(p.numel() for p in params),
           "trainable": sum(p.numel() for p in params if p.requires_grad),
           "param_bytes": sum(p.numel() * p.element_size() for p in params),
           "state_numel": _state_numel(learner), "threads": torch.get_num_threads()}
    name = "_".join(freeze) or "none"
    (work / f"breakdown_{name}.json").write_text(json.dumps(out, indent=1))


# ---- 2. the training run -------------------------------------------------------------------

def _rows(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _is_server(pid: int) -> bool:
    line = command_line(pid)
    return any(mark in line for mark in SERVER_MARKS)


def train_phase(work: Path, assets: Path, steps: int, sglang_python: str,
                timeout_s: float, extra: Sequence[str] = ()) -> dict:
    """``gspo-train`` for ``steps`` steps under the split sampler; rows, peaks, wall time
    (also written to ``work/train.json``). ``extra``: more config overrides."""
    from gspo_megatron.distributed.ports import free_port

    run_dir = work / "run"
    work.mkdir(parents=True, exist_ok=True)
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "gspo_megatron.cli.train", str(CONFIG),
           *run_overrides(assets, run_dir, sglang_python, f"trainer.num_steps={steps}",
                          f"rollout.sglang.port={free_port()}", *extra)]
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def phase() -> str:
        rows = _rows(metrics)  # a row per step, after step 0's (written before step 1 starts)
        if not rows:
            return "start-up"
        return "steps" if rows[-1]["step"] < steps else "end"

    log_path = work / "train.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT)
    sampler = SplitMemorySampler(proc.pid, _is_server, phase=phase).start()
    code = None
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        sampler.stop()
        out = {"command": cmd, "rows": _rows(metrics), "peaks": sampler.peaks,
               "wall_s": time.monotonic() - start, "num_samples": sampler.num_samples,
               "returncode": code}
        (work / "train.json").write_text(json.dumps(out, indent=1))  # a failed run's too
    if code != 0:
        raise RuntimeError(f"gspo-train exited {code}:\n" + log_path.read_text()[-4000:])
    return out


class KilledRun(RuntimeError):
    """gspo-train was killed with SIGKILL (on a shared machine: the kernel's OOM killer)."""


def train_with_retries(opts, assets: Path, needed_bytes: float) -> dict:
    """The training phase, started when the machine has what the planner says the run needs
    plus ``--memory-margin-gib`` available; a run the kernel kills (other jobs took the memory
    meanwhile) is started again, up to ``--attempts`` times. The result counts the attempts."""
    from tests.real_sglang import SGLANG_PYTHON

    killed = []
    for attempt in range(1, opts.attempts + 1):
        waited = wait_for_memory(needed_bytes + opts.memory_margin_gib * GIB, opts.timeout_s)
        try:
            train = train_phase(opts.work, assets, opts.steps, SGLANG_PYTHON, opts.timeout_s)
        except RuntimeError:
            done = json.loads((opts.work / "train.json").read_text())
            if done["returncode"] != -9 or attempt == opts.attempts:
                raise
            killed.append({"peaks": done["peaks"], "rows": len(done["rows"])})
            print(f"attempt {attempt}: gspo-train was killed (SIGKILL) after {len(done['rows'])} "
                  "metrics rows; starting again", file=sys.stderr, flush=True)
            continue
        train.update(waited_for_memory_s=waited, attempts=attempt, killed_attempts=killed)
        return train
    raise AssertionError("unreachable")


def wait_for_memory(needed_bytes: float, timeout_s: float, poll_s: float = 10.0) -> float:
    """Wait until the machine has ``needed_bytes`` available (``/proc/meminfo`` MemAvailable:
    other jobs on a shared machine come and go); returns the seconds waited. Raises
    ``TimeoutError`` when it never does."""
    start = time.monotonic()
    while True:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
        if available >= needed_bytes:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{available / GIB:.1f} GiB available, {needed_bytes / GIB:.1f} "
                               f"needed, after {timeout_s:.0f} s")
        time.sleep(poll_s)


def step_split(rows: List[dict]) -> Dict[str, Dict[str, float]]:
    """Per timing key: step 1, and the median / min / max of the later steps."""
    steps = [r for r in rows if r["step"] >= 1]
    out = {}
    for name, key in SPLIT_KEYS.items():
        later = [r[key] for r in steps[1:] if key in r]
        out[name] = {"first": steps[0].get(key, float("nan")) if steps else float("nan"),
                     "median": statistics.median(later) if later else float("nan"),
                     "min": min(later, default=float("nan")), "max": max(later, default=float("nan"))}
    return out


# ---- 3. the planner's prediction -----------------------------------------------------------

def plan_phase(assets: Path, work: Path, sglang_python: str) -> dict:
    """``gspo-plan CONFIG --host --json`` with the run's overrides."""
    cmd = [sys.executable, "-m", "gspo_megatron.cli.plan", str(CONFIG),
           *run_overrides(assets, work / "run", sglang_python), "--host", "--json"]
    out = subprocess.run(cmd, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, check=True)
    return {"command": cmd, "plan": json.loads(out.stdout)["host"]}


# ---- the document --------------------------------------------------------------------------

def _g(b: float) -> str:
    return f"{b / GIB:.2f}"


def comparisons(train: dict, plan: dict) -> List[dict]:
    """Measured peak vs predicted, learner and server."""
    measured = {"learner": max(p["main"] for p in train["peaks"].values()),
                "server": max(p["branch"] for p in train["peaks"].values())}
    predicted = {"learner": plan["learner"]["peak_bytes"], "server": plan["server"]["peak_bytes"]}
    return [{"what": k, "measured": measured[k], "predicted": predicted[k],
             "error": predicted[k] / measured[k] - 1.0,
             "within": abs(predicted[k] / measured[k] - 1.0) <= TOLERANCE} for k in measured]


def section(result: dict, argv: List[str], conditions: Dict[str, str]) -> str:
    t, b, p = result["train"], result["breakdown"], result["plan"]
    lines = [BEGIN, "", "```bash", "flock /tmp/bigmem.lock " + shlex.join(
        ["python", "benchmarks/bench_real_width_train.py", *argv]), "```", "",
             "Conditions: " + "; ".join(f"{k} {v}" for k, v in conditions.items()) + ".", ""]
    for name, bd in b.items():
        moments = (f"{bd['state_numel']['adam_moments'] / 1e9:.3f} B" if not bd["stop_before_step"]
                   else f"not created: it stops before the first optimizer step (they would be "
                        f"{_g(8 * bd['trainable'])} GiB)")
        lines += [f"**Where the learner's memory goes** (`optimizer.freeze={bd['freeze'] or '[]'}`; "
                  f"{bd['params'] / 1e9:.3f} B parameters, {bd['trainable'] / 1e9:.3f} B trained, "
                  f"bf16 weights {_g(bd['param_bytes'])} GiB; grad buffer "
                  f"{bd['state_numel']['grad_buffer'] / 1e9:.3f} B fp32 elements, main weights "
                  f"{bd['state_numel']['main_params'] / 1e9:.3f} B, Adam moments {moments}; one "
                  f"process, {bd['threads']} threads):", "",
                  "| after | owned GiB | peak inside GiB |", "|---|---|---|"]
        lines += [f"| {m['label']} | {_g(m['owned'])} | {_g(m['peak'])} |" for m in bd["marks"]]
        lines.append("")
    split = step_split(t["rows"])
    last = [r for r in t["rows"] if r["step"] >= 1]
    retry = ""
    if t.get("killed_attempts"):
        retry = (f"; attempt {t['attempts']}: the kernel's OOM killer ended "
                 f"{len(t['killed_attempts'])} earlier one(s) while other jobs on this shared "
                 "machine held the rest of its memory (their learner peaks: " + ", ".join(
                     _g(k["peaks"].get("steps", k["peaks"].get("start-up", {})).get("main", 0))
                     for k in t["killed_attempts"]) + " GiB)")
    lines += [f"**`gspo-train` for {len(last)} GSPO steps** (wall {t['wall_s']:.0f} s from launch "
              f"to exit, server start and the final HF export included{retry}):", "",
              "```bash", shlex.join(["gspo-train", *[os.path.relpath(a, REPO)
                                                    if a == str(CONFIG) else a
                                                    for a in t["command"][3:]]]), "```", "",
              "| phase (metrics key) | step 1 s | steps 2+ median s (min-max) |", "|---|---|---|"]
    for name, key in SPLIT_KEYS.items():
        s = split[name]
        lines.append(f"| {name} (`{key}`) | {s['first']:.2f} | {s['median']:.2f} "
                     f"({s['min']:.2f}-{s['max']:.2f}) |")
    rewards = ", ".join(f"{r.get('reward/mean', float('nan')):.3f}" for r in last)
    probes = ", ".join(f"{r.get('weight_sync/probe_abs_logp', float('nan')):.4f}" for r in last)
    gaps = ", ".join(f"{r.get('rollout/learner_vs_engine_abs_logp', float('nan')):.4f}" for r in last)
    vol = ", ".join(f"{100 * r.get('routing/activated_expert_changed_frac', float('nan')):.2f}%"
                    for r in last)
    lines += ["", f"Per step: reward (brevity) {rewards}; weight-sync probe |dlogp| per token "
              f"{probes}; learner vs server |dlogp| on the rollouts {gaps}; activated experts "
              f"changed by the step's updates {vol}.", "",
              "Peak owned memory (RssAnon + RssShmem summed over each part's processes, sampled "
              "every 0.1 s), by phase of the run:", "",
              "| phase | learner (the trainer process) GiB | server (3 SGLang processes) GiB "
              "| both GiB |", "|---|---|---|---|"]
    for ph in ("start-up", "steps", "end"):
        if ph in t["peaks"]:
            pk = t["peaks"][ph]
            lines.append(f"| {ph} | {_g(pk['main'])} | {_g(pk['branch'])} | {_g(pk['total'])} |")
    plan = p["plan"]
    lines += ["", "**`gspo-plan --host`'s prediction** (`" + shlex.join(
        ["gspo-plan", os.path.relpath(CONFIG, REPO), "--host"]) + "`, same overrides):", "",
              "| process | predicted GiB (largest terms) | measured peak GiB | error | within 20% |",
              "|---|---|---|---|---|"]
    for c in result["comparisons"]:
        part = plan[c["what"]]
        top = ", ".join(f"{term['name']} {_g(term['bytes'])}" for term in
                        sorted(part["terms"], key=lambda x: -x["bytes"])[:3])
        lines.append(f"| {c['what']} | {_g(c['predicted'])} ({part['moment']}: {top}) | "
                     f"{_g(c['measured'])} | {100 * c['error']:+.1f}% | "
                     f"{'yes' if c['within'] else '**no**'} |")
    ok = all(c["within"] for c in result["comparisons"])
    lines += ["", "Result: " + ("both predictions within 20% of the measured peaks."
                                if ok else "**a prediction is off by more than 20%**."), "", END]
    return "\n".join(lines)


def write_doc(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no section marked {BEGIN!r} ... {END!r}")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(head + text + rest.split(END, 1)[1])


def _conditions(load_before: float) -> Dict[str, str]:
    import megatron.core
    import torch

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "CPUs": str(os.cpu_count()), "memory": f"{total / GIB:.1f} GiB",
            "load average (1 min) at start / end": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}",
            "code": commit + (" (with uncommitted changes)" if dirty else ""),
            "versions": f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
                        "sglang 0.5.23 (CPU)"}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/real_width_train"))
    parser.add_argument("--assets", type=Path, default=None,
                        help="a make_qwen3_assets directory (default: WORK/assets, written if missing)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--breakdown-freeze", nargs="*", default=["embedding,output_layer", ""],
                        help="freeze lists to break down ('' = nothing frozen: stops before Adam)")
    parser.add_argument("--skip-train", action="store_true", help="breakdown and plan only")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--attempts", type=int, default=3,
                        help="training runs to try when the kernel kills one (shared machine)")
    parser.add_argument("--memory-margin-gib", type=float, default=2.0,
                        help="start training when the planner's total plus this is available")
    parser.add_argument("--max-owned-gib", type=float, default=18.0,
                        help="a breakdown process stops (with its stacks) above this")
    parser.add_argument("--doc", type=Path, default=None)
    parser.add_argument("--render-from", type=Path, default=None,
                        help="write the section from WORK/results.json of an earlier run, "
                             "measuring nothing")
    parser.add_argument("--phase", choices=["breakdown"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--freeze", default="", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parser.parse_args(argv)
    if opts.steps < 2:
        parser.error("--steps must be >= 2 (step 1 also syncs the initial weights)")
    opts.work.mkdir(parents=True, exist_ok=True)
    assets = opts.assets or opts.work / "assets"
    if opts.render_from:  # the section again from a run's results.json (a template change)
        return _report(json.loads((opts.render_from / "results.json").read_text()), opts.doc)
    if opts.phase == "breakdown":
        freeze = [g for g in opts.freeze.split(",") if g]
        breakdown_main(opts.work, assets, freeze, stop_before_step=not freeze,
                       limit_gib=opts.max_owned_gib)
        return 0
    from tests.real_sglang import SGLANG_PYTHON

    if not (assets / "model" / "config.json").exists():
        from gspo_megatron.real_geometry.assets import make_qwen3_assets

        make_qwen3_assets(assets, geometry="30b", num_layers=1)
    load_before = os.getloadavg()[0]
    breakdown = {}
    for freeze in opts.breakdown_freeze:
        run = run_measured([sys.executable, str(Path(__file__).resolve()), "--phase", "breakdown",
                            "--work", str(opts.work), "--assets", str(assets), "--freeze", freeze,
                            "--max-owned-gib", str(opts.max_owned_gib)],
                           env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO),
                           timeout_s=opts.timeout_s)
        if run.returncode != 0:
            raise SystemExit(f"breakdown {freeze!r} failed:\n{run.output[-4000:]}")
        name = freeze.replace(",", "_") or "none"
        breakdown[name] = json.loads((opts.work / f"breakdown_{name}.json").read_text())
    plan = plan_phase(assets, opts.work, SGLANG_PYTHON)
    if opts.skip_train:
        print(json.dumps({"breakdown": breakdown, "plan": plan["plan"]}, indent=1))
        return 0
    train = train_with_retries(opts, assets, plan["plan"]["total_bytes"])
    result = {"train": train, "breakdown": breakdown, "plan": plan,
              "comparisons": comparisons(train, plan["plan"]),
              "argv": argv, "conditions": _conditions(load_before)}
    (opts.work / "results.json").write_text(json.dumps(result, indent=1, default=str))
    return _report(result, opts.doc)


def _report(result: dict, doc: Optional[Path]) -> int:
    text = section(result, result["argv"], result["conditions"])
    print("\n" + text)
    if doc:
        write_doc(doc, text)
    return 0 if all(c["within"] for c in result["comparisons"]) else 1


if __name__ == "__main__":
    sys.exit(main())
