"""Check 4: Transformer Engine layer spec and FP8 (only where TE imports; otherwise ``not_run``).

Two TE learners are built from the same HF weights, as ``configs/qwen3_30b_a3b_gspo.yaml`` runs
them (TE spec, grouped-GEMM experts, all-to-all dispatch, packed THD micro-batches): one in BF16,
one with FP8 (``tensorwise`` recipe, no BF16 edge layers: the slice has only 2-4 layers). Each
computes log-probs on the same batch and takes one GSPO step (both must update with a finite
gradient norm). Pass when:

- the TE BF16 log-probs agree with the local-spec learner's (the same weights, another spec and
  the THD layout): mean |difference| <= 0.05,
- the FP8 mean NLL is within 2% of the TE BF16 one,
- every FP8 micro-batch is padded to Megatron's FP8 GEMM alignment
  (``megatron/core/fp8_utils.py`` ``get_fp8_align_size``: 16, 32 for MXFP8).
"""

from __future__ import annotations

import gc
import math
from typing import Dict

import torch

from gspo_megatron.config.schema import FP8Config
from gspo_megatron.gpu_check.inputs import learner_config, token_batch, with_policy_inputs
from gspo_megatron.gpu_check.learner_checks import build_learner
from gspo_megatron.gpu_check.report import NotRun, Outcome
from gspo_megatron.gpu_check.sizes import KitSizes

FP8_RECIPE = "tensorwise"
MAX_NLL_REL_DIFF = 0.02
MAX_TE_VS_LOCAL_MEAN = 0.05
"""Mean |log-prob| difference allowed between the TE and local specs in BF16."""


def transformer_engine_version() -> str:
    """TE's version, or raise :class:`NotRun` saying why it cannot be used here."""
    if not torch.cuda.is_available():
        raise NotRun("no GPU: Transformer Engine and FP8 are GPU-only")
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a missing CUDA library behind it
        raise NotRun(f"transformer_engine does not import ({type(exc).__name__}: {exc}); its "
                     "wheels do not fit the device's 64 MiB carry (docs/gpu.md), so the local "
                     "spec ran instead") from None
    return str(getattr(transformer_engine, "__version__", "unknown"))


def _run_te_learner(hf_dir, sizes: KitSizes, run_dir, runtime, batch, fp8: bool) -> Dict[str, object]:
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    from gspo_megatron.algorithms.losses import get_policy_loss

    fp8_cfg = FP8Config(enabled=fp8, recipe=FP8_RECIPE, num_layers_at_start_in_bf16=0,
                        num_layers_at_end_in_bf16=0)
    cfg = learner_config(hf_dir, sizes, run_dir, impl="transformer_engine", fp8=fp8_cfg)
    learner = build_learner(cfg, runtime, hf_dir)["learner"]
    try:
        out = learner.compute_logprobs(batch, temperature=1.0)
        align = get_fp8_align_size(Fp8Recipe(FP8_RECIPE))
        plan = learner.plan(batch)
        lengths = [mb.tokens.shape[1] for mb in plan.micro_batches]
        metrics = learner.train_step(with_policy_inputs(batch, out.logprobs, seed=5),
                                     get_policy_loss("gspo"))
        return {"logprobs": torch.cat(out.logprobs), "padded_lengths": lengths, "align": align,
                "layout": plan.micro_batches[0].layout, "step": metrics}
    finally:
        del learner
        gc.collect()
        torch.cuda.empty_cache()


def check_te_fp8(hf_dir, sizes: KitSizes, run_dir, runtime, local_learner) -> Outcome:
    version = transformer_engine_version()
    if local_learner is None:
        raise RuntimeError("the local-spec learner could not be built (see the setup entry)")
    m = local_learner.model_cfg
    batch = token_batch(sizes.compare_num_seqs, sizes.compare_seq_len, sizes.compare_prompt_len,
                        m.vocab_size, seed=6, vary_lengths=True)
    local = torch.cat(local_learner.compute_logprobs(batch, temperature=1.0).logprobs)
    bf16 = _run_te_learner(hf_dir, sizes, run_dir / "te_bf16", runtime, batch, fp8=False)
    fp8 = _run_te_learner(hf_dir, sizes, run_dir / "te_fp8", runtime, batch, fp8=True)
    te_vs_local = (bf16["logprobs"] - local).abs()
    nll_bf16, nll_fp8 = -float(bf16["logprobs"].mean()), -float(fp8["logprobs"].mean())
    rel = abs(nll_fp8 - nll_bf16) / max(abs(nll_bf16), 1e-9)
    aligned = all(n % fp8["align"] == 0 for n in fp8["padded_lengths"])
    step = fp8["step"]
    numbers = {"transformer_engine": version, "recipe": FP8_RECIPE, "layout": fp8["layout"],
               "te_bf16_vs_local_mean": float(te_vs_local.mean()),
               "te_bf16_vs_local_max": float(te_vs_local.max()),
               "nll_te_bf16": nll_bf16, "nll_fp8": nll_fp8, "nll_rel_diff": rel,
               "te_bf16_step_grad_norm": bf16["step"]["grad_norm"],
               "fp8_step_loss": step["loss"], "fp8_step_grad_norm": step["grad_norm"],
               "fp8_step_skipped": step["skipped"], "fp8_align": fp8["align"],
               "fp8_micro_batch_lengths": fp8["padded_lengths"]}
    problems = []
    if float(te_vs_local.mean()) > MAX_TE_VS_LOCAL_MEAN:
        problems.append(f"TE BF16 vs local spec mean |diff| {float(te_vs_local.mean()):.3g} > "
                        f"{MAX_TE_VS_LOCAL_MEAN}")
    if not rel <= MAX_NLL_REL_DIFF:
        problems.append(f"FP8 NLL {nll_fp8:.4f} vs BF16 {nll_bf16:.4f} ({100 * rel:.2f}% > "
                        f"{100 * MAX_NLL_REL_DIFF:.0f}%)")
    for name, result in (("TE BF16", bf16), ("FP8", fp8)):
        if result["step"]["skipped"] or not math.isfinite(result["step"]["grad_norm"]):
            problems.append(f"the {name} step was skipped or its grad norm is not finite")
    if not aligned:
        problems.append(f"FP8 micro-batch lengths {fp8['padded_lengths']} are not multiples of "
                        f"{fp8['align']}")
    message = "; ".join(problems) or (f"TE {version}: FP8 NLL within {100 * rel:.2f}% of BF16, "
                                      f"micro-batches aligned to {fp8['align']}")
    return not problems, message, numbers
