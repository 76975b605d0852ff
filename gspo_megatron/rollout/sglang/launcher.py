"""Start and stop rollout server processes: SGLang servers, on GPU nodes or SGLang's CPU engine.

Builds the command lines (``python -m sglang.launch_server`` with the config's TP/DP/EP and
memory settings), starts them with their output in log files, and stops exactly the processes it
started, by PID (SIGTERM, then SIGKILL after a grace period). Waiting for health is the engine's
job (bounded by ``sglang.health_timeout_s``). The stand-in's fleet is started by the same
:class:`ServerLauncher` (``rollout/standin/launcher.py``).

Colocated mode needs ``--enable-memory-saver`` (sglang 0.5.23 ``server_args.py``): without it
``/release_memory_occupation`` answers 200 but frees nothing (a no-op memory-saver adapter), and
the learner then runs out of memory. Both fleets' launchers pass it; a Slurm script that starts
servers itself must pass it too.

``rollout.sglang.device=cpu`` runs SGLang's CPU engine (the real server in the tests, with its own
interpreter ``rollout.sglang.python``); servers started with a key file require the job's keys
(``rollout/sglang/server_keys.py``) without showing them on any command line.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

log = logging.getLogger(__name__)


def _dies_with_us(command: List[str]) -> List[str]:
    """``command`` behind the parent-death wrapper (a ``python -m`` line, not an import):
    a server must not outlive a trainer killed with SIGKILL."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-m", "gspo_megatron.distributed.child_processes", "--parent",
            str(os.getpid()), "--", *command]


KEYED_LAUNCH_MODULE = "gspo_megatron.rollout.sglang.keyed_launch"
"""The script that starts SGLang with the job's keys read from a file. Run by path, not with
``-m``: the server's environment need not have gspo_megatron installed."""


def keyed_launch_path(repo: str) -> str:
    """The keyed launcher's file in the checkout ``repo``."""
    return os.path.join(repo, *KEYED_LAUNCH_MODULE.split(".")) + ".py"


# this file is <checkout>/gspo_megatron/rollout/sglang/launcher.py
KEYED_LAUNCH = keyed_launch_path(os.path.abspath(os.path.join(os.path.dirname(__file__),
                                                              *[os.pardir] * 3)))


def sglang_server_command(cfg, model_path: str, index: int, host: str = "127.0.0.1",
                          enable_memory_saver: bool = False, deterministic: bool = False,
                          python: str = sys.executable, key_file: Optional[str] = None,
                          keyed_launch: str = KEYED_LAUNCH,
                          return_routed_experts: bool = False) -> List[str]:
    """Command line of SGLang server ``index`` of the fleet described by an ``SGLangConfig``.

    Server i listens on ``cfg.port + i`` and uses GPUs ``[i * tp * dp, (i + 1) * tp * dp)`` of
    its node (``--base-gpu-id``); on the CPU engine every server starts at 0: SGLang maps that id
    to the NUMA node its threads bind to (``srt/utils/numa_utils.py``, ``init_threads_binding``:
    ``numa_index`` from the device id, asserted below the host's NUMA node count), so the second
    CPU server of a one-node host would fail at start-up. ``enable_memory_saver`` is needed by
    colocated mode's ``/release_memory_occupation``; ``deterministic`` makes SGLang honour
    ``sampling_seed``. With ``key_file`` the server starts through ``keyed_launch``
    (``rollout/sglang/keyed_launch.py``), which adds ``--api-key`` / ``--admin-api-key`` from
    that file inside the process: the command line holds only the file's path. ``--dtype`` is
    ``cfg.dtype`` or the checkpoint's own; ``cfg.device == "cpu"`` adds the CPU engine's flags.
    ``return_routed_experts`` (R3) makes the server capture every token's experts.
    """
    gpus_per_server = cfg.tp * cfg.dp
    entry = [keyed_launch, key_file] if key_file else ["-m", "sglang.launch_server"]
    cmd = [python, *entry, "--model-path", model_path,
           "--host", host, "--port", str(cfg.port + index),
           "--tp-size", str(cfg.tp), "--dp-size", str(cfg.dp), "--ep-size", str(cfg.ep),
           "--mem-fraction-static", str(cfg.mem_fraction_static),
           "--base-gpu-id", str(0 if cfg.device == "cpu" else index * gpus_per_server)]
    dtype = cfg.dtype or checkpoint_dtype(model_path)
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if cfg.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.device == "cpu":
        cmd += CPU_ENGINE_ARGS
    if enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if deterministic:
        cmd.append("--enable-deterministic-inference")
    if return_routed_experts:
        cmd.append(ROUTED_EXPERTS_FLAG)
    return cmd


