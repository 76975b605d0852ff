"""Build the rollout engine named by ``rollout.engine`` from a ``RolloutConfig``.

- ``embedded``: an in-memory model + tokenizer, or the HF directory ``model_path``; with
  ``max_staleness >= 1`` (or its alias ``overlap_one_step``) the engine runs in its own process
  (``rollout/embedded/process.py``).
- ``sglang``: attach to ``rollout.sglang.server_addresses`` or launch ``num_servers`` SGLang
  servers (with ``--enable-memory-saver`` in colocated mode).
- ``reference``: the same client against CPU reference servers, launched here when no
  addresses are given (server i on ``rollout.sglang.port + i``).

Attaching, launching, waiting for health and checking the SGLang version are
:meth:`SGLangEngine.from_config`'s; this module only picks the launcher.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.embedded.process import EmbeddedProcessEngine
from gspo_megatron.rollout.routed_experts import RoutingShape
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.sglang.launcher import launch_sglang_fleet
from gspo_megatron.rollout.sglang.server_keys import ensure_keys, read_keys, use_keys
from gspo_megatron.rollout.standin.launcher import launch_reference_fleet
from gspo_megatron.rollout.types import RolloutEngine


def build_engine(cfg, model_path: Optional[str] = None, model=None, tokenizer=None,
                 log_dir: Optional[str] = None, key_file: Optional[str] = None,
                 routing_shape: Optional[RoutingShape] = None,
                 keep_partial_rollouts: bool = False) -> RolloutEngine:
    """An engine for ``cfg`` (a ``RolloutConfig``); the caller owns ``shutdown()``.

    ``key_file`` (server engines): servers launched here get the keys in it (made when it does
    not exist); attached servers get them when it exists. Every client of this process then
    sends them (``server_keys.use_keys``). ``routing_shape`` (R3): every sample carries the
    experts the engine routed it to (``rollout/routed_experts.py``). ``keep_partial_rollouts``
    (server engines): a sample cut by a weight sync continues under the new weights
    (``rollout/sglang/partial_rollout.py``)."""
    record = routing_shape is not None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.embedded_dtype]
    if cfg.engine == "embedded":
        if keep_partial_rollouts:
            raise ValueError("partial rollouts need rollout.engine=sglang or reference: the "
                             "embedded engine generates a batch in one call and cannot be "
                             "paused inside it for a weight update")
        size = cfg.embedded_max_batch_size
        if model is not None:
            return EmbeddedEngine(model, tokenizer, max_batch_size=size, record_routing=record)
        if model_path is None:
            raise ValueError("rollout.engine=embedded needs a model or model.hf_path")
        if cfg.overlap_one_step or cfg.max_staleness >= 1:  # a thread would share the GIL
            return EmbeddedProcessEngine(model_path, max_batch_size=size,
                                         num_threads=cfg.embedded_num_threads,
                                         record_routing=record, dtype=dtype)
        return EmbeddedEngine.from_pretrained(model_path, dtype=dtype, max_batch_size=size,
                                              record_routing=record)
    if cfg.engine in ("sglang", "reference"):
        if not cfg.sglang.server_addresses and model_path is None:
            raise ValueError(f"rollout.engine={cfg.engine} launches servers from model.hf_path; "
                             "set it or rollout.sglang.server_addresses")
        launch = launch_sglang_fleet if cfg.engine == "sglang" else launch_reference_fleet
        keys = None
        if key_file and not cfg.sglang.server_addresses:
            keys = ensure_keys(key_file)
        elif key_file and os.path.exists(key_file):
            keys = read_keys(key_file)
        use_keys(keys)
        return SGLangEngine.from_config(cfg.sglang, model_path, log_dir,
                                        enable_memory_saver=cfg.mode == "colocated", launch=launch,
                                        key_file=key_file if keys is not None else None,
                                        routing_shape=routing_shape,
                                        keep_partial_rollouts=keep_partial_rollouts)
    raise ValueError(f"rollout.engine={cfg.engine!r} is not one of embedded, sglang, reference")
