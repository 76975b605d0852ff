"""The launch plan of one training job: which node runs what, with which command line.

    plan = build_plan(cfg, nodes, job)   # cfg validated against the allocation
    plan.learner_argv, plan.servers, plan.mounts, plan.trainer_overrides

Learners: the first ``num_learner_nodes`` nodes (every node when colocated), one ``torchrun``
per node with ``launch.devices_per_node`` ranks, rendezvous on the first learner node. Which
learner ends up global rank 0 is torchrun's choice; rank 0 publishes its own address for the
weight-update group (``trainer/build.py``), so nothing here depends on it.
Servers: ``servers_per_node`` per rollout node, server ``i`` of a node on ``rollout.sglang.port +
i`` and devices ``[i * tp * dp, (i + 1) * tp * dp)``; the command lines come from
``rollout/sglang/launcher.py`` (the one place that turns ``rollout.sglang`` into SGLang flags),
so the servers' TP and the update group's size both come from ``rollout.sglang``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from gspo_megatron.config.allocation import NodeRoles, devices_per_server, node_roles, runs_servers
from gspo_megatron.config.schema import routing_replay_mode
from gspo_megatron.launch.mounts import Mount, absolute_path, container_mounts
from gspo_megatron.rollout.sglang.launcher import (keyed_launch_path, sglang_server_command,
                                                   sglang_server_env)
from gspo_megatron.rollout.sglang.server_keys import key_file_path
from gspo_megatron.rollout.standin.launcher import reference_server_command

# Flags the config owns; GSPO_SGLANG_EXTRA_ARGS may not set them (a second source of the fleet).
CONFIG_OWNED_SGLANG_FLAGS = ("--model-path", "--tp-size", "--dp-size", "--ep-size", "--port",
                             "--base-gpu-id", "--host", "--tensor-parallel-size",
                             "--data-parallel-size", "--expert-parallel-size")


@dataclass(frozen=True)
class Node:
    """A node of the allocation: its Slurm name and the address other nodes reach it at."""

    name: str
    addr: str


@dataclass(frozen=True)
class JobSettings:
    """What the job script knows besides the config: repository, interpreter, ids, entries."""

    repo: str
    config_path: str
    python: str = "python"
    job_id: str = "0"
    restart: int = 0
    cpus_per_node: int = 1
    train_entry: Sequence[str] = ("-m", "gspo_megatron.cli.train")
    rollout_entry: Optional[Sequence[str]] = None
    """Replaces ``-m <server module>`` of the server command (tests use stand-ins)."""
    sglang_extra_args: Sequence[str] = ()
    rdzv_port: Optional[int] = None
    user_mounts: Sequence[Mount] = ()


@dataclass(frozen=True)
class ServerTask:
    """One rollout server: its own Slurm step on ``node`` (the ``local_id``-th server there)."""

    name: str
    """``server<i>``, i its index in the fleet: the step's name and its log's."""
    node: str
    local_id: int
    address: str
    devices: List[int]
    """Device indices of the node the server uses (``--base-gpu-id`` onwards)."""
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    """Set before the server starts (``SGLANG_USE_CPU_ENGINE=1`` for ``rollout.sglang.device=cpu``)."""

    @property
    def health_url(self) -> str:
        return f"http://{self.address}/health"

    @property
    def probe_url(self) -> str:
        """What the job's supervisor polls while the run goes on: SGLang's ``/health_generate``
        answers only when its scheduler produced output within ``SGLANG_HEALTH_CHECK_TIMEOUT``
        (20 s; ``srt/entrypoints/http_server.py``), so a server whose HTTP front is up but whose
        scheduler is stuck fails it, where ``/health`` may still answer."""
        return f"http://{self.address}/health_generate"


@dataclass
class LaunchPlan:
    """Everything the job script starts (and a dry run prints)."""

    roles: NodeRoles
    learner_nodes: List[Node]
    rollout_nodes: List[Node]
    servers: List[ServerTask]
    learner_argv: List[str]
    trainer_overrides: List[str]
    mounts: List[Mount]
    learner_srun: List[str] = field(default_factory=list)
    server_srun: List[str] = field(default_factory=list)
    """srun options of every server's own step (the node is the server's, ``--nodelist``): one
    step per server, so that one server's exit ends no other and the job can restart it
    (slurm/fleet.sh)."""

    @property
    def learner_world_size(self) -> int:
        return len(self.learner_nodes) * self.roles.learner_procs_per_node

    def update_group_size(self, cfg) -> int:
        """Ranks of the broadcast weight-update group: learner rank 0 and every server's TP
        workers (``rollout.sglang.tp``, the value the servers were started with)."""
        return 1 + len(self.servers) * (cfg.rollout.sglang.tp if cfg.rollout.engine == "sglang" else 1)


def split_nodes(cfg, nodes: Sequence[Node]) -> tuple:
    """(learner nodes, rollout nodes) of a validated config over the job's nodes, in order."""
    roles = node_roles(cfg)
    if cfg.rollout.mode == "colocated":
        return roles, list(nodes), list(nodes) if roles.servers_per_node else []
    learners = list(nodes[:roles.num_learner_nodes])
    return roles, learners, list(nodes[roles.num_learner_nodes:]) if roles.servers_per_node else []


