"""Thin helpers shared by the submitters (``gspo-grid``, ``pipelines/submit_pipeline.py``): run ``sbatch --parsable``, cancel, record what was sent.

Every submission goes through :func:`submit`, which returns the job id or raises
:class:`SubmitError` with sbatch's own message, so a submitter can exit with a clear code.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)


def _repo_root() -> Path:
    """The checkout the jobs run from (sbatch runs there; the scripts read GSPO_REPO): $GSPO_REPO,
    else this source tree when it holds ``slurm/`` (an editable install), else the current one."""
    if os.environ.get("GSPO_REPO"):
        return Path(os.environ["GSPO_REPO"]).resolve()
    tree = Path(__file__).resolve().parents[2]
    return tree if (tree / "slurm" / "lib.sh").is_file() else Path.cwd()


REPO_ROOT = _repo_root()
Runner = Callable[..., subprocess.CompletedProcess]


class SubmitError(RuntimeError):
    """sbatch (or scancel) failed; the message carries its stderr."""


@dataclass
class Submission:
    """One sbatch call: its command line, the extra environment it ran with, and the job id."""

    name: str
    command: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    job_id: Optional[str] = None


def parse_job_id(stdout: str) -> str:
    """``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``."""
    text = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = text.split(";")[0]
    if not job_id.isdigit():
        raise SubmitError(f"could not read a job id from sbatch output {stdout!r}")
    return job_id


def submit(sub: Submission, cwd: Path = REPO_ROOT, runner: Runner = subprocess.run) -> str:
    """Run the sbatch command of ``sub`` (environment = ours + ``sub.env``); set and return its id."""
    env = {**os.environ, **sub.env}
    proc = runner(sub.command, cwd=str(cwd), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SubmitError(f"sbatch for '{sub.name}' failed (exit {proc.returncode}): {proc.stderr.strip()}")
    sub.job_id = parse_job_id(proc.stdout)
    logger.info("submitted %s as job %s", sub.name, sub.job_id)
    return sub.job_id


def cancel(job_ids: Sequence[str], runner: Runner = subprocess.run) -> None:
    """Cancel jobs this submitter created (after a later submission of the chain failed)."""
    if job_ids:
        runner(["scancel", *job_ids], capture_output=True, text=True)


def write_record(path: Path, record: Mapping) -> None:
    """Write the submission record as JSON (``Submission`` dataclasses become dicts)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def encode(obj):
        if isinstance(obj, Submission):
            return asdict(obj)
        raise TypeError(f"cannot record {type(obj).__name__}")

    path.write_text(json.dumps(record, indent=2, default=encode) + "\n")
