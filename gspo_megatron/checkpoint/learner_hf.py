"""Hugging Face weights in and out of a live learner (no checkpoint round trip).

Start of a run: fill the learner's parameters from ``model.hf_path`` with the same mapping and
slicing as the conversion tool. End of a run: stream the gathered parameters into sharded
safetensors with config, generation config and tokenizer, written to a temporary directory and
renamed into place. The learner is duck-typed (``model`` chunks, ``model_cfg``, ``cfg``,
``optimizer``), so this checkpoint glue does not import the learner package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from gspo_megatron.checkpoint.convert import fill_from_hf
from gspo_megatron.checkpoint.export import write_hf_directory
from gspo_megatron.checkpoint.gather import iter_hf_tensors
from gspo_megatron.checkpoint.hf_io import HFCheckpointReader
from gspo_megatron.model.provider import padded_vocab_size


def unwrapped_chunks(learner):
    """The learner's model chunks without their DDP wrappers."""
    return [getattr(chunk, "module", chunk) for chunk in learner.model]


def load_hf_into_learner(learner, hf_dir: str | Path) -> int:
    """Copy this rank's slices of the HF weights into the learner; returns bytes read."""
    cfg = learner.model_cfg
    padded = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by,
                               learner.cfg.parallel.tp)
    num_bytes = fill_from_hf(unwrapped_chunks(learner), HFCheckpointReader(hf_dir), cfg, padded,
                             log_every=0)
    if learner.optimizer is not None:  # None: a forward-only LogprobLearner
        learner.optimizer.reload_model_params()  # the main copies follow the new weights
    return num_bytes


def export_learner_to_hf(learner, out_dir: str | Path, tokenizer_dir: Optional[str] = None,
                         max_shard_bytes: int = 5 * 10**9) -> Path:
    """Collective: write the learner's current policy as an HF checkpoint directory."""
    dtype = next(unwrapped_chunks(learner)[0].parameters()).dtype
    write_hf_directory(iter_hf_tensors(unwrapped_chunks(learner), learner.model_cfg), Path(out_dir),
                       learner.model_cfg, Path(tokenizer_dir) if tokenizer_dir else None, dtype,
                       max_shard_bytes)
    if dist.is_initialized():
        dist.barrier()
    return Path(out_dir)
