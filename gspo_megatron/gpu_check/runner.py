"""Run the kit's checks in order, time each, and write ``gpu_check.json`` / ``gpu_check.txt``.

Order (cheap and independent first, so a crash late still leaves most results): the runtime
(NCCL on GPU, gloo + CPU compatibility layer on CPU; reported as ``runtime``); check 3 (kernel
memory, needs neither runtime nor model); check 6; the random HF model written to a scratch
directory and the engine process started on it (it loads while the learner is built), then the
learner loaded through the converter (reported as ``setup``); checks 2, 1 and 5 on it; check 4
last (it builds two more learners). A check that raises is reported as ``error`` with its
traceback's tail and the next one runs; checks whose runtime or learner is missing report
``error`` saying so.

    python tools/gpu_check.py --out runs/gpu_check               # on a GPU machine
    python tools/gpu_check.py --cpu-dry-run --out /tmp/gpu_check  # tiny sizes, CPU (CI)

Exit code: 0 when no check failed or errored, 1 otherwise, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from gspo_megatron.gpu_check.report import CheckResult, NotRun, Report
from gspo_megatron.gpu_check.sizes import KitSizes, cpu_sizes, gpu_sizes

log = logging.getLogger(__name__)

CHECKS = ("learner_train", "logprobs_vs_hf", "logprob_kernel_memory", "te_fp8",
          "weight_sync_cuda_ipc", "cpu_compat_not_applied")
"""Check names in the issue's numbering (1-6)."""


def run_check(report: Report, name: str, fn: Callable, *args, selected=CHECKS) -> None:
    """Run one check function into ``report``; its exceptions become ``error`` / ``not_run``."""
    if name not in selected:
        return
    t0 = time.perf_counter()
    try:
        passed, message, numbers = fn(*args)
        result = CheckResult(name, "pass" if passed else "fail", message, numbers)
    except NotRun as exc:
        result = CheckResult(name, "not_run", str(exc))
    except Exception as exc:  # the kit reports every failure and goes on
        tail = "".join(traceback.format_exc().splitlines(keepends=True)[-12:])
        result = CheckResult(name, "error", f"{type(exc).__name__}: {exc}",
                             {"traceback": tail})
    result.seconds = time.perf_counter() - t0
    log.info("[%s] %s (%.1f s) %s", result.status, name, result.seconds, result.message)
    report.add(result)


def _needs(part: Optional[object], what: str) -> None:
    if part is None:
        raise RuntimeError(f"{what} is not available (see the runtime / setup entries)")


def environment(device: torch.device) -> Dict[str, object]:
    """Versions and the device, for the report's header."""
    import megatron.core
    import transformers

    env: Dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__,
                              "megatron_core": getattr(megatron.core, "__version__", "?"),
                              "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    return env


def start_runtime(report: Report):
    """NCCL (GPU) or gloo (CPU) with Megatron's parallel state; None, reported, if it fails."""
    from gspo_megatron.config.schema import ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed

    t0 = time.perf_counter()
    try:
        runtime = init_distributed(ParallelConfig(world_size=1), seed=1234, environ={})
    except Exception as exc:
        tail = "".join(traceback.format_exc().splitlines(keepends=True)[-12:])
        report.add(CheckResult("runtime", "error", f"{type(exc).__name__}: {exc}",
                               {"traceback": tail}, time.perf_counter() - t0))
        return None
    report.add(CheckResult("runtime", "pass", f"{runtime.backend} on {runtime.device}",
                           {"backend": runtime.backend, "device": str(runtime.device)},
                           time.perf_counter() - t0))
    return runtime


class _Setup:
    """The shared parts, built once; each records its own failure instead of raising."""

    def __init__(self, report: Report, sizes: KitSizes, device: torch.device, work_dir: Path):
        self.report, self.sizes, self.device, self.work_dir = report, sizes, device, work_dir
        self.hf_dir = work_dir / "hf_model"
        self.hf_model = self.engine = self.learner = None
        self.numbers: Dict[str, object] = {}

    def build(self, with_engine: bool, runtime) -> None:
        from gspo_megatron.gpu_check.inputs import learner_config, params_dtype, write_random_hf_model
        from gspo_megatron.gpu_check.ipc_engine import EngineProcess
        from gspo_megatron.gpu_check.learner_checks import build_learner

        t0 = time.perf_counter()
        try:
            self.hf_model = write_random_hf_model(self.sizes.hf_config, self.hf_dir,
                                                  params_dtype(self.sizes), self.device)
            self.numbers["hf_model_write_s"] = time.perf_counter() - t0
            if with_engine:
                self.engine = EngineProcess(self.hf_dir, self.device, self.sizes.params_dtype)
            cfg = learner_config(self.hf_dir, self.sizes, self.work_dir / "run", impl="local")
            built = build_learner(cfg, runtime, self.hf_dir)
            self.learner = built.pop("learner")
            self.numbers.update(built)
            status, message = "pass", "random HF model written, learner built and loaded"
        except Exception as exc:
            status, message = "error", f"{type(exc).__name__}: {exc}"
            self.numbers["traceback"] = "".join(traceback.format_exc().splitlines(True)[-12:])
        self.report.add(CheckResult("setup", status, message, self.numbers,
                                    time.perf_counter() - t0))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.learner = self.hf_model = None
        gc.collect()


