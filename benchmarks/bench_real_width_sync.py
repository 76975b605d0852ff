"""Weight sync at Qwen3-30B-A3B's real widths into the real SGLang CPU server, against the floors.

    flock /tmp/bigmem.lock python benchmarks/bench_real_width_sync.py --work /tmp/real_width_sync \
        --doc docs/real_geometry.md

The real SGLang 0.5.23 CPU server (``tests/real_sglang.py``) loads the 1-layer Qwen3-30B-A3B
checkpoint of ``tools/make_qwen3_assets.py`` (written, or reused with ``--assets``); the learner
the trainer builds, without its optimizer (``LogprobLearner``, TP2 x EP2 on two gloo ranks under
torchrun), loads the same weights. For each CPU transport (``disk``; ``tensor``: handles to named
shared memory; ``nccl``: a gloo broadcast group the server joins) the ranks run the trainer's own
sync (``trainer/build.py: _build_weight_sync`` -> ``LearnerWeightSync`` -> ``run_update``)
``--num-syncs`` times. Before each sync every learner weight is rolled by one place along its last
dim (new values, same scale), so each sync carries other bytes than the server holds; the
trainer's verification probe (``trainer/sync_check.py``: the server samples a few tokens of the first training prompt,
the learner recomputes their log-probs) runs before the sync (the server still serves the previous
weights: its gap must exceed the tolerance, or the probe could not tell) and after it (within).

Floors, measured by the same two ranks right before each sync: a memcpy of the sync's bytes
(one flat uint8 buffer into another, both touched before) on rank 0; one gloo broadcast of one
flat buffer of that size from rank 0 to rank 1 (the slower rank's time): **the floor**; and the
same broadcast into an untouched buffer (what a server that allocates per bucket pays). The
ratio is the median over the syncs of each sync's time over its own floor (the shared machine's
load drifts); the time per tensor that is not copying is ``(sync - floor) / tensors``. The profile splits each sync by ``run_update``'s phases
(``weight_sync/*_s``, ``weight_sync/sync.py``). The command, the conditions and the numbers go into
the marked section of ``--doc``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.owned_memory import OwnedMemorySampler, run_measured  # noqa: E402

GIB = 2 ** 30
TRANSPORTS = ("disk", "tensor", "nccl")
BEGIN = "<!-- bench_real_width_sync: begin (written by the benchmark; do not edit) -->"
END = "<!-- bench_real_width_sync: end -->"
CONTROL = ("pause", "abort", "begin", "end", "flush", "continue", "connect")
"""``weight_sync/<phase>_s`` of the engine's protocol around the buckets (and group formation)."""
NOT_PHASES = ("weight_sync/total_s", "weight_sync/transfer_s", "weight_sync/gb_per_s")


# ---- on the learner ranks (torchrun) -----------------------------------------------------------

def _broadcast_s(buf: torch.Tensor) -> float:
    """Seconds of one gloo broadcast of ``buf`` from rank 0, on the slower of the 2 ranks."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(buf, src=0)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def measure_floors(num_bytes: int, repeats: int = 3) -> Dict[str, float]:
    """Collective over the 2 ranks, median seconds of: a memcpy of ``num_bytes`` on rank 0; one
    gloo broadcast of a flat ``num_bytes`` buffer from rank 0 to rank 1 (both buffers touched
    before: page faults are not the floor); the same broadcast into a new, untouched buffer on
    rank 1, as a server receives every bucket (how much its page faults add)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.ones(num_bytes, dtype=torch.uint8)
    copy_s = []
    if rank == 0:
        dst = torch.zeros_like(buf)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(buf)
            copy_s.append(time.perf_counter() - t0)
        del dst
    bcast_s = [_broadcast_s(buf) for _ in range(repeats)]
    ok = rank == 0 or bool((buf == 1).all())  # the bytes did arrive
    fresh_s = []
    for _ in range(repeats):
        if rank != 0:
            del buf
            buf = torch.empty(num_bytes, dtype=torch.uint8)
        fresh_s.append(_broadcast_s(buf))
    return {"memcpy_s": statistics.median(copy_s) if copy_s else 0.0,
            "gloo_s": statistics.median(bcast_s), "gloo_fresh_s": statistics.median(fresh_s),
            "received": ok}


def change_weights(learner) -> None:
    """New weights of the same scale: every local parameter rolled by one along its last dim
    (the hidden features of embedding and output rows, so vocabulary padding rows stay where
    they are), the same on every rank that holds a copy."""
    with torch.no_grad():
        for chunk in learner.model:
            for p in chunk.parameters():
                p.copy_(p.roll(1, dims=-1))


