"""``gspo-plan CONFIG [key=value ...] --nodes N [N ...] [--gpus-per-node 8] [--gpu-memory 80GB]``:
will the config's layout fit, and which layouts fit N nodes best?

Prints the per-GPU memory of the config's own learner layout term by term (weights, gradients,
optimizer state, FP8 copies, activations, logits / log-prob pass) and of its SGLang servers
(weights, KV cache, sequences that fit), rough times and the RL steps per second they predict
for ``rollout.max_staleness`` = 0, 1, 2, 4, the training checkpoint (size, each rank's and node's
writes, host memory of a save and a load, the save's time at ``plan.checkpoint_write_gbps``,
whether a warned step and its save fit ``launch.warning_lead_s``, the free space), then for each ``--nodes`` the best layouts as config
overrides. ``--doc FILE`` also rewrites FILE's marked section with that table
(``docs/planner.md``). Pure Python, no torch import: it answers in well under a second.
Exit codes: 0 done (even when nothing fits: the output says so), 2 bad config or arguments (or a
``--doc`` file without the markers).

    gspo-plan configs/qwen3_30b_a3b_gspo.yaml --nodes 4 8
    gspo-plan configs/qwen3_235b_a22b_gspo.yaml --nodes 8 --gpu-memory 141GB --search-optimizer
    gspo-plan configs/qwen3_30b_a3b_gspo.yaml --nodes 4 --doc docs/planner.md
    gspo-plan configs/qwen3_30b_a3b_gspo.yaml --checkpoint-doc docs/cluster.md
    gspo-plan configs/qwen3_30b_a3b_1layer_cpu.yaml --host     # a CPU run: RSS per process
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

EXIT_CONFIG = 2


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="gspo-plan", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML file in configs/")
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. model.recompute=full")
    parser.add_argument("--nodes", type=int, nargs="*", default=[],
                        help="node counts to rank layouts for (learner + rollout nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="default: launch.devices_per_node (8)")
    parser.add_argument("--gpu-memory", default=None,
                        help="memory per GPU, e.g. 80GB or 141GB (default: plan.gpu_memory_gb, "
                             "else 80GB)")
    parser.add_argument("--top", type=int, default=3, help="layouts to print per node count")
    parser.add_argument("--search-optimizer", action="store_true",
                        help="also try the precision-aware optimizer (bf16 moments) and "
                             "optimizer CPU offload")
    parser.add_argument("--host", action="store_true",
                        help="a CPU run on this host: the peak owned memory (RSS) of each learner "
                             "rank and SGLang CPU server instead of GPU memory")
    parser.add_argument("--host-memory", default=None,
                        help="with --host: the host's memory, e.g. 24GiB (default: MemTotal)")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of text")
    parser.add_argument("--checkpoint-doc", default=None,
                        help="markdown file whose marked section (docs/cluster.md) gets the "
                             "config's checkpoint table: size, writes per rank and node, host "
                             "memory, save time, preemption budget")
    parser.add_argument("--doc", default=None,
                        help="markdown file whose marked section (docs/planner.md) gets the "
                             "config's RL steps against rollout.max_staleness, and the ranked "
                             "layouts' for each --nodes")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Print the plan(s); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from gspo_megatron.config import ConfigError, load_config
    from gspo_megatron.planner.hardware import parse_memory
    from gspo_megatron.planner.plan import hardware_from_config, plain_config, plan_config
    from gspo_megatron.planner.report import (as_dict, describe, ranking, staleness_markdown,
                                              write_doc_section)
    from gspo_megatron.planner.search import search

    try:
        cfg = plain_config(load_config(args.config, args.overrides))
        memory = parse_memory(args.gpu_memory) if args.gpu_memory else None
        if any(n < 2 for n in args.nodes):
            raise ConfigError("--nodes: need at least 2 nodes (learner and rollout nodes)")
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise ConfigError("--gpus-per-node: must be >= 1")
        hw = hardware_from_config(cfg, gpu_memory_bytes=memory, gpus_per_node=args.gpus_per_node)
        own = plan_config(cfg, hw)
        host = _host_plan(cfg, own, args) if args.host else None
        ranked = {n: search(cfg, hw, n, top=args.top, search_optimizer=args.search_optimizer)
                  for n in args.nodes}
        from gspo_megatron.planner.checkpoint_io import checkpoint_report

        checkpoint = checkpoint_report(own, cfg)
        if args.checkpoint_doc:
            _write_checkpoint_doc(Path(args.checkpoint_doc), checkpoint, cfg,
                                  shlex.join(["gspo-plan", *argv]), args.config)
        if args.doc:
            write_doc_section(Path(args.doc), staleness_markdown(
                own, shlex.join(["gspo-plan", *argv]), f"`{args.config}`, the config's own "
                f"layout ({hw.gpu_memory_bytes / 1e9:g} GB GPUs)", ranked))
    except ConfigError as exc:
        print(f"gspo-plan: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(_as_json(own, checkpoint, ranked, host), indent=2))
        return 0
    if host is not None:
        from gspo_megatron.planner.report import describe_host

        print(describe_host(host, f"{args.config}: owned memory of its processes on this host"))
    else:
        from gspo_megatron.planner.checkpoint_io import checkpoint_lines

        print(describe(own, f"{args.config}: the config's own layout "
                            f"({hw.gpu_memory_bytes / 1e9:g} GB GPUs)"))
        print("\n".join(checkpoint_lines(*checkpoint)))
    for n, plans in ranked.items():
        print()
        print(ranking(plans, n))
    return 0


def _as_json(own, checkpoint, ranked, host) -> dict:
    """``--json``: the config's plan, its checkpoint, the ranked layouts, the host plan."""
    from gspo_megatron.planner.checkpoint_io import as_dict as checkpoint_dict
    from gspo_megatron.planner.report import as_dict, host_as_dict

    doc = {"config": as_dict(own), "checkpoint": checkpoint_dict(*checkpoint[:3]),
           "ranked": {str(n): [as_dict(p) for p in plans] for n, plans in ranked.items()}}
    if host is not None:
        doc["host"] = host_as_dict(host)
    return doc


