"""Planner estimate vs measured peak memory of small learners on CPU (the docs/planner.md table).

For each (model, layout) case, fresh processes (one per rank, gloo) build the real learner
(Megatron-Core GPTModel, DDP, distributed optimizer) under :class:`LiveTensorBytes`
(``benchmarks/live_tensor_bytes.py``: peak bytes of live tensor storages), run one log-prob pass
and two GSPO train steps on micro-batches filled to the token budget, and report each rank's
peak. The planner's estimate for the same config (``kernel=local``, fp32) is computed without
torch. One JSON line per case, then a markdown table.

    OMP_NUM_THREADS=1 python benchmarks/bench_planner_memory.py            # every case
    python benchmarks/bench_planner_memory.py --cases moe_tiny/1proc       # one case
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gspo_megatron.config.schema import GSPOConfig, ModelConfig, ParallelConfig  # noqa: E402

_LOCAL = dict(transformer_impl="local", params_dtype="fp32", make_vocab_size_divisible_by=8,
              max_position_embeddings=512)
MODELS = {
    "moe_tiny": dict(arch="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, num_query_groups=2, head_dim=16, vocab_size=1000,
                     num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64),
    "dense_small": dict(arch="qwen3", num_layers=4, hidden_size=256, ffn_hidden_size=768,
                        num_attention_heads=8, num_query_groups=4, head_dim=32, vocab_size=4000,
                        num_experts=0),
    "moe_medium": dict(arch="qwen3_moe", num_layers=3, hidden_size=256, ffn_hidden_size=512,
                       num_attention_heads=8, num_query_groups=2, head_dim=32, vocab_size=6000,
                       num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=128),
}
LAYOUTS = {
    "1proc": dict(),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
    "tp2sp": dict(tp=2, sp=True),
    "pp2_uneven": dict(pp=2, num_layers_in_first_pipeline_stage=1,
                       num_layers_in_last_pipeline_stage=2),
}
CASES = ["moe_tiny/1proc", "moe_tiny/ep2", "dense_small/1proc", "dense_small/pp2",
         "dense_small/tp2sp", "moe_medium/1proc", "moe_medium/tp2sp", "moe_medium/pp2_uneven"]
"""The calibration cases (the estimate was written against them)."""
OUT_OF_SAMPLE = ["dense_small/1proc_bf16", "moe_medium/dp2", "moe_tiny/1proc_seq768",
                 "dense_small/pp2_micro6"]
"""Chosen and written down before they were first run (issue 30), reported apart: bf16
parameters (fp32 main grads and Adam state), DP=2 with the distributed optimizer sharding Adam
state, sequences of 768 tokens, and PP=2 with 6 micro-batches in flight per rank."""
LAYOUTS.update({"1proc_bf16": dict(), "dp2": dict(world_size=2), "1proc_seq768": dict(),
                "pp2_micro6": dict(pp=2)})
SEQ_LEN, PROMPT_LEN, ROWS, MICRO_PER_RANK = 128, 16, 4, 2
SHAPES = {"moe_tiny/1proc_seq768": dict(seq_len=768, prompt_len=64, rows=1),
          "dense_small/pp2_micro6": dict(micro_per_rank=6)}
"""Per-case micro-batch shape, where it differs from the defaults above."""
RECOMPUTE = {"dense_small/tp2sp": "selective", "moe_medium/pp2_uneven": "full"}
DTYPE = {"dense_small/1proc_bf16": "bf16"}


def shape(case: str) -> dict:
    """``seq_len``, ``prompt_len``, ``rows`` (per micro-batch) and ``micro_per_rank`` of a case."""
    return {**dict(seq_len=SEQ_LEN, prompt_len=PROMPT_LEN, rows=ROWS, micro_per_rank=MICRO_PER_RANK),
            **SHAPES.get(case, {})}


def case_config(case: str) -> GSPOConfig:
    """The learner config of a ``model/layout`` case."""
    model, layout = case.split("/")
    sh = shape(case)
    cfg = GSPOConfig()
    cfg.model = ModelConfig(**MODELS[model], **dict(_LOCAL, params_dtype=DTYPE.get(case, "fp32")),
                            recompute=RECOMPUTE.get(case, "none"))
    cfg.model.max_position_embeddings = max(512, sh["seq_len"])
    cfg.parallel = ParallelConfig(**LAYOUTS[layout])
    cfg.batch.max_tokens_per_micro_batch = sh["seq_len"] * sh["rows"]
    cfg.optimizer.lr = 1e-4
    object.__setattr__(cfg, "_bench_case", case)
    return cfg


def world_size(cfg: GSPOConfig) -> int:
    """Processes the case runs on (its world_size, else the smallest its layout needs)."""
    p = cfg.parallel
    return p.world_size or max(p.tp * p.pp * p.cp, p.ep * p.etp * p.pp)


def case_of(cfg: GSPOConfig) -> str:
    """The case a config was built for (its tag, set by :func:`case_config`)."""
    return getattr(cfg, "_bench_case", "")


def estimate(cfg: GSPOConfig):
    """The planner's estimate of this case (no torch)."""
    from gspo_megatron.planner.activations import MicroBatchShape
    from gspo_megatron.planner.learner_memory import Workload, estimate_stages
    from gspo_megatron.planner.model_shape import Layout, ModelShape
    from gspo_megatron.planner.precision import Precision

    layout = Layout.from_parallel_config(cfg.parallel, world_size(cfg))
    sh = shape(case_of(cfg))
    mb = MicroBatchShape(tokens=sh["seq_len"] * sh["rows"], seq_len=sh["seq_len"],
                         response_tokens=(sh["seq_len"] - sh["prompt_len"]) * sh["rows"])
    work = Workload(mb, sh["micro_per_rank"], recompute=cfg.model.recompute, kernel="local")
    return estimate_stages(ModelShape.from_model_config(cfg.model), layout,
                           Precision.from_config(cfg, on_gpu=False), work)