def _sync_config(base, transport: str, bucket_bytes: int, work: Path):
    """``base`` with another ``rollout.weight_sync`` (the rest shared)."""
    from dataclasses import replace

    return replace(base, rollout=replace(base.rollout, weight_sync=replace(
        base.rollout.weight_sync, transport=transport, bucket_bytes=bucket_bytes,
        disk_dir=str(work / "disk"))))


def ranks_main(work: Path) -> None:
    """Every rank: load the learner, then per transport floors, syncs and probes."""
    import torch.distributed as dist

    from gspo_megatron.checkpoint.convert import model_config_for_hf_dir
    from gspo_megatron.checkpoint.learner_hf import load_hf_into_learner
    from gspo_megatron.config.schema import GSPOConfig, ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import LogprobLearner
    from gspo_megatron.trainer.build import _build_weight_sync
    from gspo_megatron.trainer.sync_check import SyncCheck

    plan = json.loads((work / "plan.json").read_text())
    cfg = GSPOConfig()
    cfg.model = model_config_for_hf_dir(plan["model_dir"])
    cfg.parallel = ParallelConfig(tp=2, ep=2, sp=True)
    cfg.rollout.engine, cfg.rollout.mode = "sglang", "disaggregated"
    cfg.logging.run_dir = str(work)
    runtime = init_distributed(cfg.parallel, seed=0)
    learner = LogprobLearner(cfg, runtime)
    load_hf_into_learner(learner, plan["model_dir"])
    engine = None
    if runtime.is_main:
        from gspo_megatron.rollout.sglang.engine import SGLangEngine

        engine = SGLangEngine.attach([plan["address"]], request_timeout_s=600.0)
    # the trainer's probe; its gap is judged against the tolerance in summarize(), so that a
    # gap over it is reported with the others instead of ending the run
    probe = SyncCheck(learner, engine, plan["prompt"], 1.0, float("inf"), runtime.is_main)
    results: Dict = {"threads": torch.get_num_threads(), "transports": {}}
    count = 0
    for name in plan["transports"]:
        parts = SimpleNamespace(learner=learner, engine=engine, run_dir=work)
        syncer = _build_weight_sync(parts, _sync_config(cfg, name, plan["bucket_bytes"], work),
                                    runtime)
        syncs = []
        for _ in range(plan["num_syncs"]):
            count += 1
            change_weights(learner)
            version = f"{name}-{count}"
            before = probe(version).get("weight_sync/probe_abs_logp")
            floors = measure_floors(plan["num_bytes"], plan["floor_repeats"])  # right before
            dist.barrier()
            t0 = time.perf_counter()
            metrics = syncer(version)
            wall = time.perf_counter() - t0
            after = probe(version).get("weight_sync/probe_abs_logp")
            syncs.append({**metrics, **{f"floor_{k}": v for k, v in floors.items()},
                          "wall_s": wall, "probe_before": before, "probe_after": after})
        if syncer.transport is not None:
            syncer.transport.close()
        results["transports"][name] = {"syncs": syncs}
        if runtime.is_main:  # kept transport by transport: a later failure leaves these
            (work / "ranks.json").write_text(json.dumps(results, indent=1))
    if runtime.is_main:
        engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()


# ---- the run ---------------------------------------------------------------------------------

def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint (what one sync moves), from the shard headers."""
    import struct

    total = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(m["data_offsets"][1] - m["data_offsets"][0]
                     for k, m in header.items() if k != "__metadata__")
    return total


def run_syncs(model_dir: Path, address: str, server_pid: int, prompt: List[int], work: Path,
              transports=TRANSPORTS, num_syncs: int = 3, bucket_bytes: int = 512 * 2 ** 20,
              tolerance: float = 0.05, floor_repeats: int = 1,
              timeout_s: float = 3600.0) -> Dict:
    """The ranks' phase against a running server (its process tree sampled for memory)."""
    work.mkdir(parents=True, exist_ok=True)
    plan = {"model_dir": str(model_dir), "address": address, "prompt": list(prompt),
            "transports": list(transports), "num_syncs": num_syncs, "bucket_bytes": bucket_bytes,
            "tolerance": tolerance, "num_bytes": checkpoint_bytes(model_dir),
            "floor_repeats": floor_repeats}
    (work / "plan.json").write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--phase", "ranks", "--work", str(work)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with OwnedMemorySampler(server_pid) as server_mem:
        run = run_measured(cmd, env=env, cwd=str(REPO), timeout_s=timeout_s,
                           log_path=str(work / "ranks.log"))
    if run.returncode != 0:
        raise RuntimeError(f"sync ranks failed ({run.returncode}):\n{run.output[-6000:]}")
    ranks = json.loads((work / "ranks.json").read_text())
    return {"plan": plan, "ranks": ranks, "learner_peak_gib": run.peak_bytes / GIB,
            "server_peak_gib": server_mem.peak_bytes / GIB, "wall_s": run.wall_s}


