"""Build the rollout engine named by ``rollout.engine`` from a ``RolloutConfig``.

- ``embedded``: an in-memory model + tokenizer, or the HF directory ``model_path``; with
  ``overlap_one_step`` the engine runs in its own process (``rollout/embedded_process.py``).
- ``sglang``: attach to ``rollout.sglang.server_addresses`` or launch ``num_servers`` SGLang
  servers (with ``--enable-memory-saver`` in colocated mode).
- ``reference``: the same client against CPU reference servers, launched here when no
  addresses are given (server i on ``rollout.sglang.port + i``).
"""

from __future__ import annotations

from typing import Optional

from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.rollout.embedded_process import EmbeddedProcessEngine
from gspo_megatron.rollout.sglang_engine import SGLangEngine
from gspo_megatron.rollout.sglang_launcher import ServerLauncher, reference_server_command
from gspo_megatron.rollout.types import RolloutEngine


def launch_reference_fleet(sglang_cfg, model_path: str, host: str = "127.0.0.1",
                           log_dir: Optional[str] = None) -> ServerLauncher:
    launcher = ServerLauncher(log_dir, env={"OMP_NUM_THREADS": "1"})
    for i in range(sglang_cfg.num_servers):
        port = sglang_cfg.port + i
        launcher.start(reference_server_command(model_path, port, host), f"{host}:{port}")
    return launcher


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
    if cfg.engine == "sglang":
        return SGLangEngine.from_config(cfg.sglang, model_path, log_dir,
                                        enable_memory_saver=cfg.mode == "colocated")
    if cfg.engine == "reference":
        s = cfg.sglang
        launcher = None
        addresses = list(s.server_addresses)
        if not addresses:
            if model_path is None:
                raise ValueError("rollout.engine=reference launches servers from model.hf_path; "
                                 "set it or rollout.sglang.server_addresses")
            launcher = launch_reference_fleet(s, model_path, log_dir=log_dir)
            addresses = launcher.addresses
        engine = SGLangEngine(addresses, s.request_timeout_s, s.max_retries, s.health_timeout_s,
                              launcher=launcher)
        try:
            engine.wait_healthy(s.health_timeout_s)
        except Exception:
            engine.shutdown()
            raise
        return engine
    raise ValueError(f"rollout.engine={cfg.engine!r} is not one of embedded, sglang, reference")
