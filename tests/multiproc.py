"""Run a test function on N gloo processes (the shared fixture for multi-process tests).

``run_on_ranks(fn, world_size=2, **kwargs)`` starts ``world_size`` processes, sets the
torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) in each, calls
``fn(rank, **kwargs)`` and returns the per-rank results in rank order. ``fn`` must be a
module-level function (it is pickled by name). A failure on any rank fails the test with that
rank's traceback; a hang fails it after ``timeout_s``. Only processes started here are stopped.

The processes come from a ``forkserver`` that has imported torch, the CPU compatibility layer and
Megatron-Core once (``tests/rank_preload.py``) instead of each importing them afresh (~5 s per
process). Each rank gets the caller's environment and working directory of the moment, as a
spawned process would, not the fork server's.
"""

from __future__ import annotations

import io
import os
import queue
import traceback
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Callable, List

import torch.multiprocessing as mp

from gspo_megatron.distributed.ports import free_port


_PRELOAD = ["tests.rank_preload"]


_REPO = Path(__file__).resolve().parents[1]


def _context():
    """The shared fork server's context; its preload is set before the server first starts.

    Python 3.11's fork server is a ``python -c`` process that receives the caller's ``sys.path``
    but never applies it (``multiprocessing/forkserver.py``, ``main``): it imports the preload
    from its own default path, whose first entry is its working directory. So it is started from
    the repository root, whatever directory the calling test is in; a failed preload import
    would be ignored silently and every rank would pay the imports again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    caller_cwd = os.getcwd()
    os.chdir(_REPO)
    try:
        forkserver.ensure_running()  # a no-op once the server is up
    finally:
        os.chdir(caller_cwd)
    return ctx


def _worker(fn, rank: int, world_size: int, port: int, kwargs: dict, results,
            environ: dict, cwd: str) -> None:
    os.environ.clear()  # the caller's environment, not the one the fork server started with
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    if not torch.cuda.is_available():  # before anything imports Megatron (its jit_fuser patch)
        from gspo_megatron.distributed.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    try:
        # Serialised to bytes here: tensors sent through the queue as-is travel as shared file
        # descriptors that the parent can only open while this process is still alive.
        buf = io.BytesIO()
        torch.save(fn(rank, **kwargs), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report every failure, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from gspo_megatron.distributed.runtime import shutdown_distributed

            shutdown_distributed()
        except Exception:
            pass


def run_on_ranks(fn: Callable[..., Any], world_size: int = 2, timeout_s: float = 300.0,
                 **kwargs) -> List[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, kwargs, results, *caller))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict = {}
    errors: List[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                errors.append(f"timed out after {timeout_s}s waiting for ranks "
                              f"{sorted(set(range(world_size)) - set(out))}")
                break
            if status == "ok":
                import torch

                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
