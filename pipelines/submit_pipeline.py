"""Submit convert -> train -> export as three Slurm jobs chained with ``--dependency=afterok``.

    python -m pipelines.submit_pipeline --config configs/qwen3_30b_a3b_gspo.yaml \
        --hf-dir /models/Qwen3-30B-A3B --run-dir runs/gspo30b [--profile gpu|cpu] \
        [--sbatch-arg=--partition=h100 ...] [-- config.overrides ...]

Every stage writes into the one run directory: ``converted/`` (convert), ``checkpoints/`` and
``logs/`` (train), ``hf_export/`` (export). The overrides go to convert (so the checkpoint has the
training layout) and to train. Job ids are printed and recorded in ``<run dir>/pipeline.json``.
The jobs inherit this process's environment, so ``GSPO_*`` settings of the slurm/ scripts
(container image, extra mounts, entry points) can be set here; the node layout is the config's.
Exit codes: 0 submitted, 1 an sbatch call failed (the jobs already submitted are cancelled),
2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from gspo_megatron.grid.sbatch import REPO_ROOT, Submission, SubmitError, cancel, submit, write_record

logger = logging.getLogger("submit_pipeline")

STAGES = ("convert", "train", "export")
TRAIN_SCRIPTS = {"gpu": "slurm/gspo_30b.sh", "cpu": "slurm/tiny_cpu.sh"}


@dataclass
class PipelineSpec:
    """What to run: config, model, run directory, and the sbatch options of each stage."""

    config: str
    hf_dir: str
    run_dir: Path
    profile: str = "gpu"
    overrides: Sequence[str] = ()
    sbatch_args: Sequence[str] = ()
    train_sbatch_args: Sequence[str] = ()
    train_script: Optional[str] = None
    stages: Sequence[str] = STAGES


def stage_env(spec: PipelineSpec) -> Dict[str, str]:
    """The GSPO_* settings every stage shares (paths made absolute: jobs may run elsewhere)."""
    run_dir = str(spec.run_dir.resolve())
    return {
        "GSPO_REPO": str(REPO_ROOT),
        "GSPO_RUN_DIR": run_dir,
        "GSPO_CONFIG": spec.config,
        "GSPO_HF_DIR": str(Path(spec.hf_dir).resolve()),
        "GSPO_CONVERTED_DIR": f"{run_dir}/converted",
        "GSPO_LOAD_DIR": f"{run_dir}/converted",
        "GSPO_EXPORT_CHECKPOINT": f"{run_dir}/checkpoints",
        "GSPO_EXPORT_DIR": f"{run_dir}/hf_export",
    }


def build_submissions(spec: PipelineSpec) -> List[Submission]:
    """One sbatch command per stage, without the dependency (added once the previous id is known)."""
    env = stage_env(spec)
    if "convert" not in spec.stages:
        env.pop("GSPO_LOAD_DIR")  # train then starts from the config's own initial weights
    scripts = {
        "convert": "slurm/convert.sh",
        "train": spec.train_script or TRAIN_SCRIPTS[spec.profile],
        "export": "slurm/export.sh",
    }
    subs = []
    for stage in STAGES:
        if stage not in spec.stages:
            continue
        cmd = ["sbatch", "--parsable", f"--job-name=gspo-{stage}",
               f"--output={env['GSPO_RUN_DIR']}/logs/%x-%j.out"]
        cmd += list(spec.sbatch_args)
        if stage == "train":
            cmd += list(spec.train_sbatch_args)
        cmd.append(scripts[stage])
        if stage in ("convert", "train"):
            cmd += list(spec.overrides)
        subs.append(Submission(name=stage, command=cmd, env=dict(env)))
    return subs


def with_dependency(command: List[str], job_id: Optional[str]) -> List[str]:
    """Insert ``--dependency=afterok:ID`` right after ``sbatch``."""
    if job_id is None:
        return command
    return [command[0], f"--dependency=afterok:{job_id}", *command[1:]]


def submit_pipeline(spec: PipelineSpec, runner=None) -> List[Submission]:
    """Submit the stages in order, each after the previous one succeeded; record them."""
    kwargs = {} if runner is None else {"runner": runner}
    subs = build_submissions(spec)
    (spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    previous: Optional[str] = None
    try:
        for sub in subs:
            sub.command = with_dependency(sub.command, previous)
            previous = submit(sub, **kwargs)
    except SubmitError:
        cancel([s.job_id for s in subs if s.job_id], **kwargs)
        raise
    finally:
        write_record(spec.run_dir / "pipeline.json", {
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": spec.config, "hf_dir": spec.hf_dir, "profile": spec.profile,
            "overrides": list(spec.overrides), "jobs": subs,
        })
    return subs


def parse_args(argv: Sequence[str]) -> PipelineSpec:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="training config (YAML)")
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model to start from")
    parser.add_argument("--run-dir", required=True, type=Path, help="one directory for the whole run")
    parser.add_argument("--profile", choices=sorted(TRAIN_SCRIPTS), default="gpu")
    parser.add_argument("--train-script", help="batch script of the train stage (default by profile)")
    parser.add_argument("--stages", default=",".join(STAGES), help="subset of convert,train,export")
    parser.add_argument("--sbatch-arg", action="append", default=[], help="sbatch option for every stage")
    parser.add_argument("--train-sbatch-arg", action="append", default=[], help="sbatch option for train")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown or not stages:
        parser.error(f"--stages: unknown stage(s) {unknown}; choose from {','.join(STAGES)}")
    if not Path(args.config).is_file():
        parser.error(f"--config: file not found: {args.config}")
    return PipelineSpec(
        config=str(Path(args.config).resolve()), hf_dir=args.hf_dir, run_dir=args.run_dir,
        profile=args.profile,
        overrides=args.overrides, sbatch_args=args.sbatch_arg, train_sbatch_args=args.train_sbatch_arg,
        train_script=args.train_script, stages=stages,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        subs = submit_pipeline(spec)
    except SubmitError as exc:
        logger.error("error: %s", exc)
        return 1
    for sub in subs:
        logger.info("%s: job %s", sub.name, sub.job_id)
    logger.info("recorded in %s", spec.run_dir / "pipeline.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
