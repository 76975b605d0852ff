#!/usr/bin/env python
"""Reproduce the GSPO paper's section-5 comparisons on a tiny MoE: GSPO (old log-probs from the
learner and from the engine), GRPO and GRPO + Routing Replay, several seeds each; writes
``<out>/comparison.png`` and ``<out>/comparison.md``, and with ``--doc`` the whole results
document (``gspo_megatron/experiments/paper_report.py``), its figure under ``<doc dir>/figures/``.

    python tools/reproduce_paper.py --out runs/paper --doc docs/paper_reproduction.md \
        --depth-out runs/depth          # depth: the runs of tools/volatility_vs_depth.py
    python tools/reproduce_paper.py --out runs/paper --doc docs/paper_reproduction.md --no-train
    python tools/reproduce_paper.py --out /tmp/smoke --smoke           # 2 steps of the same thing

``--no-train`` starts no run and names every run of ``--variants`` x ``--seeds`` that is missing.

Exit codes: 0 done, 1 a training run failed (its log is named) or is missing, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from gspo_megatron.config import load_config  # noqa: E402
from gspo_megatron.experiments.comparison import comparison_table, plot_comparison  # noqa: E402
from gspo_megatron.experiments.paper_numbers import load_reproduction  # noqa: E402
from gspo_megatron.experiments.paper_report import write_doc  # noqa: E402
from gspo_megatron.experiments.paper_reproduction import (CONFIG, VARIANTS, Settings,  # noqa: E402
                                                          reproduce)

SMOKE = dict(seeds=(1,), num_steps=2, num_sft_steps=2, eval_every_steps=0,
             extra=("batch.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4",
                    "algo.diagnostics.expert_volatility_num_seqs=4", "trainer.sft_batch_size=8"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/paper"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--num-steps", type=int, default=200, help="RL steps per run")
    parser.add_argument("--num-sft-steps", type=int, default=1200,
                        help="cold-start steps per seed at most (it stops at a loss target)")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once")
    parser.add_argument("--smoke", action="store_true", help="2 steps, 1 seed, tiny batches (CI)")
    parser.add_argument("--doc", type=Path, help="write the results document here "
                        "(docs/paper_reproduction.md); its figure goes to <doc dir>/figures/")
    parser.add_argument("--depth-out", type=Path, default=None,
                        help="the runs of tools/volatility_vs_depth.py, for claim 3's depth "
                             "numbers (with --doc)")
    parser.add_argument("--no-train", action="store_true",
                        help="start no run: figure, table and --doc from the runs in --out")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    kwargs = dict(out=args.out, seeds=tuple(args.seeds), variants=tuple(args.variants),
                  num_steps=args.num_steps, num_sft_steps=args.num_sft_steps, jobs=args.jobs)
    if args.smoke:
        kwargs.update(SMOKE)
    if min(kwargs["num_steps"], kwargs["num_sft_steps"]) < 1:
        parser.error("--num-steps and --num-sft-steps must be >= 1")
    settings = Settings(**kwargs)
    try:
        runs = (load_reproduction(args.out, settings.variants, settings.seeds).rows()
                if args.no_train else reproduce(settings))
        cfg = load_config(CONFIG, list(settings.extra))
        samples = cfg.batch.num_prompts_per_step * cfg.rollout.n_samples_per_prompt
        figure = plot_comparison(runs, args.out / "comparison.png", samples_per_step=samples)
        table = comparison_table(runs)
        (args.out / "comparison.md").write_text(table + "\n")
        logging.info("wrote %s and %s\n%s", figure, args.out / "comparison.md", table)
        if args.doc:
            command = "python tools/reproduce_paper.py " + shlex.join(
                sys.argv[1:] if argv is None else argv)
            logging.info("wrote %s", write_doc(args.out, settings.variants, settings.seeds,
                                               args.doc, figure, command, args.depth_out))
    except RuntimeError as exc:
        logging.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
