"""How a run's learners and rollout servers fill a Slurm allocation, from the config alone.

One source for the fleet: ``rollout.sglang.{num_servers, tp, dp, ep}`` say what the servers are,
``launch.{num_nodes, devices_per_node, num_learner_nodes}`` what the job has, ``rollout.mode``
whether learners and servers share nodes. The launch plan (``gspo_megatron/launch``) places
steps with :func:`node_roles`; validation refuses, with :func:`allocation_problems`, a fleet
whose devices do not add up before anything starts (a server short of its GPUs, or a
weight-update group waiting for a rank that never joins, is a 600 s hang otherwise).

A server uses ``tp * dp`` devices of one node (``rollout/sglang/launcher.py``: ``--base-gpu-id``
steps by ``tp * dp``); servers never straddle nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

SERVER_ENGINES = ("sglang", "reference")


@dataclass(frozen=True)
class NodeRoles:
    """Node counts of a launch: the first ``num_learner_nodes`` learn (all of them when
    colocated), the last ``num_rollout_nodes`` serve, ``servers_per_node`` on each."""

    num_learner_nodes: int
    num_rollout_nodes: int
    servers_per_node: int
    learner_procs_per_node: int


def devices_per_server(sglang) -> int:
    """Devices one server occupies (an ``SGLangConfig``)."""
    return sglang.tp * sglang.dp


def runs_servers(rollout) -> bool:
    """Whether the rollout engine is a fleet of server processes (not in-process)."""
    return rollout.engine in SERVER_ENGINES


def node_roles(cfg) -> NodeRoles:
    """Node split of ``cfg.launch``; call only on a config :func:`allocation_problems` accepts."""
    launch, rollout = cfg.launch, cfg.rollout
    colocated = rollout.mode == "colocated"
    learners = launch.num_nodes if colocated else launch.num_learner_nodes
    rollout_nodes = launch.num_nodes if colocated else launch.num_nodes - learners
    per_node = launch.devices_per_node // devices_per_server(rollout.sglang) if runs_servers(rollout) else 0
    return NodeRoles(learners, rollout_nodes if per_node else 0, per_node, launch.devices_per_node)


def allocation_problems(cfg) -> List[Tuple[str, str]]:
    """``(key, message)`` for each way the config does not fit ``cfg.launch`` (empty if it fits)."""
    launch, rollout, s = cfg.launch, cfg.rollout, cfg.rollout.sglang
    problems: List[Tuple[str, str]] = []
    if launch.num_nodes is None:
        return problems
    if launch.num_nodes < 1 or launch.devices_per_node < 1:
        return [("launch", f"num_nodes={launch.num_nodes} and devices_per_node="
                           f"{launch.devices_per_node} must be >= 1")]
    colocated = rollout.mode == "colocated"
    learners = launch.num_learner_nodes
    if colocated:
        if learners not in (None, launch.num_nodes):
            problems.append(("launch.num_learner_nodes", f"{learners}: in colocated mode every one of "
                             f"the {launch.num_nodes} nodes learns and serves (leave it unset)"))
        learners = launch.num_nodes
    elif learners is None or not 1 <= learners < launch.num_nodes:
        return problems + [("launch.num_learner_nodes",
                            f"{learners}: disaggregated mode needs 1 <= learner nodes < "
                            f"launch.num_nodes={launch.num_nodes} (the rest serve)")]
    world = learners * launch.devices_per_node
    if cfg.parallel.world_size is not None and cfg.parallel.world_size != world:
        problems.append(("parallel.world_size", f"{cfg.parallel.world_size}, but the allocation gives "
                         f"the learners {learners} node(s) x {launch.devices_per_node} devices = {world}"))
    if not runs_servers(rollout):
        if not colocated:
            problems.append(("rollout.mode", f"disaggregated, but rollout.engine={rollout.engine} "
                             "runs inside the learner; use sglang or reference servers"))
        return problems
    per_server = devices_per_server(s)
    rollout_nodes = launch.num_nodes - (0 if colocated else learners)
    if launch.devices_per_node % per_server:
        problems.append(("rollout.sglang.tp", f"a server uses tp*dp = {s.tp}*{s.dp} = {per_server} "
                         f"devices, which does not divide launch.devices_per_node="
                         f"{launch.devices_per_node} (servers do not span nodes)"))
        return problems
    have = rollout_nodes * launch.devices_per_node
    want = s.num_servers * per_server
    if want != have:
        problems.append(("rollout.sglang.num_servers", f"{s.num_servers} servers x tp*dp = {per_server} "
                         f"devices = {want}, but the allocation has {rollout_nodes} rollout node(s) x "
                         f"{launch.devices_per_node} devices = {have}; set num_servers="
                         f"{have // per_server} or change the job's --nodes"))
    return problems


def fleet_problems(rollout) -> List[Tuple[str, str]]:
    """Server settings SGLang 0.5.23 or its weight-update group would refuse or hang on."""
    s, problems = rollout.sglang, []
    for key in ("num_servers", "tp", "dp", "ep"):
        if getattr(s, key) < 1:
            problems.append((f"rollout.sglang.{key}", "must be >= 1"))
    if problems or rollout.engine != "sglang":
        return problems
    if s.tp % s.ep:
        # sglang/srt/arg_groups/parallel_hook.py: experts are split inside the server's TP world.
        problems.append(("rollout.sglang.ep", f"ep={s.ep} must divide tp={s.tp}"))
    broadcast = rollout.weight_sync.transport == "nccl" or (
        rollout.weight_sync.transport == "auto" and rollout.mode == "disaggregated")
    if broadcast and s.dp > 1:
        # sglang/srt/model_executor/model_runner_components/weight_updater.py joins the update
        # group as rank_offset + tp_rank: dp replicas of one server would take the same ranks.
        problems.append(("rollout.sglang.dp", f"dp={s.dp}: the broadcast weight-update group has one "
                         "rank per TP worker of a server (SGLang's update_weights_from_distributed "
                         "asserts dp_size == 1); run dp=1 and more servers instead"))
    return problems