@functools.lru_cache(maxsize=None)
def checkpoint_dtype(model_path: str) -> Optional[str]:
    """The HF checkpoint's own dtype (``config.json``: ``dtype``, or ``torch_dtype`` before
    transformers 4.56), or None when it cannot be read here (a hub id, a path only the server
    nodes mount): SGLang then picks, and a float32 checkpoint is served in float16."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        log.warning("cannot read %s/config.json: SGLang chooses the servers' dtype (float16 for a "
                    "float32 checkpoint); set rollout.sglang.dtype to choose it", model_path)
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""SGLang's server flag for ``return_routed_experts`` (``srt/arg_groups/fields/exec_.py``)."""

CPU_ENGINE_ARGS = ["--device", "cpu", "--attention-backend", "torch_native",
                   "--disable-cuda-graph", "--sleep-on-idle"]
"""SGLang 0.5.23's CPU engine, as run here (docs/rollout.md): the pure-torch attention, no CUDA
graphs, and a scheduler that sleeps when idle (it spins a core otherwise)."""

CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
"""With ``--device cpu``: the environment that selects the CPU engine (``srt/utils``)."""


def sglang_server_env(cfg) -> Dict[str, str]:
    """Environment additions for a server of this fleet (the CPU engine's switch)."""
    return dict(CPU_ENGINE_ENV) if cfg.device == "cpu" else {}


@dataclass
class ServerProcess:
    address: str
    process: subprocess.Popen
    log_path: Optional[str]


class ServerLauncher:
    """Owns server processes it started; ``stop()`` ends them (and only them) by PID."""

    def __init__(self, log_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.servers: List[ServerProcess] = []

    def start(self, command: List[str], address: str) -> ServerProcess:
        log_path, out = None, subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            log_path = os.path.join(self.log_dir, f"server_{address.replace(':', '_')}.log")
            out = open(log_path, "ab")
        env = dict(os.environ, **(self.env or {}))
        proc = subprocess.Popen(_dies_with_us(command), stdout=out, stderr=subprocess.STDOUT,
                                env=env)
        if out is not subprocess.DEVNULL:
            out.close()  # the child holds its own descriptor
        log.info("started rollout server pid %d at %s: %s", proc.pid, address, " ".join(command))
        server = ServerProcess(address, proc, log_path)
        self.servers.append(server)
        return server

    @property
    def addresses(self) -> List[str]:
        return [s.address for s in self.servers]

    def stop(self, grace_s: float = 10.0) -> None:
        for s in self.servers:
            if s.process.poll() is None:
                s.process.send_signal(signal.SIGTERM)
        for s in self.servers:
            try:
                s.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("server pid %d ignored SIGTERM; killing it", s.process.pid)
                s.process.kill()
                s.process.wait(timeout=grace_s)
        self.servers = []


def launch_sglang_fleet(cfg, model_path: str, host: str = "127.0.0.1",
                        log_dir: Optional[str] = None, enable_memory_saver: bool = False,
                        key_file: Optional[str] = None,
                        return_routed_experts: bool = False) -> ServerLauncher:
    """Start ``cfg.num_servers`` SGLang servers (an ``SGLangConfig``) on this node."""
    launcher = ServerLauncher(log_dir, env=sglang_server_env(cfg))
    for i in range(cfg.num_servers):
        cmd = sglang_server_command(cfg, model_path, i, host, enable_memory_saver,
                                    cfg.deterministic_inference, python=cfg.python or sys.executable,
                                    key_file=key_file, return_routed_experts=return_routed_experts)
        launcher.start(cmd, f"{host}:{cfg.port + i}")
    return launcher
