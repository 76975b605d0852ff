"""Checks 1, 2 and 6: the learner trains on the device, matches Hugging Face, runs without CPU patches.

1. ``check_learner_train``: the project's :class:`Learner` (Megatron GPTModel, DDP, distributed
   optimizer) runs its log-prob pass and GSPO train steps; tokens/s, model TFLOP/s and MFU
   against the matmul peak measured in the same process; no step may be skipped, losses and
   gradient norms must be finite (the first step's, where every ratio is 1, non-zero) and the
   weights must change.
2. ``check_logprobs_vs_hf``: the learner's per-token log-probs against transformers' on the same
   weights (read into the learner by the project's converter). The reference is the HF model in
   fp32; the learner passes when its mean error is within twice HF's own error in the learner's
   dtype (bf16 rounding and near-tied expert choices make both differ from fp32) plus a floor.
6. ``check_cpu_compat``: the CPU compatibility layer is applied exactly when there is no GPU.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Dict, List

import torch

from gspo_megatron.gpu_check.inputs import token_batch, with_policy_inputs
from gspo_megatron.gpu_check.report import Outcome
from gspo_megatron.gpu_check.sizes import KitSizes
from gspo_megatron.gpu_check.throughput import forward_flops, synchronize, train_step_flops

GIB = 1024 ** 3
LOGPROB_FLOOR = {"fp32": 1e-4, "bf16": 2e-3}
"""Absolute slack on the mean log-prob error, per learner dtype."""


def build_learner(cfg, runtime, hf_dir) -> Dict[str, object]:
    """The learner for ``cfg`` with the HF weights of ``hf_dir`` read through the converter."""
    from gspo_megatron.learner.learner import Learner
    from gspo_megatron.checkpoint.learner_hf import load_hf_into_learner

    t0 = time.perf_counter()
    learner = Learner(cfg, runtime, total_steps=100)
    built = time.perf_counter()
    num_bytes = load_hf_into_learner(learner, hf_dir)
    synchronize(runtime.device)
    return {"learner": learner, "build_s": built - t0, "load_s": time.perf_counter() - built,
            "load_gb": num_bytes / 1e9}


def _param_sums(learner) -> List[float]:
    return [float(p.detach().double().sum()) for chunk in learner.model for p in chunk.parameters()]


def check_learner_train(learner, runtime, sizes: KitSizes, peak_tflops: float) -> Outcome:
    """Log-prob pass + GSPO train steps on the real layer shapes; throughput against the peak."""
    from gspo_megatron.algorithms.losses import get_policy_loss

    device = runtime.device
    m = learner.model_cfg
    batch = token_batch(sizes.train_num_seqs, sizes.train_seq_len, sizes.train_prompt_len,
                        m.vocab_size, seed=1)
    lens = [len(t) for t in batch.token_ids]
    num_tokens = sum(lens)
    learner.compute_logprobs(batch)  # warm-up: kernels, allocator, NCCL communicators
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    t0 = time.perf_counter()
    old = learner.compute_logprobs(batch)
    synchronize(device)
    fwd_s = time.perf_counter() - t0
    train = with_policy_inputs(batch, old.logprobs, seed=2)
    loss_fn = get_policy_loss("gspo")
    before = _param_sums(learner)
    steps, times = [], []
    for i in range(sizes.num_warmup_steps + sizes.num_timed_steps):
        synchronize(device)
        t0 = time.perf_counter()
        steps.append(learner.train_step(train, loss_fn))
        synchronize(device)
        if i >= sizes.num_warmup_steps:
            times.append(time.perf_counter() - t0)
    changed = sum(a != b for a, b in zip(before, _param_sums(learner)))
    step_s = sum(times) / len(times)
    train_tflops = train_step_flops(m, lens) / step_s / 1e12
    fwd_tflops = forward_flops(m, lens) / fwd_s / 1e12
    numbers = {
        "backend": runtime.backend, "device": str(device), "num_layers": m.num_layers,
        "num_params_b": sum(p.numel() for c in learner.model for p in c.parameters()) / 1e9,
        "tokens_per_step": num_tokens, "micro_batches": int(steps[-1]["num_micro_batches"]),
        "logprob_pass_s": fwd_s, "logprob_pass_tokens_per_s": num_tokens / fwd_s,
        "logprob_pass_model_tflops": fwd_tflops,
        "train_step_s": step_s, "train_tokens_per_s": num_tokens / step_s,
        "train_model_tflops": train_tflops, "matmul_peak_tflops": peak_tflops,
        "train_mfu": train_tflops / peak_tflops,
        "losses": [round(s["loss"], 6) for s in steps],
        "grad_norms": [round(s["grad_norm"], 6) for s in steps],
        "params_changed": f"{changed}/{len(before)}"}
    if device.type == "cuda":
        numbers["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    problems = _train_problems(runtime, device, steps, changed)
    message = "; ".join(problems) or (f"{num_tokens / step_s:,.0f} train tokens/s, "
                                      f"{train_tflops:.1f} model TFLOP/s = "
                                      f"{100 * train_tflops / peak_tflops:.1f}% of the matmul peak")
    return not problems, message, numbers


def _train_problems(runtime, device, steps: List[dict], changed: int) -> List[str]:
    """What is wrong with the train steps' outcome (empty: nothing)."""
    problems = []
    expected_backend = "nccl" if device.type == "cuda" else "gloo"
    if runtime.backend != expected_backend:
        problems.append(f"backend {runtime.backend}, expected {expected_backend}")
    if any(s["skipped"] for s in steps):
        problems.append("a step was skipped (non-finite loss or grad norm)")
    if not all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps):
        problems.append("non-finite loss or grad norm")
    if not steps[0]["grad_norm"] > 0:  # later steps may be fully clipped (GSPO's 3e-4 / 4e-4)
        problems.append("zero gradient on the first step, where every ratio is 1")
    if changed == 0:
        problems.append("no parameter changed after the optimizer steps")
    return problems


