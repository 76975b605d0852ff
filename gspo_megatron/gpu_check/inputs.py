"""What the kit's checks share: a random HF model on disk, token batches, learner configs.

The model is a randomly initialised ``Qwen3MoeForCausalLM`` (fixed seed) saved as a Hugging
Face directory; the learner reads it through the project's converter (``fill_from_hf`` via
``load_hf_into_learner``), the HF reference and the embedded engine load the same files. The
learner config comes from that directory's config.json (``model_config_for_hf_dir``) and passes
``validate_config`` like every file in ``configs/``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import torch

from gspo_megatron.config.schema import FP8Config, GSPOConfig, ModelConfig, ParallelConfig
from gspo_megatron.gpu_check.sizes import KitSizes
from gspo_megatron.gpu_check.throughput import DTYPES
from gspo_megatron.learner.batch import SequenceBatch


def write_random_hf_model(hf_config: dict, out_dir: Path, dtype: torch.dtype,
                          device: torch.device, seed: int = 0):
    """Build a random Qwen3-MoE on ``device`` (in ``dtype``), save it to ``out_dir``, return it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{k: v for k, v in hf_config.items() if k != "model_type"})
    with torch.device(device):  # initialise where it will run: 1.9e9 parameters on CPU are slow
        model = Qwen3MoeForCausalLM(config)
    model = model.to(dtype).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def token_batch(num_seqs: int, seq_len: int, prompt_len: int, vocab_size: int, seed: int,
                vary_lengths: bool = False) -> SequenceBatch:
    """Random token sequences; ``vary_lengths`` shortens some so packing and padding are used."""
    gen = torch.Generator().manual_seed(seed)
    tokens: List[torch.Tensor] = []
    for i in range(num_seqs):
        cut = (i % 4) * max(1, (seq_len - prompt_len) // 8) if vary_lengths else 0
        tokens.append(torch.randint(0, vocab_size, (seq_len - cut,), generator=gen))
    return SequenceBatch(token_ids=tokens, prompt_lens=[prompt_len] * num_seqs)


def with_policy_inputs(batch: SequenceBatch, old_logprobs: List[torch.Tensor],
                       seed: int) -> SequenceBatch:
    """The batch with old log-probs and +-1 sequence advantages (half the group each way)."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randperm(len(batch), generator=gen) % 2
    advantages = [1.0 if int(s) else -1.0 for s in signs]
    return replace(batch, advantages=advantages, old_logprobs=list(old_logprobs))


def learner_config(hf_dir: Path, sizes: KitSizes, run_dir: Path, impl: str,
                   fp8: Optional[FP8Config] = None) -> GSPOConfig:
    """A one-process learner config for the model in ``hf_dir`` (validated).

    ``impl`` is ``local`` (Megatron's local layer spec, sequential experts) or
    ``transformer_engine`` (TE spec, grouped-GEMM experts, packed THD batches, all-to-all
    dispatch, as in ``configs/qwen3_30b_a3b_gspo.yaml``).
    """
    from gspo_megatron.checkpoint.convert import model_config_for_hf_dir
    from gspo_megatron.config.validate import validate_config

    te = impl == "transformer_engine"
    base = ModelConfig(transformer_impl=impl, params_dtype=sizes.params_dtype,
                       moe_grouped_gemm=te, moe_token_dispatcher="alltoall" if te else "allgather",
                       fp8=fp8 or FP8Config())
    cfg = GSPOConfig()
    cfg.model = model_config_for_hf_dir(hf_dir, base)
    cfg.parallel = ParallelConfig(world_size=1)
    cfg.optimizer = replace(cfg.optimizer, lr=sizes.lr, warmup_steps=0)
    cfg.batch = replace(cfg.batch, max_tokens_per_micro_batch=sizes.max_tokens_per_micro_batch,
                        num_mini_batches=1, num_prompts_per_step=sizes.train_num_seqs // 2)
    cfg.rollout = replace(cfg.rollout, n_samples_per_prompt=2, temperature=1.0,
                          max_new_tokens=sizes.train_seq_len - sizes.train_prompt_len)
    cfg.data = replace(cfg.data, max_prompt_tokens=sizes.train_prompt_len)
    cfg.algo = replace(cfg.algo, loss="gspo")
    cfg.logging = replace(cfg.logging, run_dir=str(run_dir))
    cfg.logging.wandb.enabled = False
    validate_config(cfg, world_size=1)
    return cfg


def params_dtype(sizes: KitSizes) -> torch.dtype:
    return DTYPES[sizes.params_dtype]