def summarize(result: Dict) -> Dict[str, Dict]:
    """Per transport: medians over the syncs of the time, the floors measured right before
    each, the ratios sync / floor (each sync against its own floors: the machine's load drifts),
    the profile, and the probe checks. The floor is one gloo broadcast of the bytes (every
    transport brings them out of a gloo learner into another process); the memcpy ratio says
    how far each is from any copy."""
    plan, out = result["plan"], {}
    for name, r in result["ranks"]["transports"].items():
        syncs = r["syncs"]
        med = lambda values: statistics.median(list(values))  # noqa: E731
        num_tensors = int(syncs[0]["weight_sync/num_tensors"])
        totals = [s["weight_sync/total_s"] for s in syncs]
        phases = sorted({k[len("weight_sync/"):-2] for s in syncs for k in s
                         if k.startswith("weight_sync/") and k.endswith("_s")
                         and k not in NOT_PHASES})
        probes = [(s["probe_before"], s["probe_after"]) for s in syncs]
        out[name] = {
            "num_bytes": int(round(syncs[0]["weight_sync/gb"] * 1e9)),
            "num_buckets": int(syncs[0]["weight_sync/num_buckets"]),
            "num_tensors": num_tensors, "total_s": med(totals), "totals": totals,
            "floor_s": med(s["floor_gloo_s"] for s in syncs),
            "memcpy_s": med(s["floor_memcpy_s"] for s in syncs),
            "gloo_fresh_s": med(s["floor_gloo_fresh_s"] for s in syncs),
            "floor_received": all(s["floor_received"] for s in syncs),
            "ratios": [s["weight_sync/total_s"] / s["floor_gloo_s"] for s in syncs],
            "ratio": med(s["weight_sync/total_s"] / s["floor_gloo_s"] for s in syncs),
            "ratio_memcpy": med(s["weight_sync/total_s"] / s["floor_memcpy_s"] for s in syncs),
            "phases": {p: med(s.get(f"weight_sync/{p}_s", 0.0) for s in syncs) for p in phases},
            "probes": probes,
            "probe_ok": all(b is not None and a is not None and b > plan["tolerance"] >= a
                            for b, a in probes),
            "per_tensor_us": med((s["weight_sync/total_s"] - s["floor_gloo_s"]) / num_tensors
                                 for s in syncs) * 1e6}
    return out


# ---- the doc ---------------------------------------------------------------------------------

def _fmt_phases(phases: Dict[str, float]) -> str:
    control = sum(v for k, v in phases.items() if k in CONTROL)
    rest = [f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])
            if k not in CONTROL and v >= 0.005]
    return ", ".join(rest + [f"protocol {control:.2f}"])


