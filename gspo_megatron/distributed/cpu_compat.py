"""Let real Megatron-Core run on CPU (gloo) by answering its CUDA assumptions.

Megatron-Core 0.16.1 is written for GPUs: it asks ``torch.cuda.current_device()`` where to put
tensors, creates some with ``device="cuda"``, keeps RNG states in CUDA generators and, without
Transformer Engine, refers to an undefined ``te_general_gemm``. None of these are numerical: the
model code itself is device-agnostic. Each patch below answers one assumption and carries a
``probe`` that shows, in a fresh interpreter without the patches, that it is still needed;
``tests/test_cpu_compat.py`` runs every probe, so a Megatron upgrade that fixes one (or moves it)
makes a test fail and the patch can be dropped or updated.

Apply with :func:`apply_cpu_compat` only when no GPU is present; it refuses to run on a GPU.
What was measured and why each patch exists: ``../shared/notes/megatron-on-cpu.md``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, List

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_APPLIED = False
_LOCK = threading.Lock()
_CPU = torch.device("cpu")


def _to_cpu_device(device):
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:0"``, ``0``, torch.device) to CPU."""
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Redirect ``device="cuda"`` arguments and ``Tensor.cuda()`` to the CPU.

    Pushed once for the whole process (the mode stack is thread-local, so worker threads that
    never touch Megatron are unaffected).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


# ---- the patches -----------------------------------------------------------------------------


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def _patch_device_arguments() -> None:
    CudaToCpuMode().__enter__()


def _patch_rng() -> None:
    """Back Megatron's CUDA RNG tracker with the CPU generator (the CPU *is* the device here)."""
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]


def _patch_te_general_gemm() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ---- probes: each returns True when, unpatched, the assumption still breaks on CPU ------------


def _probe_current_device() -> bool:
    try:
        torch.cuda.current_device()
        return False
    except (AssertionError, RuntimeError):
        return True


def _probe_device_arguments() -> bool:
    import inspect

    import megatron.core.pipeline_parallel.schedules as schedules

    return 'device="cuda"' in inspect.getsource(schedules)


def _probe_rng() -> bool:
    import megatron.core.tensor_parallel.random as mrandom

    try:
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("probe", 1)
        return False
    except (AssertionError, RuntimeError):
        return True


def _probe_te_general_gemm() -> bool:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    apply: Callable[[], None]
    probe: Callable[[], bool]


PATCHES: List[Patch] = [
    Patch("current_device", "tensor placement asks torch.cuda.current_device(); "
          "torch.cuda.synchronize is called between steps", _patch_current_device,
          _probe_current_device),
    Patch("device_arguments", "schedules and buffers create tensors with device='cuda' "
          "(schedules.py total_num_tokens, GlobalMemoryBuffer for SP, causal masks)",
          _patch_device_arguments, _probe_device_arguments),
    Patch("rng", "the model-parallel RNG tracker keeps CUDA generator states",
          _patch_rng, _probe_rng),
    Patch("te_general_gemm", "moe_utils refers to te_general_gemm without Transformer Engine",
          _patch_te_general_gemm, _probe_te_general_gemm),
]


def apply_cpu_compat() -> None:
    """Apply every patch once per process. Raises on a machine with a GPU."""
    global _APPLIED
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat must not be applied on a machine with a GPU")
    with _LOCK:
        if _APPLIED:
            return
        for patch in PATCHES:
            patch.apply()
        _APPLIED = True
    log.debug("Megatron-Core CPU compatibility patches applied: %s", [p.name for p in PATCHES])


def cpu_compat_applied() -> bool:
    return _APPLIED
