"""Check 3: peak memory of the chunked log-prob kernel vs the naive ``log_softmax`` at vocab 151,936.

Both run forward + backward with the entropy (what a training step does) on the same logits;
peak extra memory is measured above what was allocated before each call:
``torch.cuda.max_memory_allocated`` on GPU, the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) on CPU. The chunked kernel
(``algorithms.logprobs.vocab_parallel_logprobs_entropy``) must need at most half the naive
peak and agree with it on log-probs, entropies and gradients.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gspo_megatron.gpu_check.report import NotRun, Outcome
from gspo_megatron.gpu_check.sizes import KitSizes
from gspo_megatron.gpu_check.throughput import DTYPES, synchronize

GIB = 1024 ** 3
MAX_PEAK_RATIO = 0.5
"""The chunked kernel's peak extra memory must be at most this fraction of the naive one."""
AGREEMENT_ATOL = {"fp32": 1e-4, "bf16": 1e-3}


class PeakMeter:
    """Peak bytes allocated above the level at :meth:`start`, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    @staticmethod
    def _status_bytes(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise NotRun(f"/proc/self/status has no {field}: cannot measure CPU memory here")

    def start(self) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:  # "5" resets the peak resident set size to the current one (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError as exc:
            raise NotRun(f"cannot reset the peak RSS ({exc}): no CPU memory measurement") from None
        self.base = self._status_bytes("VmRSS:")

    def peak_extra(self) -> int:
        synchronize(self.device)
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self._status_bytes("VmHWM:") - self.base


def _naive(logits: torch.Tensor, targets: torch.Tensor):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _chunked(logits: torch.Tensor, targets: torch.Tensor):
    from gspo_megatron.algorithms.logprobs import vocab_parallel_logprobs_entropy

    return vocab_parallel_logprobs_entropy(logits, targets, compute_entropy=True)


def _measure(fn, logits, targets, meter: PeakMeter):
    meter.start()
    t0 = time.perf_counter()
    logp, ent = fn(logits, targets)
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), logits)
    synchronize(meter.device)
    seconds = time.perf_counter() - t0
    peak = meter.peak_extra()
    return peak, seconds, logp.detach().float(), ent.detach().float(), grad


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 1024) -> float:
    """max |a - b| in fp32, a block of rows at a time (full fp32 copies of 16k x 151,936
    gradients would take 10 GB each)."""
    return max((float((a[i:i + rows].float() - b[i:i + rows].float()).abs().max())
                for i in range(0, a.shape[0], rows)), default=0.0)


def check_logprob_memory(device: torch.device, sizes: KitSizes) -> Outcome:
    """Chunked vs naive log-probs + entropy, forward and backward, peak extra memory."""
    gen = torch.Generator(device=device).manual_seed(4)
    n, vocab = sizes.kernel_num_tokens, sizes.kernel_vocab
    logits = (torch.randn(n, vocab, device=device, generator=gen) * 2).to(DTYPES[sizes.kernel_dtype])
    logits.requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), device=device, generator=gen)
    _measure(_chunked, logits[:64], targets[:64], PeakMeter(device))  # warm-up code paths
    meter = PeakMeter(device)
    c_peak, c_s, c_lp, c_ent, c_grad = _measure(_chunked, logits, targets, meter)
    n_peak, n_s, n_lp, n_ent, n_grad = _measure(_naive, logits, targets, meter)
    diff = {"logprob_max_abs_diff": float((c_lp - n_lp).abs().max()),
            "entropy_max_abs_diff": float((c_ent - n_ent).abs().max()),
            "grad_max_abs_diff": _max_abs_diff(c_grad, n_grad)}
    ratio = c_peak / n_peak if n_peak > 0 else float("inf")
    numbers = {"tokens": n, "vocab": vocab, "dtype": sizes.kernel_dtype,
               "logits_gib": logits.numel() * logits.element_size() / GIB,
               "chunked_peak_extra_gib": c_peak / GIB, "naive_peak_extra_gib": n_peak / GIB,
               "chunked_over_naive": ratio, "chunked_s": c_s, "naive_s": n_s, **diff}
    atol = AGREEMENT_ATOL[sizes.kernel_dtype]
    agree = all(v <= atol for v in diff.values())
    passed = ratio <= MAX_PEAK_RATIO and agree
    message = (f"chunked peak {c_peak / GIB:.2f} GiB vs naive {n_peak / GIB:.2f} GiB "
               f"(x{ratio:.2f}, limit x{MAX_PEAK_RATIO})"
               + ("" if agree else f"; results differ by more than {atol}"))
    return passed, message, numbers