def section(result: Dict, summary: Dict, argv: List[str], conditions: Dict[str, str]) -> str:
    plan = result["plan"]
    lines = [BEGIN, "", "```bash", "flock /tmp/bigmem.lock " + shlex.join(
        ["python", "benchmarks/bench_real_width_sync.py", *argv]), "```", "",
        "Conditions: " + "; ".join(f"{k} {v}" for k, v in conditions.items()) + ".", "",
        f"{plan['num_syncs']} syncs per transport of {plan['num_bytes'] / 1e9:.3f} GB "
        f"(bf16) from the TP2 x EP2 learner (2 gloo ranks, {result['ranks']['threads']} torch "
        f"thread each) into one real SGLang server, `weight_sync.bucket_bytes` = "
        f"{plan['bucket_bytes'] / 2**20:g} MiB. Peak owned memory: server "
        f"{result['server_peak_gib']:.2f} GiB, learner ranks {result['learner_peak_gib']:.2f} GiB "
        "(floors' buffers included).", "",
        "Floors, measured by the learner's two ranks right before each sync: memcpy = one "
        "flat buffer of the sync's bytes copied into another on rank 0; gloo = one gloo "
        "broadcast of such a buffer from rank 0 to rank 1 (**the floor**), both buffers touched "
        "before; gloo, new buffer = the same broadcast into an untouched buffer, as a server "
        "receives each bucket. Each sync is divided by its own floors (the load drifts), then "
        "the median is taken. Not copying, per tensor = (sync - floor) / tensors.", "",
        "| transport | buckets | tensors | sync s (median; each) | memcpy s | gloo s | "
        "gloo, new buffer s | sync / floor (median; each) | sync / memcpy | "
        "not copying, per tensor |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        each = ", ".join(f"{t:.2f}" for t in s["totals"])
        ratios = ", ".join(f"{r:.2f}" for r in s["ratios"])
        lines.append(f"| {name} | {s['num_buckets']} | {s['num_tensors']} | {s['total_s']:.2f} "
                     f"({each}) | {s['memcpy_s']:.3f} | {s['floor_s']:.3f} | "
                     f"{s['gloo_fresh_s']:.3f} | **{s['ratio']:.2f}x** ({ratios}) | "
                     f"{s['ratio_memcpy']:.2f}x | {s['per_tensor_us'] / 1e3:.2f} ms |")
    lines += ["", "Where each sync's time goes (median s; `weight_sync/*_s` of `run_update`; "
              "send = the transport's share, split into its own parts; protocol = pause, abort, "
              "begin, end, flush, continue and group formation):", "",
              "| transport | profile |", "|---|---|"]
    lines += [f"| {n} | {_fmt_phases(s['phases'])} |" for n, s in summary.items()]
    lines += ["", f"Verification probe (`trainer/sync_check.py`, tolerance "
              f"{plan['tolerance']:g} mean \\|dlogp\\| per token): before each sync (the server "
              "still serves the previous weights) / after it:", "",
              "| transport | before / after, each sync | probe |", "|---|---|---|"]
    for name, s in summary.items():
        pairs = ", ".join(f"{b:.3f} / {a:.4f}" for b, a in s["probes"])
        lines.append(f"| {name} | {pairs} | {'ok' if s['probe_ok'] else '**failed**'} |")
    met = [n for n, s in summary.items() if s["ratio"] <= 2.0]
    lines += ["", f"Goal (sync <= 2x the floor): met by {', '.join(met) or 'none'}"
              + (f"; not by {', '.join(n for n in summary if n not in met)}."
                 if len(met) < len(summary) else "."), "", END]
    return "\n".join(lines)


def write_doc(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no section marked {BEGIN!r} ... {END!r}")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(head + text + rest.split(END, 1)[1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/bench_real_width_sync")
    parser.add_argument("--assets", default=None, help="make_qwen3_assets directory to reuse")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--num-syncs", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="the probe's bound on the mean |dlogp| per token (default: about "
                             "the between-bf16 bound of docs/real_geometry.md, 6 x HF's mean "
                             "bf16 spread)")
    parser.add_argument("--doc", default=None, help="markdown file whose marked section to replace")
    parser.add_argument("--phase", choices=["ranks"], default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    opts = parser.parse_args(argv)
    work = Path(opts.work)
    if opts.phase == "ranks":
        ranks_main(work)
        return 0
    from benchmarks.bench_real_geometry import _conditions, chat_prompts
    from gspo_megatron.real_geometry.assets import make_qwen3_assets
    from tests.real_sglang import RealServer

    assets = Path(opts.assets) if opts.assets else work / "assets"
    if not (assets / "model" / "config.json").exists():
        make_qwen3_assets(assets, geometry="30b", num_layers=1)
    model_dir = assets / "model"
    prompt = chat_prompts(model_dir, assets / "data" / "train.jsonl", 1)[0]
    load_before = os.getloadavg()[0]
    work.mkdir(parents=True, exist_ok=True)
    server = RealServer(str(model_dir), work / "server.log").start()
    try:
        result = run_syncs(model_dir, server.address, server.process.pid, prompt, work / "run",
                           opts.transports.split(","), opts.num_syncs, opts.bucket_mb * 2 ** 20,
                           opts.tolerance)
    finally:
        server.stop()
    summary = summarize(result)
    conditions = _conditions(load_before)
    conditions["memory"] = "RssAnon + RssShmem of each process tree, sampled every 0.1 s"
    text = section(result, summary, argv, conditions)
    (work / "results.json").write_text(json.dumps({"result": result, "summary": summary},
                                                  indent=1))
    print("\n" + text)
    if opts.doc:
        write_doc(Path(opts.doc), text)
    return 0 if all(s["probe_ok"] and s["floor_received"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
