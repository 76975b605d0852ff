"""Small synthetic reproduction directories for the report tests, in the format the runs write:
``<out>/sft/seed<k>`` and ``<out>/<variant>/seed<k>``, each with ``config.yaml`` (the resolved
config of ``configs/paper_tiny_moe.yaml`` plus the variant's overrides), ``metrics.jsonl`` and
``timing.json``; ``<out>/assets/model/model.safetensors`` (a header of 17 parameters).

Every RL run has ``NUM_STEPS`` steps and evaluates at steps 0, 4 and 8; the values are chosen so
the tests can work out the document's numbers by hand (see ``rl_rows``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Optional

from omegaconf import OmegaConf

from gspo_megatron.config import load_config
from gspo_megatron.experiments.paper_reproduction import CONFIG, VARIANTS

NUM_STEPS = 8
SEEDS = (1, 2, 3)
COLD = {1: (400, 0.40), 2: (600, 0.38), 3: (300, 0.39)}
"""Seed -> (cold-start steps, held-out accuracy)."""
END = {"gspo_learner": (0.70, 0.72, 0.65), "gspo_engine": (0.74, 0.73, 0.65),
       "grpo": (0.69, 0.71, 0.62), "grpo_replay": (0.68, 0.74, 0.64)}
"""Variant -> held-out accuracy at the end, per seed (mid-run evaluation: end - 0.1)."""
BASE = ("gspo_learner", "gspo_engine", "grpo", "grpo_replay")
"""The variants written by default (the numbers of the claims' tests are worked out for them)."""
R3 = ("grpo_r3", "grpo_bf16", "grpo_replay_bf16", "grpo_r3_bf16")
"""The routing-replay section's variants (``write_reproduction(..., routing=True)``)."""
GAP = {"grpo_bf16": 2e-3, "grpo_replay_bf16": 2e-3, "grpo_r3_bf16": 5e-4}
"""Learner vs engine log-prob gap per token (5e-7 for every other variant but gspo_engine)."""
GRPO_CLIP = {1: 0.04, 2: 0.04, 3: 0.04, 4: 0.04, 5: 0.01, 6: 0.01, 7: 0.002, 8: 0.002}
"""GRPO's token clip fraction per step (every seed); GSPO clips 0.3 at every step."""


def rl_rows(variant: str, end: float, loss: str) -> list:
    """Evaluations at 0 (0.4), 4 (end - 0.1) and 8 (end); constant diagnostics but GRPO's clip."""
    rows = [{"step": 0, "eval/accuracy": 0.4, "eval/num_prompts": 200.0}]
    for step in range(1, NUM_STEPS + 1):
        clip = 0.3 if loss == "gspo" else GRPO_CLIP[step]
        row = {"step": step, "reward/mean": 0.5 if loss == "gspo" else 0.52,
               "train/clip_frac_token": clip, "train/clip_frac_seq": clip if loss == "gspo" else 0.07,
               "routing/activated_expert_changed_frac": 0.02 if step <= 4 else 0.004,
               "routing/expert_set_changed_frac": 0.03, "train/seq_log_ratio_abs_mean": 0.035,
               "time/step_s": 0.25}
        if variant != "gspo_engine":
            row["rollout/learner_vs_engine_abs_logp"] = GAP.get(variant, 5e-7)
        rows.append(row)
    rows[4]["eval/accuracy"], rows[8]["eval/accuracy"] = end - 0.1, end
    return rows


def write_run(run_dir: Path, overrides, rows, started: float, wall_s: float) -> None:
    run_dir.mkdir(parents=True)
    cfg = load_config(CONFIG, list(overrides), validate=False)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "timing.json").write_text(json.dumps(
        {"started_unix": started, "wall_s": wall_s, "threads": 1, "jobs": 2, "num_cpus": 2,
         "load_avg_1min": 3.0}))


def write_assets(out: Path) -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]},
                         "__metadata__": {"format": "pt"}}).encode()
    path = out / "assets" / "model" / "model.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(68))


def write_reproduction(out: Path, end: Optional[Dict[str, tuple]] = None,
                       extra_variants: Optional[Dict[str, tuple]] = None,
                       routing: bool = False) -> None:
    """Cold starts and RL runs of ``BASE`` (with ``routing`` also ``R3``; plus
    ``extra_variants``: name -> overrides, ending like ``grpo``); run k of the grid starts at
    1e9 + 100 k and takes 60 s (cold: 20 s)."""
    end = {**END, **(end or {})}
    write_assets(out)
    common = [f"trainer.num_steps={NUM_STEPS}", "trainer.eval_every_steps=4"]
    for seed in SEEDS:
        steps, acc = COLD[seed]
        write_run(out / "sft" / f"seed{seed}", [*common, "trainer.num_steps=0", f"trainer.seed={seed}"],
                  [{"step": 0, "sft/num_steps": float(steps), "eval/accuracy": acc,
                    "eval/num_prompts": 200.0}], 1e9 + seed, 20.0)
    names = BASE + (R3 if routing else ())
    variants = {**{v: VARIANTS[v] for v in names}, **(extra_variants or {})}
    for k, (variant, overrides) in enumerate(variants.items()):
        loss = "gspo" if "algo.loss=gspo" in overrides else "grpo"
        for i, seed in enumerate(SEEDS):
            write_run(out / variant / f"seed{seed}", [*common, f"trainer.seed={seed}", *overrides],
                      rl_rows(variant, end.get(variant, END["grpo"])[i], loss),
                      1e9 + 100 * (3 * k + i + 1), 60.0)
