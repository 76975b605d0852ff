"""Start the stand-in's fleet: CPU reference servers, one process each (``rollout.engine=reference``).

The command line is ``python -m gspo_megatron.rollout.standin.server`` with the SGLang flags the
stand-in honours (``--enable-memory-saver``, ``--enable-return-routed-experts``,
``--mem-fraction-static``) and ``--key-file`` for the job's keys. The processes are owned and
stopped, by PID, by the SGLang side's :class:`~gspo_megatron.rollout.sglang.launcher.ServerLauncher`,
and the engine in front of them is the SGLang client itself.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from gspo_megatron.rollout.sglang.launcher import ROUTED_EXPERTS_FLAG, ServerLauncher


def reference_server_command(model_path: str, port: int, host: str = "127.0.0.1",
                             extra: Sequence[str] = (), python: str = sys.executable,
                             enable_memory_saver: bool = False,
                             key_file: Optional[str] = None,
                             return_routed_experts: bool = False) -> List[str]:
    """Command line of a CPU reference server (same HTTP API as SGLang); ``key_file``: require
    the job's keys, which the server reads from that file."""
    saver = ["--enable-memory-saver"] if enable_memory_saver else []
    saver += [ROUTED_EXPERTS_FLAG] if return_routed_experts else []
    keys = ["--key-file", key_file] if key_file else []
    return [python, "-m", "gspo_megatron.rollout.standin.server", "--model-path", model_path,
            "--host", host, "--port", str(port), *saver, *keys, *extra]


def launch_reference_fleet(cfg, model_path: str, host: str = "127.0.0.1",
                           log_dir: Optional[str] = None, enable_memory_saver: bool = False,
                           key_file: Optional[str] = None,
                           return_routed_experts: bool = False) -> ServerLauncher:
    """Start ``cfg.num_servers`` CPU reference servers, server i on ``cfg.port + i``."""
    launcher = ServerLauncher(log_dir, env={"OMP_NUM_THREADS": "1"})
    for i in range(cfg.num_servers):
        port = cfg.port + i
        launcher.start(reference_server_command(model_path, port, host,
                                                extra=["--mem-fraction-static",
                                                       str(cfg.mem_fraction_static)],
                                                enable_memory_saver=enable_memory_saver,
                                                key_file=key_file,
                                                return_routed_experts=return_routed_experts),
                       f"{host}:{port}")
    return launcher