def _worker(case: str, out: str) -> None:
    import torch

    from benchmarks.live_tensor_bytes import LiveTensorBytes
    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.batch import SequenceBatch
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    cfg = case_config(case)
    sh = shape(case)
    runtime = init_distributed(cfg.parallel, seed=1)
    dp = ps.get_data_parallel_world_size()
    num_seqs = sh["rows"] * sh["micro_per_rank"] * dp
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, cfg.model.vocab_size, (sh["seq_len"],), generator=gen)
              for _ in range(num_seqs)]
    adv = [float(i % 3) - 1.0 for i in range(num_seqs)]
    peaks = {}
    with LiveTensorBytes() as probe:
        from gspo_megatron.learner.learner import Learner

        learner = Learner(cfg, runtime, total_steps=4)
        peaks["build"] = probe.peak_bytes
        batch = SequenceBatch(token_ids=tokens, prompt_lens=[sh["prompt_len"]] * num_seqs,
                              advantages=adv)
        old = learner.compute_logprobs(batch).logprobs
        peaks["logprobs"] = probe.peak_bytes
        batch.old_logprobs = old
        plan = learner.plan(batch)
        for step in (1, 2):
            probe.reset_peak()
            learner.train_step(batch, get_policy_loss("gspo"))
            peaks[f"step{step}"] = probe.peak_bytes
        peaks["overall"] = max(peaks.values())
    Path(out).write_text(json.dumps({
        "rank": runtime.launch.rank, "stage": ps.get_pipeline_model_parallel_rank(),
        "peaks": peaks, "micro_batches": len(plan.micro_batches),
        "tokens_per_micro": int(plan.micro_batches[0].tokens.numel())}))


def measure(case: str) -> list:
    """Run the case on fresh processes; returns each rank's result."""
    from gspo_megatron.distributed.ports import free_port

    cfg = case_config(case)
    world = world_size(cfg)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rank in range(world):
            out = os.path.join(tmp, f"rank{rank}.json")
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=str(REPO))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", case, out],
                                          env=env, cwd=str(REPO)))
            outs.append(out)
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise RuntimeError(f"{case}: worker exit codes {codes}")
        return [json.loads(Path(o).read_text()) for o in outs]


def compare(case: str) -> dict:
    """Every rank's measured peak against the estimate of its pipeline stage."""
    ranks = measure(case)
    stages = estimate(case_config(case))
    rows = []
    for r in ranks:
        est = stages[r["stage"]]
        measured = r["peaks"]["overall"]
        rows.append({"rank": r["rank"], "stage": r["stage"], "measured_mb": measured / 1e6,
                     "estimate_mb": est.peak_bytes / 1e6, "error": est.peak_bytes / measured - 1,
                     "estimate_moment": est.peak_moment,
                     "terms_mb": {t.name: round(t.bytes / 1e6, 3) for t in est.terms},
                     "measured_phases_mb": {k: round(v / 1e6, 3) for k, v in r["peaks"].items()},
                     "tokens_per_micro": r["tokens_per_micro"],
                     "micro_batches": r["micro_batches"]})
    worst = max(rows, key=lambda row: abs(row["error"]))
    return {"case": case, "recompute": case_config(case).model.recompute, "ranks": rows,
            "measured_mb": max(row["measured_mb"] for row in rows),
            "estimate_mb": max(row["estimate_mb"] for row in rows),
            "worst_rank_error": worst["error"]}


def main(argv=None) -> int:
    """Run the cases (or, with ``--worker``, one rank of one case)."""
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=None,
                        help=f"default: the --set's cases (calibration: {' '.join(CASES)})")
    parser.add_argument("--set", choices=("calibration", "out-of-sample"), default="calibration",
                        help=f"out-of-sample: {' '.join(OUT_OF_SAMPLE)}")
    parser.add_argument("--out", help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    cases = args.cases or (CASES if args.set == "calibration" else OUT_OF_SAMPLE)
    start = time.monotonic()
    rows = []
    for case in cases:
        row = compare(case)
        print(json.dumps(row), flush=True)
        rows.append(row)
    table = ["| model / layout | shape | recompute | rank (stage) | measured peak (MB) | estimate (MB) "
             "| error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = shape(r["case"])
        what = (f"{sh['rows']} x {sh['seq_len']} tokens, {sh['micro_per_rank']} micro/rank, "
                f"{DTYPE.get(r['case'], 'fp32')}")
        for rank in r["ranks"]:
            table.append(f"| {r['case']} | {what} | {r['recompute']} | {rank['rank']} ({rank['stage']}) | "
                         f"{rank['measured_mb']:.2f} | {rank['estimate_mb']:.2f} | "
                         f"{100 * rank['error']:+.1f}% |")
    print("\n" + "\n".join(table))
    if args.out:
        worst = max((rank for r in rows for rank in r["ranks"]), key=lambda rank: abs(rank["error"]))
        Path(args.out).write_text(
            f"# Planner memory, {args.set} cases\n\nWritten by `OMP_NUM_THREADS=1 python "
            f"benchmarks/bench_planner_memory.py --set {args.set} --out {args.out}` on "
            f"{time.strftime('%Y-%m-%d')} ({os.cpu_count()} CPU cores; tensor bytes do not depend on "
            f"the load), {(time.monotonic() - start) / 60:.1f} min. Method: docs/planner.md, "
            f"section 2. Largest error {100 * worst['error']:+.1f}%.\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
