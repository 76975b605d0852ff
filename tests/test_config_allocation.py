"""config/allocation.py: the rollout fleet and the learners must fill the job's nodes exactly."""

from __future__ import annotations

import pytest

from gspo_megatron.config import ConfigError, load_config
from gspo_megatron.config.allocation import node_roles

PROD = "configs/qwen3_30b_a3b_gspo.yaml"


def test_production_config_fills_four_nodes():
    cfg = load_config(PROD, ["launch.num_nodes=4"])
    roles = node_roles(cfg)
    assert (roles.num_learner_nodes, roles.num_rollout_nodes, roles.servers_per_node) == (2, 2, 2)
    assert roles.learner_procs_per_node == 8


@pytest.mark.parametrize("overrides, message", [
    (["launch.num_nodes=5"], "rollout.sglang.num_servers: 4 servers x tp\\*dp = 4 devices = 16, but the "
     "allocation has 3 rollout node\\(s\\) x 8 devices = 24; set num_servers=6"),
    (["launch.num_nodes=4", "launch.num_learner_nodes=3"],
     "parallel.world_size: 16, but the allocation gives the learners 3 node\\(s\\) x 8 devices = 24"),
    (["launch.num_nodes=4", "rollout.sglang.tp=3"], "tp\\*dp = 3\\*1 = 3 devices, which does not divide "
     "launch.devices_per_node=8"),
    (["launch.num_nodes=4", "launch.num_learner_nodes=4"], "disaggregated mode needs 1 <= learner nodes < "
     "launch.num_nodes=4"),
    (["launch.num_nodes=4", "launch.num_learner_nodes=null"], "launch.num_learner_nodes: None"),
    (["launch.num_nodes=2", "rollout.mode=colocated", "launch.num_learner_nodes=1"],
     "in colocated mode every one of the 2 nodes learns and serves"),
    (["launch.num_nodes=3", "rollout.mode=colocated", "launch.num_learner_nodes=null"],
     "world_size: 16, but the allocation gives the learners 3 node\\(s\\) x 8 devices = 24"),
    (["rollout.sglang.dp=2"], "rollout.sglang.dp: dp=2: the broadcast weight-update group has one rank per TP"),
    (["rollout.sglang.ep=3"], "rollout.sglang.ep: ep=3 must divide tp=4"),
    (["rollout.sglang.tp=0"], "rollout.sglang.tp: must be >= 1"),
    (["launch.num_nodes=3", "rollout.engine=embedded", "rollout.weight_sync.transport=auto"],
     "rollout.mode: disaggregated, but rollout.engine=embedded runs inside the learner"),
])
def test_fleets_that_do_not_fill_the_allocation_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PROD, overrides)


def test_colocated_fleet_on_every_node():
    layout = ["launch.num_nodes=2", "rollout.mode=colocated", "launch.num_learner_nodes=null",
              "rollout.sglang.num_servers=4"]
    cfg = load_config(PROD, [*layout, "rollout.weight_sync.transport=nccl"])
    roles = node_roles(cfg)
    assert (roles.num_learner_nodes, roles.num_rollout_nodes, roles.servers_per_node) == (2, 2, 2)
    # tensor handles (CUDA IPC) open only on rank 0's node: refused across nodes (issue 29)
    for transport in ("tensor", "auto"):
        with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.transport: '\w+' sends tensor "
                                              r"handles from learner rank 0's node.*other 1 node"):
            load_config(PROD, [*layout, f"rollout.weight_sync.transport={transport}"])
    one_node = load_config(PROD, ["launch.num_nodes=1", "rollout.mode=colocated",
                                  "launch.num_learner_nodes=null", "rollout.sglang.num_servers=2",
                                  "parallel.world_size=8", "rollout.weight_sync.transport=tensor"])
    assert node_roles(one_node).servers_per_node == 2


def test_without_an_allocation_nothing_is_checked_against_it():
    cfg = load_config(PROD, ["rollout.sglang.num_servers=3"])
    assert cfg.launch.num_nodes is None


def test_embedded_engine_has_no_servers():
    cfg = load_config("configs/tiny_cpu.yaml", ["launch.num_nodes=1", "launch.devices_per_node=1"])
    roles = node_roles(cfg)
    assert (roles.num_learner_nodes, roles.num_rollout_nodes, roles.servers_per_node) == (1, 0, 0)
