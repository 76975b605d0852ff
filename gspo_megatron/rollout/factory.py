"""Build the rollout engine named by ``rollout.engine`` from a ``RolloutConfig``.

- ``embedded``: an in-memory model + tokenizer, or the HF directory ``model_path``; with
  ``overlap_one_step`` the engine runs in its own process (``rollout/embedded_process.py``).
- ``sglang``: attach to ``rollout.sglang.server_addresses`` or launch ``num_servers`` SGLang
  servers (with ``--enable-memory-saver`` in colocated mode).
- ``reference``: the same client against CPU reference servers, launched here when no
  addresses are given (server i on ``rollout.sglang.port + i``).

Attaching, launching, waiting for health and checking the SGLang version are
:meth:`SGLangEngine.from_config`'s; this module only picks the launcher.
"""

from __future__ import annotations

from typing import Optional

from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.rollout.embedded_process import EmbeddedProcessEngine
from gspo_megatron.rollout.sglang_engine import SGLangEngine
from gspo_megatron.rollout.sglang_launcher import launch_reference_fleet, launch_sglang_fleet
from gspo_megatron.rollout.types import RolloutEngine


def build_engine(cfg, model_path: Optional[str] = None, model=None, tokenizer=None,
                 log_dir: Optional[str] = None) -> RolloutEngine:
    """An engine for ``cfg`` (a ``RolloutConfig``); the caller owns ``shutdown()``."""
    if cfg.engine == "embedded":
        size = cfg.embedded_max_batch_size
        if model is not None:
            return EmbeddedEngine(model, tokenizer, max_batch_size=size)
        if model_path is None:
            raise ValueError("rollout.engine=embedded needs a model or model.hf_path")
        if cfg.overlap_one_step:  # a thread would share the learner's GIL
            return EmbeddedProcessEngine(model_path, max_batch_size=size,
                                         num_threads=cfg.embedded_num_threads)
        return EmbeddedEngine.from_pretrained(model_path, max_batch_size=size)
    if cfg.engine in ("sglang", "reference"):
        if not cfg.sglang.server_addresses and model_path is None:
            raise ValueError(f"rollout.engine={cfg.engine} launches servers from model.hf_path; "
                             "set it or rollout.sglang.server_addresses")
        launch = launch_sglang_fleet if cfg.engine == "sglang" else launch_reference_fleet
        return SGLangEngine.from_config(cfg.sglang, model_path, log_dir,
                                        enable_memory_saver=cfg.mode == "colocated", launch=launch)
    raise ValueError(f"rollout.engine={cfg.engine!r} is not one of embedded, sglang, reference")