def _write_checkpoint_doc(path: Path, checkpoint, cfg, command: str, config: str) -> None:
    """``--checkpoint-doc``: the marked section of ``path`` (``planner/checkpoint_io.py``)."""
    from gspo_megatron.config import ConfigError
    from gspo_megatron.planner.checkpoint_io import DOC_BEGIN, DOC_END, checkpoint_markdown

    ckpt, budget, _, _ = checkpoint
    try:
        doc = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--checkpoint-doc {path}: {exc.strerror or exc}") from exc
    if DOC_BEGIN not in doc or DOC_END not in doc:
        raise ConfigError(f"--checkpoint-doc {path}: no section marked {DOC_BEGIN!r} ... "
                          f"{DOC_END!r}")
    head, rest = doc.split(DOC_BEGIN, 1)
    text = checkpoint_markdown(ckpt, budget, cfg.plan.checkpoint_write_gbps, command,
                               f"`{config}`")
    path.write_text(head + text + rest.split(DOC_END, 1)[1])


def _host_plan(cfg, own, args):
    """``--host``: the CPU run's processes on this host (``planner/host_memory.py``)."""
    from gspo_megatron.config import ConfigError
    from gspo_megatron.planner.hardware import parse_memory
    from gspo_megatron.planner.host_memory import estimate_host, host_memory_total
    from gspo_megatron.planner.plan import model_shape

    if cfg.model.transformer_impl != "local":
        raise ConfigError("--host: plans a CPU run (model.transformer_impl=local); this config "
                          f"runs {cfg.model.transformer_impl}")
    memory = parse_memory(args.host_memory, "--host-memory") if args.host_memory \
        else host_memory_total()
    return estimate_host(cfg, model_shape(cfg), own.learner, own.layout.world_size, memory)


if __name__ == "__main__":
    sys.exit(main())