def _hf_logprobs(model, batch) -> torch.Tensor:
    from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs

    parts = []
    for ids, p in zip(batch.token_ids, batch.prompt_lens):
        ids = ids.tolist()
        parts.append(teacher_forced_logprobs(model, ids[:p], ids[p:]).float().cpu())
    return torch.cat(parts)


def check_logprobs_vs_hf(learner, hf_model, sizes: KitSizes) -> Outcome:
    """Learner vs transformers log-probs on the same weights (fp32 HF as the reference)."""
    batch = token_batch(sizes.compare_num_seqs, sizes.compare_seq_len, sizes.compare_prompt_len,
                        learner.model_cfg.vocab_size, seed=3, vary_lengths=True)
    mine = torch.cat(learner.compute_logprobs(batch, temperature=1.0).logprobs)
    same_dtype = _hf_logprobs(hf_model, batch)
    reference_model = copy.deepcopy(hf_model).float()
    reference = _hf_logprobs(reference_model, batch)
    del reference_model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    d_learner = (mine - reference).abs()
    d_hf = (same_dtype - reference).abs()
    d_pair = (mine - same_dtype).abs()
    tolerance = 2 * float(d_hf.mean()) + LOGPROB_FLOOR[sizes.params_dtype]
    numbers = {"tokens": int(mine.numel()), "dtype": sizes.params_dtype,
               "learner_vs_hf_fp32_max": float(d_learner.max()),
               "learner_vs_hf_fp32_mean": float(d_learner.mean()),
               "hf_same_dtype_vs_hf_fp32_max": float(d_hf.max()),
               "hf_same_dtype_vs_hf_fp32_mean": float(d_hf.mean()),
               "learner_vs_hf_same_dtype_max": float(d_pair.max()),
               "learner_vs_hf_same_dtype_mean": float(d_pair.mean()),
               "mean_logprob": float(reference.mean()), "tolerance_mean": tolerance}
    finite = bool(torch.isfinite(mine).all())
    passed = finite and float(d_learner.mean()) <= tolerance
    message = (f"mean |learner - HF fp32| = {float(d_learner.mean()):.3g} "
               f"{'<=' if passed else '>'} {tolerance:.3g} (2x HF {sizes.params_dtype}'s own + floor)"
               if finite else "non-finite learner log-probs")
    return passed, message, numbers


def check_cpu_compat(runtime) -> Outcome:
    """The CPU compatibility layer is applied on CPU and nowhere else (never on a GPU)."""
    from gspo_megatron.distributed.cpu_compat import cpu_compat_applied, redirect_installed

    on_cpu = runtime.device.type == "cpu"
    applied = cpu_compat_applied()
    redirected = redirect_installed()
    current_device_patched = not getattr(torch.cuda.current_device, "__module__", "").startswith(
        "torch.cuda")
    numbers = {"device": str(runtime.device), "backend": runtime.backend, "applied": applied,
               "device_redirect_installed": redirected,
               "torch_cuda_current_device_patched": current_device_patched}
    passed = applied == on_cpu and redirected == on_cpu and current_device_patched == on_cpu
    where = "CPU" if on_cpu else "GPU"
    message = (f"{'applied' if applied else 'not applied'} on {where}, as it must be" if passed
               else f"CPU compatibility layer state is wrong for a {where} run")
    return passed, message, numbers
