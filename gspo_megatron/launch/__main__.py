"""Write the launch plan of a training job for slurm/train_job.sh (or print it for a dry run).

    python -m gspo_megatron.launch --config configs/qwen3_30b_a3b_gspo.yaml --repo /src/gspo \
        --node n1=10.0.0.1 --node n2=10.0.0.2 ... --out-sh plan.sh --out-json plan.json \
        [--python python] [--job-id 77] [--cpus-per-node 96] [--devices-on-node 8] \
        -- trainer.num_steps=200 logging.run_dir=/runs/r1

``--nodelist 'n[1-4]'`` replaces the ``--node`` list when no Slurm is there to ask (dry runs:
names double as addresses). The config is loaded with the overrides plus
``launch.num_nodes``, validated against the allocation (exit 2 with every problem named), and
the plan is written as bash arrays (``--out-sh``, sourced by the job) and JSON (``--out-json``,
read by each server task, kept as a record). Exit codes: 0 written, 2 bad config or usage.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Sequence

from gspo_megatron.config import ConfigError
from gspo_megatron.config.allocation import node_roles
from gspo_megatron.planner.fit_check import load_fitting_config
from gspo_megatron.launch.hostlist import expand_hostlist
from gspo_megatron.launch.mounts import mounts_spec, parse_user_mounts
from gspo_megatron.launch.plan import (JobSettings, LaunchPlan, Node, bash_array, build_plan,
                                      server_key_file)
from gspo_megatron.rollout.sglang.server_keys import KeyFileError, ensure_keys


def parse_nodes(pairs: Sequence[str], nodelist: Optional[str]) -> List[Node]:
    if pairs and nodelist:
        raise ValueError("give --node NAME=ADDR pairs or --nodelist, not both")
    if nodelist:
        return [Node(name, name) for name in expand_hostlist(nodelist)]
    nodes = []
    for pair in pairs:
        name, sep, addr = pair.partition("=")
        if not name or not sep or not addr:
            raise ValueError(f"--node '{pair}': expected NAME=ADDR")
        nodes.append(Node(name, addr))
    if not nodes:
        raise ValueError("no nodes: give --node NAME=ADDR (one per node of the job) or --nodelist")
    return nodes


def resolve_config(config: str, overrides: Sequence[str], num_nodes: int,
                   devices_on_node: Optional[int]):
    """The validated config and the overrides that produce it (``launch.num_nodes`` and, when
    the config leaves it open, ``parallel.world_size`` added)."""
    overrides = [*overrides, f"launch.num_nodes={num_nodes}"]
    cfg = load_fitting_config(config, overrides)
    if devices_on_node is not None and devices_on_node != cfg.launch.devices_per_node:
        raise ConfigError(f"launch.devices_per_node: {cfg.launch.devices_per_node}, but the job has "
                          f"{devices_on_node} GPUs per node (SLURM_GPUS_ON_NODE)")
    if cfg.parallel.world_size is None:
        roles = node_roles(cfg)
        overrides.append(f"parallel.world_size={roles.num_learner_nodes * roles.learner_procs_per_node}")
        cfg = load_fitting_config(config, overrides)
    return cfg, overrides


def plan_notes(plan: LaunchPlan, cfg) -> List[str]:
    """Human-readable lines about ranks and groups (the dry run prints them)."""
    notes = [f"learners: {', '.join(n.name for n in plan.learner_nodes)}, "
             f"{plan.roles.learner_procs_per_node} rank(s) each, world {plan.learner_world_size}"]
    if plan.servers:
        notes.append(f"servers: {len(plan.servers)} on {', '.join(n.name for n in plan.rollout_nodes)}, "
                     f"{plan.roles.servers_per_node} per node")
        notes.append(f"weight-update group: learner rank 0 + {len(plan.servers)} server(s) x "
                     f"{plan.update_group_size(cfg) // len(plan.servers)} TP worker(s) "
                     f"= {plan.update_group_size(cfg)} ranks, at rank 0's own address")
    return notes


def plan_as_bash(plan: LaunchPlan, cfg) -> str:
    lines = [
        "# Written by python -m gspo_megatron.launch; sourced by slurm/train_job.sh.",
        bash_array("GSPO_LEARNER_NODES", [n.name for n in plan.learner_nodes]),
        bash_array("GSPO_ROLLOUT_NODES", [n.name for n in plan.rollout_nodes]),
        bash_array("GSPO_LEARNER_SRUN", plan.learner_srun),
        bash_array("GSPO_SERVER_SRUN", plan.server_srun),
        bash_array("GSPO_SERVER_NAMES", [s.name for s in plan.servers]),
        bash_array("GSPO_SERVER_NODES", [s.node for s in plan.servers]),
        bash_array("GSPO_SERVER_ADDRESSES", [s.address for s in plan.servers]),
        bash_array("GSPO_PROBE_URLS", [s.probe_url for s in plan.servers]),
        bash_array("GSPO_LEARNER_ARGV", plan.learner_argv),
        bash_array("GSPO_HEALTH_URLS", [s.health_url for s in plan.servers]),
        bash_array("GSPO_SERVER_LINES", [f"{s.name} on {s.node} (devices {s.devices[0]}-"
                                         f"{s.devices[-1]}): {shlex.join(s.argv)}" for s in plan.servers]),
        bash_array("GSPO_PLAN_NOTES", plan_notes(plan, cfg)),
        bash_array("GSPO_MOUNT_SOURCES", [m.source for m in plan.mounts]),
        bash_array("GSPO_MOUNT_ORIGINS", [m.origin for m in plan.mounts]),
        f"GSPO_MOUNTS={shlex.quote(mounts_spec(plan.mounts))}",
        f"GSPO_HEALTH_TIMEOUT_S={int(cfg.rollout.sglang.health_timeout_s)}",
        f"GSPO_SERVER_RESTARTS_PER_HOUR={int(cfg.rollout.sglang.restarts_per_hour)}",
        f"GSPO_SERVER_HANG_TIMEOUT_S={int(math.ceil(cfg.rollout.sglang.hang_timeout_s))}",
    ]
    return "\n".join(lines) + "\n"


def plan_as_json(plan: LaunchPlan) -> str:
    record = {
        "learner_nodes": [asdict(n) for n in plan.learner_nodes],
        "rollout_nodes": [asdict(n) for n in plan.rollout_nodes],
        "servers": [asdict(s) for s in plan.servers],
        "learner_srun": plan.learner_srun, "server_srun": plan.server_srun,
        "learner_argv": plan.learner_argv, "mounts": [asdict(m) for m in plan.mounts],
    }
    return json.dumps(record, indent=2) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gspo_megatron.launch", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--repo", required=True, help="repository root (cwd of every step)")
    p.add_argument("--node", action="append", default=[], help="NAME=ADDR, in the job's order")
    p.add_argument("--nodelist", help="Slurm host list (dry runs: names are the addresses)")
    p.add_argument("--python", default="python", help="the one interpreter of learners and servers")
    p.add_argument("--job-id", default="0")
    p.add_argument("--restart", type=int, default=0)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("--devices-on-node", type=int, help="GPUs Slurm gave each node (checked)")
    p.add_argument("--rdzv-port", type=int)
    p.add_argument("--train-entry", default="-m gspo_megatron.cli.train")
    p.add_argument("--rollout-entry", default="", help="replaces '-m <server module>'")
    p.add_argument("--sglang-extra-args", default="")
    p.add_argument("--user-mounts", default="", help="GSPO_CONTAINER_MOUNTS")
    p.add_argument("--make-keys", action="store_true",
                   help="make the servers' key file (rollout.sglang.key_file) if missing (not in a dry run)")
    p.add_argument("--out-sh", type=Path)
    p.add_argument("--out-json", type=Path)
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        nodes = parse_nodes(args.node, args.nodelist)
        cfg, overrides = resolve_config(args.config, args.overrides, len(nodes), args.devices_on_node)
        job = JobSettings(repo=args.repo, config_path=args.config, python=args.python, job_id=args.job_id,
                          restart=args.restart, cpus_per_node=args.cpus_per_node,
                          train_entry=shlex.split(args.train_entry),
                          rollout_entry=shlex.split(args.rollout_entry) or None,
                          sglang_extra_args=shlex.split(args.sglang_extra_args), rdzv_port=args.rdzv_port,
                          user_mounts=parse_user_mounts(args.user_mounts))
        plan = build_plan(cfg, nodes, job, overrides)
        if args.make_keys and plan.servers:
            ensure_keys(server_key_file(cfg, job))
    except (ConfigError, ValueError, KeyFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out_sh:
        args.out_sh.write_text(plan_as_bash(plan, cfg))
    if args.out_json:
        args.out_json.write_text(plan_as_json(plan))
    if not (args.out_sh or args.out_json):
        sys.stdout.write(plan_as_json(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
