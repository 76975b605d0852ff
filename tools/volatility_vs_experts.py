#!/usr/bin/env python
"""Expert volatility against the number of experts at Qwen3-30B-A3B's widths: the fraction of
activated experts (top-k routing decisions) that one GSPO step's updates change, for 128, 64,
32 and 16 experts top-8 and for the tiny models' 8 experts top-2 (issue 39 item 8).

    flock /tmp/bigmem.lock python tools/volatility_vs_experts.py --out runs/experts \\
        --doc docs/paper_reproduction.md

The paper reads ~10% of activated experts changing per update on Qwen3-30B-A3B (48 layers, 128
experts top-8); our 8-expert top-2 tiny models read ~1%. Top-8 of 8 experts selects all of them
and can never change, so the 8-expert point routes top-2 as the tiny models do. Each point is a
1-layer checkpoint at the real widths (hidden 2048, 32 / 4 heads of 128, experts of width 768,
the real vocabulary and tokenizer; random bf16 weights, seed 0) that differs only in
``num_experts`` / ``num_experts_per_tok``, trained by ``gspo-train
configs/qwen3_30b_a3b_1layer_cpu.yaml`` (embedding and output layer frozen, the router and
experts train) against the real SGLang CPU server for ``--steps`` GSPO steps on the same prompts
(same seed: the same questions in the same order), the same learning rate and batch. Each step
records the top-k of every response token of all its sequences before and after the step's two
updates (``trainer/expert_volatility.py``). A finished point is not run again; each run's HF
export (1-2.5 GB) is deleted after it. ``--render`` writes the section again from the saved
``<out>/volatility_vs_experts.json`` without running anything.
Exit codes: 0 done, 1 a run failed (its log is named), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, no install

from gspo_megatron.experiments.paper_experts import (ExpertPoint, load_points,  # noqa: E402
                                                     point_from_rows, save_points, section,
                                                     write_section)

DEFAULT_ROUTINGS = ("128x8", "64x8", "32x8", "16x8", "8x2")
CONFIG = REPO / "configs" / "qwen3_30b_a3b_1layer_cpu.yaml"
SMOKE = dict(routings=("8x2", "16x8"), steps=1,
             extra=("rollout.engine=embedded", "rollout.mode=colocated",
                    "rollout.weight_sync.transport=auto", "rollout.weight_sync.verify=false",
                    "batch.num_prompts_per_step=2", "rollout.max_new_tokens=4",
                    "rollout.embedded_dtype=bf16"))
"""``--smoke`` (the test): tiny widths, the embedded engine, one step per routing."""
TINY_WIDTHS = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32}


def parse_routing(text: str) -> Tuple[int, int]:
    """``"128x8"`` -> (128 experts, top-8)."""
    try:
        experts, top_k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"routing {text!r}: expected EXPERTSxTOPK, e.g. 128x8")
    if not 1 <= top_k < experts:
        raise argparse.ArgumentTypeError(f"routing {text!r}: need 1 <= top-k < experts (top-k = "
                                         "experts routes every token to all of them: nothing "
                                         "can change)")
    return experts, top_k


def write_point_assets(out: Path, experts: int, top_k: int, tokenizer_dir: Path,
                       widths: Optional[dict] = None) -> Path:
    """The 1-layer checkpoint of one routing and the question data; returns the assets dir."""
    from gspo_megatron.real_geometry.checkpoint_writer import write_random_checkpoint
    from gspo_megatron.real_geometry.geometries import GENERATION_CONFIG, geometry_config
    from gspo_megatron.real_geometry.task import write_question_datasets

    assets = out / f"e{experts}_top{top_k}" / "assets"
    if not (assets / "model" / "config.json").exists():
        cfg = {**geometry_config("30b", 1), **(widths or {}), "num_experts": experts,
               "num_experts_per_tok": top_k}
        write_random_checkpoint(assets / "model", cfg, GENERATION_CONFIG, tokenizer_dir, seed=0,
                                max_shard_bytes=10**9)
        write_question_datasets(assets / "data")
    return assets


def run_point(out: Path, experts: int, top_k: int, steps: int, tokenizer_dir: Path,
              sglang_python: str, extra: Sequence[str] = (), widths: Optional[dict] = None,
              keep: bool = False) -> ExpertPoint:
    """Train one routing for ``steps`` GSPO steps (or read its finished run)."""
    from gspo_megatron.distributed.ports import free_port
    from gspo_megatron.trainer.metrics_log import read_rows

    assets = write_point_assets(out, experts, top_k, tokenizer_dir, widths)
    run_dir = assets.parent / "run"
    metrics = run_dir / "metrics.jsonl"
    rows = read_rows(metrics) if metrics.exists() else []
    if not rows or rows[-1]["step"] < steps:
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "gspo_megatron.cli.train", str(CONFIG),
               f"model.hf_path={assets / 'model'}",
               f"data.train_path={assets / 'data' / 'train.jsonl'}", f"logging.run_dir={run_dir}",
               f"trainer.num_steps={steps}", f"rollout.sglang.python={sglang_python}",
               f"rollout.sglang.port={free_port()}", "logging.plot=false",
               "algo.diagnostics.expert_volatility_num_seqs=1000", *extra]
        log_path = assets.parent / "train.log"
        logging.info("%d experts top-%d: %s", experts, top_k, shlex.join(cmd))
        with open(log_path, "w") as log:
            code = subprocess.run(cmd, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONPATH=str(REPO))).returncode
        if code != 0:
            raise RuntimeError(f"{experts} experts top-{top_k}: gspo-train exited {code}; "
                               f"log: {log_path}")
        rows = read_rows(metrics)
    if not keep:
        for name in ("checkpoints", "hf_export"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    return point_from_rows(experts, top_k, rows)


def setting_text(steps: int, smoke: bool) -> str:
    """What was compared, for the document."""
    if smoke:
        return "Smoke run (tiny widths, embedded engine): not a measurement."
    return (f"Each routing is a 1-layer checkpoint at Qwen3-30B-A3B's widths (hidden 2048, 32 / 4 "
            "heads of 128, experts of width 768, vocabulary 151,936; random bf16 weights, seed "
            "0) that differs only in its number of experts and top-k, trained by `gspo-train "
            "configs/qwen3_30b_a3b_1layer_cpu.yaml` against the real SGLang CPU server: the "
            "same 4 prompts per step (same seed: the same questions in the same order), 4 "
            "samples of each generated by that model, lr 1e-5, two updates per step, "
            "embedding and output layer frozen (router, experts and attention train), reward "
            f"`brevity`; {steps} GSPO steps each. Every step compares the top-k of every "
            "response token of all 16 sequences before and after its two updates "
            "(`trainer/expert_volatility.py`). 8 experts route top-2 (as the tiny models of "
            "this document do): top-8 of 8 selects every expert and cannot change.")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/experts"))
    parser.add_argument("--routings", type=parse_routing, nargs="+",
                        default=[parse_routing(r) for r in DEFAULT_ROUTINGS],
                        help="EXPERTSxTOPK each (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="GSPO steps per routing")
    parser.add_argument("--doc", type=Path, help="rewrite this document's marked section")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite --doc's section from <out>/volatility_vs_experts.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny widths, embedded engine, 2 routings, 1 step (the test)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.render:
        if not args.doc:
            parser.error("--render needs --doc")
        points, setting = load_points(args.out / "volatility_vs_experts.json")
        if "steps" in setting:  # the description as the tool words it now
            setting["what"] = setting_text(setting["steps"], setting["smoke"])
        write_section(args.doc, section(points, setting))
        return 0
    extra, widths = (), None
    if args.smoke:
        args.routings = [parse_routing(r) for r in SMOKE["routings"]]
        args.steps, extra, widths = SMOKE["steps"], SMOKE["extra"], TINY_WIDTHS
    from gspo_megatron.real_geometry.tokenizer_fetch import fetch_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.out / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        fetch_tokenizer(tokenizer_dir)
    sglang_python = os.environ.get("GSPO_SGLANG_PYTHON", str(REPO / ".venv-sglang" / "bin" / "python"))
    load = os.getloadavg()[0]
    points = []
    try:
        for experts, top_k in args.routings:
            points.append(run_point(args.out, experts, top_k, args.steps, tokenizer_dir,
                                    sglang_python, extra, widths, args.keep_checkpoints))
            logging.info("%s: %.2f%% of activated experts changed per step (top-k set %.2f%%)",
                         points[-1].label, 100 * points[-1].activated_mean,
                         100 * points[-1].topk_set_mean)
    except RuntimeError as exc:
        logging.error("%s", exc)
        return 1
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    setting = {"command": "flock /tmp/bigmem.lock " + shlex.join(
                   ["python", "tools/volatility_vs_experts.py", *argv]),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "cpus": os.cpu_count(), "load": f"{load:.1f} at the start, "
               f"{os.getloadavg()[0]:.1f} at the end", "code": commit,
               "steps": args.steps, "smoke": args.smoke,
               "what": setting_text(args.steps, args.smoke)}
    save_points(args.out / "volatility_vs_experts.json", points, setting)
    if args.doc:
        write_section(args.doc, section(points, setting))
    return 0


if __name__ == "__main__":
    sys.exit(main())
