"""How fast this machine multiplies bf16 against fp32 matrices on the CPU, and why.

Every CPU number of this project that runs a bf16 model (the real-geometry learner, the bf16
embedded engine) depends on it: torch's CPU GEMM is fast in bf16 only where the processor has
native bf16 dot products (AVX-512 BF16 or AMX); elsewhere bf16 goes through a slow path while
fp32 keeps its vector kernels. The same commit's real-geometry train test took 51 s on the
machine of docs/test_suite.md's clone 18 and 218 s on clone 19's. The table says which kind of
machine this is, from the processor's own flags and a measurement side by side, with a third
column: the same bf16 product under ``distributed/cpu_bf16_matmul.Fp32Matmuls`` (operands
upcast, multiplied in fp32, the product rounded to bf16), what a bf16 run uses on such a CPU:

    python benchmarks/bench_cpu_matmul.py --doc docs/test_suite.md

``--sizes`` and ``--repeats`` set the square sizes and the timed repeats (the best is kept).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time
from pathlib import Path
from typing import Dict, List, Sequence

BEGIN, END = "<!-- bench_cpu_matmul: begin -->", "<!-- bench_cpu_matmul: end -->"
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_facts() -> Dict[str, str]:
    """The processor's model name and which of :data:`FLAGS` it has (``/proc/cpuinfo``)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    if match := re.search(r"^model name\s*:\s*(.+)$", text, re.M):
        model = match.group(1).strip()
    if match := re.search(r"^flags\s*:\s*(.+)$", text, re.M):
        flags = set(match.group(1).split())
    return {"model": model, "flags": " ".join(f for f in FLAGS if f in flags) or "none of them"}


def gemm_seconds(size: int, dtype, repeats: int, mode=None) -> float:
    """Best of ``repeats`` timed ``torch.mm`` of two random ``size`` x ``size`` matrices
    (``mode``: a dispatch mode the products run under)."""
    import contextlib

    import torch

    gen = torch.Generator().manual_seed(size)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    with mode if mode is not None else contextlib.nullcontext():
        torch.mm(a, b)  # warm-up: kernel selection, first-touch of the output
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    return best


def measure(sizes: Sequence[int], repeats: int) -> List[dict]:
    import torch

    from gspo_megatron.distributed.cpu_bf16_matmul import Fp32Matmuls

    rows = []
    for size in sizes:
        fp32 = gemm_seconds(size, torch.float32, repeats)
        bf16 = gemm_seconds(size, torch.bfloat16, repeats)
        upcast = gemm_seconds(size, torch.bfloat16, repeats, mode=Fp32Matmuls())
        flops = 2 * size ** 3
        rows.append({"size": size, "fp32_s": fp32, "bf16_s": bf16, "bf16_in_fp32_s": upcast,
                     "fp32_gflops": flops / fp32 / 1e9, "bf16_gflops": flops / bf16 / 1e9,
                     "bf16_over_fp32": bf16 / fp32, "bf16_over_bf16_in_fp32": bf16 / upcast})
    return rows


def render(rows: List[dict], facts: Dict[str, str], command: str) -> str:
    import torch

    lines = [f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{facts['model']}, flags: {facts['flags']}; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}):", "",
             "| n x n | fp32 s | fp32 GFLOP/s | bf16 s | bf16 GFLOP/s | bf16 / fp32 time "
             "| bf16 in fp32 s | bf16 / bf16 in fp32 time |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['fp32_s']:.3g} | {r['fp32_gflops']:.1f} | "
                     f"{r['bf16_s']:.3g} | {r['bf16_gflops']:.1f} | {r['bf16_over_fp32']:.1f}x "
                     f"| {r['bf16_in_fp32_s']:.3g} | {r['bf16_over_bf16_in_fp32']:.1f}x |")
    return "\n".join(lines)


def write_doc(path: Path, body: str) -> None:
    """Replace the marked section of ``path`` with ``body`` (the markers must be there)."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section to write")
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{body}\n{END}{rest.split(END, 1)[1]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--doc", type=Path, help="write the table into this file's section")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.repeats < 1:
        parser.error("--sizes and --repeats must be >= 1")
    command = "python benchmarks/bench_cpu_matmul.py" + (f" --doc {args.doc}" if args.doc else "")
    body = render(measure(args.sizes, args.repeats), cpu_facts(), command)
    print(body)
    if args.doc:
        write_doc(args.doc, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