def _matmul_peak(report: Report, device: torch.device, sizes: KitSizes) -> float:
    """The measured matmul peak (TFLOP/s) the MFU numbers divide by, recorded in the report."""
    from gspo_megatron.gpu_check.throughput import DTYPES, matmul_peak_tflops

    try:
        peak = matmul_peak_tflops(device, DTYPES[sizes.params_dtype], sizes.matmul_n,
                                  sizes.matmul_iters)
    except RuntimeError as exc:  # e.g. out of memory: MFU is then unknown, not fatal
        log.warning("matmul peak not measured: %s", exc)
        peak = float("nan")
    report.environment["matmul_peak_tflops"] = float(f"{peak:.4g}")
    return peak


def run_kit(sizes: KitSizes, device: torch.device, out_dir: Path, work_dir: Path,
            selected=CHECKS) -> Report:
    """Every selected check, in order; the report is rewritten into ``out_dir`` after each."""
    from gspo_megatron.distributed.runtime import shutdown_distributed
    from gspo_megatron.gpu_check.fp8_check import check_te_fp8
    from gspo_megatron.gpu_check.kernel_check import check_logprob_memory
    from gspo_megatron.gpu_check.learner_checks import (check_cpu_compat, check_learner_train,
                                                        check_logprobs_vs_hf)
    from gspo_megatron.gpu_check.weight_sync_check import check_weight_sync

    report = Report(mode="gpu" if device.type == "cuda" else "cpu-dry-run", out_dir=out_dir)
    report.environment = environment(device)
    report.write()
    runtime = start_runtime(report)
    setup = _Setup(report, sizes, device, work_dir)

    def the_runtime():
        _needs(runtime, "the distributed runtime")
        return runtime

    try:
        run_check(report, "logprob_kernel_memory", check_logprob_memory, device, sizes,
                  selected=selected)
        run_check(report, "cpu_compat_not_applied", lambda: check_cpu_compat(the_runtime()),
                  selected=selected)
        peak = _matmul_peak(report, device, sizes)
        needs_model = {"learner_train", "logprobs_vs_hf", "weight_sync_cuda_ipc", "te_fp8"}
        if needs_model & set(selected) and runtime is not None:
            setup.build(with_engine="weight_sync_cuda_ipc" in selected, runtime=runtime)

        def learner():
            _needs(setup.learner, "the learner")
            return setup.learner

        run_check(report, "logprobs_vs_hf",
                  lambda: check_logprobs_vs_hf(learner(), setup.hf_model, sizes), selected=selected)
        setup.hf_model = None  # the reference model is not needed any more
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        run_check(report, "learner_train",
                  lambda: check_learner_train(learner(), runtime, sizes, peak), selected=selected)
        run_check(report, "weight_sync_cuda_ipc",
                  lambda: check_weight_sync(learner(), setup.engine, sizes.bucket_bytes, device),
                  selected=selected)
        if setup.engine is not None:
            setup.engine.close()
        run_check(report, "te_fp8",
                  lambda: check_te_fp8(setup.hf_dir, sizes, work_dir / "run", the_runtime(),
                                       setup.learner),
                  selected=selected)
    finally:
        setup.close()
        shutdown_distributed()
    report.write()
    return report


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.txt")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny sizes on CPU (what CI runs); without it a GPU is required")
    p.add_argument("--num-layers", type=int, default=2, help="layers of the Qwen3-30B-A3B slice (1-4)")
    p.add_argument("--checks", default=",".join(CHECKS),
                   help=f"comma-separated subset of {', '.join(CHECKS)}")
    p.add_argument("--work-dir", default=None,
                   help="scratch directory for the HF model (default: a temporary one, removed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    selected = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = sorted(set(selected) - set(CHECKS))
    if unknown:
        print(f"gpu_check: --checks: unknown {', '.join(unknown)}; known: {', '.join(CHECKS)}",
              file=sys.stderr)
        return 2
    if args.cpu_dry_run:
        sizes, device = cpu_sizes(), torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check: no GPU visible (torch.cuda.is_available() is False); run with "
              "--cpu-dry-run for the CPU check", file=sys.stderr)
        return 2
    else:
        try:
            sizes = gpu_sizes(args.num_layers)
        except ValueError as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 2
        device = torch.device("cuda", 0)
    if args.cpu_dry_run and torch.cuda.is_available():
        print("gpu_check: --cpu-dry-run on a machine with a GPU would apply the CPU "
              "compatibility layer there; run without it", file=sys.stderr)
        return 2
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        report = run_kit(sizes, device, Path(args.out), work_dir, selected)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    sys.stdout.write(report.summary())
    return 0 if report.status() == "pass" else 1