def check_extra_sglang_args(args: Sequence[str]) -> None:
    """Refuse extra server flags that would contradict the config's fleet."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in CONFIG_OWNED_SGLANG_FLAGS:
            raise ValueError(f"GSPO_SGLANG_EXTRA_ARGS may not set {name}: it comes from the config "
                             "(rollout.sglang.*, model.hf_path)")


def _with_entry(argv: List[str], entry: Optional[Sequence[str]]) -> List[str]:
    """``[python, -m, module, *args]`` with ``-m module`` replaced by ``entry``."""
    if not entry:
        return argv
    assert argv[1] == "-m", argv
    return [argv[0], *entry, *argv[3:]]


def server_key_file(cfg, job: JobSettings) -> str:
    """Absolute path of the job's server keys (``rollout.sglang.key_file`` or the run
    directory's ``secrets/``): the only trace of them in any command line."""
    return absolute_path(key_file_path(cfg.rollout.sglang.key_file, cfg.logging.run_dir), job.repo)


def server_tasks(cfg, rollout_nodes: Sequence[Node], roles: NodeRoles, job: JobSettings,
                 model_path: str) -> List[ServerTask]:
    """Every server of the fleet, node by node, with its full command line.

    A server binds its node's address, the one the learners reach it at (``Node.addr``), not
    ``0.0.0.0``: nothing else on the node needs it. It requires the job's keys, read from
    :func:`server_key_file` inside the process (stand-in entries, ``GSPO_ROLLOUT_ENTRY``, are
    not SGLang and get no keys)."""
    s = cfg.rollout.sglang
    key_file = server_key_file(cfg, job)
    keyed_launch = keyed_launch_path(job.repo)
    per_server = devices_per_server(s) if cfg.rollout.engine == "sglang" else 1
    routed = routing_replay_mode(cfg.algo) == "rollout"  # R3: servers capture routed experts
    tasks = []
    for node in rollout_nodes:
        for i in range(roles.servers_per_node):
            if cfg.rollout.engine == "sglang":
                argv = sglang_server_command(
                    s, model_path, i, host=node.addr, python=s.python or job.python,
                    enable_memory_saver=cfg.rollout.mode == "colocated",
                    deterministic=s.deterministic_inference,
                    key_file=None if job.rollout_entry else key_file,
                    keyed_launch=keyed_launch,
                    return_routed_experts=routed) + list(job.sglang_extra_args)
            else:
                argv = reference_server_command(model_path, s.port + i, host=node.addr, python=job.python,
                                                enable_memory_saver=cfg.rollout.mode == "colocated",
                                                key_file=None if job.rollout_entry else key_file,
                                                return_routed_experts=routed)
            devices = list(range(i * per_server, (i + 1) * per_server))
            env = sglang_server_env(s) if cfg.rollout.engine == "sglang" else {}
            tasks.append(ServerTask(f"server{len(tasks)}", node.name, i, f"{node.addr}:{s.port + i}", devices,
                                    _with_entry(argv, job.rollout_entry), env))
    return tasks


def build_plan(cfg, nodes: Sequence[Node], job: JobSettings,
               overrides: Sequence[str] = ()) -> LaunchPlan:
    """The plan of ``cfg`` (already validated with ``launch.num_nodes = len(nodes)``).

    ``overrides`` are the dot-list overrides ``cfg`` was loaded with; the trainer gets them plus
    the server addresses, after them so that they win.
    """
    check_extra_sglang_args(job.sglang_extra_args)
    roles, learners, rollout_nodes = split_nodes(cfg, nodes)
    servers = []
    if runs_servers(cfg.rollout):
        if not cfg.model.hf_path:
            raise ValueError("model.hf_path: the rollout servers load it first; set it (or GSPO_HF_DIR)")
        servers = server_tasks(cfg, rollout_nodes, roles, job, absolute_path(cfg.model.hf_path, job.repo))
    trainer_overrides = list(overrides)
    if servers:
        trainer_overrides.append(f"rollout.sglang.server_addresses=[{','.join(s.address for s in servers)}]")
        trainer_overrides.append(f"rollout.sglang.key_file={server_key_file(cfg, job)}")
    port = job.rdzv_port or 29500 + int(job.job_id) % 1000
    learner_argv = [job.python, "-m", "torch.distributed.run", f"--nnodes={len(learners)}",
                    f"--nproc-per-node={roles.learner_procs_per_node}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={learners[0].addr}:{port}",
                    f"--rdzv-id={job.job_id}-r{job.restart}", "--max-restarts=0",
                    # not SIGTERM: a preemption's SIGTERM is the workers' (slurm/train_job.sh)
                    "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
                    *job.train_entry, job.config_path, *trainer_overrides]
    plan = LaunchPlan(roles=roles, learner_nodes=learners, rollout_nodes=rollout_nodes, servers=servers,
                      learner_argv=learner_argv, trainer_overrides=trainer_overrides,
                      mounts=container_mounts(cfg, job.repo, job.user_mounts))
    plan.learner_srun = [f"--nodes={len(learners)}", f"--ntasks={len(learners)}", "--ntasks-per-node=1",
                         f"--cpus-per-task={max(job.cpus_per_node, 1)}",
                         f"--nodelist={','.join(n.name for n in learners)}"]
    if servers:
        per_node = roles.servers_per_node
        plan.server_srun = ["--nodes=1", "--ntasks=1",
                            f"--cpus-per-task={max(job.cpus_per_node // per_node, 1)}"]
    return plan


def server_for(plan_servers: Sequence[Dict], name: str, node: str) -> Dict:
    """The server entry (from the plan's JSON) named ``name``, which must run on ``node``."""
    for server in plan_servers:
        if server["name"] == name:
            if server["node"] != node:
                raise LookupError(f"server {name} of the launch plan belongs on node "
                                  f"{server['node']}, but this step runs on {node}")
            return server
    raise LookupError(f"the launch plan has no server named {name!r} (it has "
                      f"{[s['name'] for s in plan_servers]})")


def bash_array(name: str, values: Sequence[str]) -> str:
    """``NAME=(...)`` with every value quoted for bash."""
    return f"{name}=({' '.join(shlex.quote(str(v)) for v in values)})"
