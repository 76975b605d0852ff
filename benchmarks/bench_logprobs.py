"""Peak extra memory and time: chunked log-probs vs the naive ``log_softmax(...).gather(...)``.

Runs each implementation in its own child process (so one's allocations never hide the other's
peak) on CPU or GPU, with Qwen3's vocabulary by default, and prints a Markdown table row per
implementation. Peak extra memory is measured above the logits (and, on CPU, above everything
allocated before the call): ``torch.cuda.max_memory_allocated`` on GPU, the process's peak
resident set (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) on CPU.

    python benchmarks/bench_logprobs.py --num-tokens 8192                   # forward, log-probs
    python benchmarks/bench_logprobs.py --num-tokens 2048 --entropy --train # fwd+bwd with entropy
    python benchmarks/bench_logprobs.py --device cuda --dtype bf16 --num-tokens 16384 --entropy --train

Implementations: ``naive`` (log_softmax + gather, entropy as -(p * logp).sum), ``chunked``
(``vocab_parallel_logprobs_entropy``), ``chunked_inplace`` (same, ``inplace_backward=True``;
only differs with ``--train``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gspo_megatron.algorithms.logprobs import vocab_parallel_logprobs_entropy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GIB = 1024 ** 3


def _naive(logits, targets, entropy: bool):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
    return logp, ent


def _run_once(impl: str, logits, targets, args) -> None:
    if impl == "naive":
        logp, ent = _naive(logits, targets, args.entropy)
    else:
        logp, ent = vocab_parallel_logprobs_entropy(
            logits, targets, compute_entropy=args.entropy, chunk_size=args.chunk_size,
            inplace_backward=impl == "chunked_inplace")
    if args.train:
        loss = logp.sum() + (ent.sum() if ent is not None else 0.0)
        (grad,) = torch.autograd.grad(loss, logits)
        del grad
    del logp, ent


class _Meter:
    """Peak bytes above the current level, on the given device."""

    def __init__(self, device: torch.device):
        self.device = device

    def _rss(self, field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = self._rss("VmRSS:")

    def peak_extra(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._rss("VmHWM:") - self.base


def child(args) -> dict:
    """Measure one implementation in this process; returns the row as a dict."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    logits = (torch.randn(args.num_tokens, args.vocab, device=device) * 2).to(DTYPES[args.dtype])
    logits.requires_grad_(args.train)
    targets = torch.randint(0, args.vocab, (args.num_tokens,), device=device)
    small = logits.detach()[:64].clone().requires_grad_(args.train)
    _run_once(args.impl, small, targets[:64], args)  # warm up kernels / allocator paths
    del small
    meter, times = _Meter(device), []
    meter.start()
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _run_once(args.impl, logits, targets, args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"impl": args.impl, "peak_extra_gib": meter.peak_extra() / GIB,
            "time_s": statistics.median(times),
            "logits_gib": logits.numel() * logits.element_size() / GIB}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--entropy", action="store_true", help="also compute the entropy")
    p.add_argument("--train", action="store_true", help="forward + backward")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=None, help="timed runs (median); 1 CPU, 5 GPU")
    p.add_argument("--impls", default=None, help="comma list; default naive,chunked[,chunked_inplace]")
    p.add_argument("--impl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.device.startswith("cuda") else 1
    if args.impl:  # child mode
        print(json.dumps(child(args)))
        return 0
    impls = args.impls.split(",") if args.impls else \
        ["naive", "chunked"] + (["chunked_inplace"] if args.train else [])
    mode = ("fwd+bwd" if args.train else "fwd") + (" +entropy" if args.entropy else "")
    header = "| device | dtype | tokens | vocab | pass | impl | peak extra GiB | x naive | time s | x naive |"
    print(header)
    print("|---|---|---|---|---|---|---|---|---|---|")
    naive = None
    for impl in impls:
        cmd = [sys.executable, __file__, "--impl", impl] + [a for a in sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        row = json.loads(res.stdout.strip().splitlines()[-1])
        naive = naive or (row if impl == "naive" else None)
        rel_mem = f"{row['peak_extra_gib'] / naive['peak_extra_gib']:.2f}" if naive else "-"
        rel_t = f"{row['time_s'] / naive['time_s']:.2f}" if naive else "-"
        print(f"| {args.device} | {args.dtype} | {args.num_tokens} | {args.vocab} | {mode} | {impl} "
              f"| {row['peak_extra_gib']:.2f} | {rel_mem} | {row['time_s']:.2f} | {rel_t} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
