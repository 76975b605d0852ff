"""bf16 matrix products on a CPU without bf16 dot products: computed in fp32, rounded to bf16.

Torch's CPU GEMM is fast in bf16 only where the processor has native bf16 dot products
(AVX-512 BF16, AMX). Elsewhere (an AVX2-only EPYC, the machine CI now gets) every bf16 matrix
product takes a reference path 47-104x slower than fp32 (``benchmarks/bench_cpu_matmul.py``,
docs/test_suite.md), and a bf16 model's step is then almost all GEMM. Both paths accumulate in
fp32 and round the result to bf16 once, so upcasting the operands (exactly: bf16 -> fp32 loses
nothing), multiplying in fp32 and rounding the product to bf16 gives the same numbers up to the
order of the fp32 additions, at fp32 speed. The cost: a transient fp32 copy of the operands.

:class:`Fp32Matmuls` is a ``TorchDispatchMode`` below autograd, so the forward and the backward
products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``) of a bf16 model are all
taken; every other op, and every product whose operands are not bf16 CPU tensors, runs as it
would. :func:`bf16_matmuls_in_fp32` turns it on for the calling thread when the machine needs
it: ``GSPO_CPU_BF16_MATMUL=auto`` (the default: on a CPU without ``avx512_bf16`` / ``amx_bf16``
in ``/proc/cpuinfo``), ``fp32`` (always) or ``native`` (never).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

ENV = "GSPO_CPU_BF16_MATMUL"
CHOICES = ("auto", "fp32", "native")
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (``/proc/cpuinfo``) under which torch's bf16 GEMM has a fast kernel."""

_aten = torch.ops.aten
PRODUCTS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)
"""The matrix products of a transformer's forward and backward on CPU, as aten sees them
(``linear`` and ``matmul`` decompose into them above autograd)."""
if hasattr(_aten, "_grouped_mm"):
    PRODUCTS += (_aten._grouped_mm.default,)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 dot products torch's GEMM uses (unknown: assume it has)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in NATIVE_FLAGS)
    except OSError:
        return True
    return True


def setting_from_env() -> str:
    """``GSPO_CPU_BF16_MATMUL`` (default ``auto``); ValueError naming the variable for a value
    outside ``auto | fp32 | native``."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting not in CHOICES:
        raise ValueError(f"{ENV}={setting!r} is not one of {', '.join(CHOICES)}")
    return setting


def wanted(setting: Optional[str] = None, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether bf16 products should run in fp32 here (``setting``: one of ``CHOICES``; None:
    the environment's, :func:`setting_from_env`)."""
    setting = setting_from_env() if setting is None else setting
    if setting not in CHOICES:
        raise ValueError(f"{ENV}={setting!r} is not one of {', '.join(CHOICES)}")
    if setting == "auto":
        return not torch.cuda.is_available() and not cpu_has_native_bf16(cpuinfo)
    return setting == "fp32"


def _is_bf16_cpu(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _upcast(x):
    return x.float() if _is_bf16_cpu(x) else x


class Fp32Matmuls(TorchDispatchMode):
    """bf16 CPU products computed in fp32 and rounded to bf16; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.products = 0
        """Products this mode computed in fp32 (what a test and the log count)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and any(_is_bf16_cpu(a) for a in args) and "out" not in kwargs:
            self.products += 1
            out = func(*[_upcast(a) for a in args], **kwargs)
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)


@contextlib.contextmanager
def bf16_matmuls_in_fp32(has_bf16: bool = True,
                         setting: Optional[str] = None) -> Iterator[Optional[Fp32Matmuls]]:
    """Within the block (this thread, and the autograd work it starts), bf16 CPU products run in
    fp32 when :func:`wanted` says so and the caller computes in bf16 at all (``has_bf16``: a
    mode below autograd sees every op, ~10 us each, which an fp32 model need not pay); yields
    the mode, or None when it is off."""
    if not has_bf16 or not wanted(setting):
        yield None
        return
    mode = Fp32Matmuls()
    log.info("this CPU has no bf16 dot products (%s): bf16 matrix products run in fp32 and "
             "are rounded to bf16 (%s=native turns it off)", "/".join(NATIVE_FLAGS), ENV)
    with mode:
        yield mode


__all__ = ["Fp32Matmuls", "bf16_matmuls_in_fp32", "cpu_has_native_bf16", "setting_from_env",
           "wanted"]
