"""The numbers of docs/paper_reproduction.md, read from the run directories, and the rules that
turn them into verdict words.

``load_reproduction`` reads ``<out>/sft/seed<k>`` (the cold starts) and
``<out>/<variant>/seed<k>`` (the RL runs): each run's ``metrics.jsonl`` rows, its resolved
``config.yaml`` and the ``timing.json`` that ``paper_reproduction`` writes. A run that is missing
or stopped before its last step is named in one ``IncompleteRunsError``. Every number the
document quotes is computed here, per seed, over a phase of the run (``phases``); the prose
around them lives in ``paper_report.py``. The rules (``separation``, ``collapsed``, ``close``,
``orders_of_magnitude``) are stated once in ``RULES`` so the document can print them.

Nothing here knows the variants' names except through the run directories it is given, so a
new variant in ``paper_reproduction.VARIANTS`` reaches the document without a change here.
"""

from __future__ import annotations

import json
import math
import statistics
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from gspo_megatron.config import load_config
from gspo_megatron.experiments.paper_reproduction import read_rows

ACCURACY = "eval/accuracy"
SEPARATION_NOTE = "their medians over seeds differ by more than the larger of their seed ranges"
COLLAPSE_DROP = 0.10
"""A run collapsed when its last held-out accuracy is this far (absolute) below its best."""
CLOSE_REL = 0.10
"""Two diagnostics are "the same" when they differ by less than this, relative to the larger."""
TWO_ORDERS = 10 ** 1.5
"""A clip-fraction ratio at least this large rounds to two orders of magnitude."""
VOLATILITY_REPRODUCED = 0.05
"""Half the paper's ~10% of activated experts changing per update."""
SAME_WEIGHTS_GAP = 1e-4
"""Learner-vs-engine |log-prob| gap (nats per token) below which both sides run the same weights."""
RULES = (
    f"*separated*: two variants are separated when {SEPARATION_NOTE}; otherwise "
    "*not separated*",
    f"*collapsed*: a run whose last held-out accuracy is more than {COLLAPSE_DROP * 100:.0f} "
    "points below its best evaluation",
    f"*the same* (diagnostics): within {CLOSE_REL * 100:.0f}% of the larger value",
    f"*two orders of magnitude*: a clip-fraction ratio of at least {TWO_ORDERS:.0f} "
    "(10^1.5) in every phase; the claim *agrees* then, *agrees in direction* when GSPO clips "
    "more in every phase but less than that, *disagrees* otherwise",
    f"*volatility reproduced*: at least {VOLATILITY_REPRODUCED * 100:.0f}% of activated "
    "experts change per step over the run (half the paper's ~10%)",
    f"*same weights on both sides*: learner-vs-engine gap below {SAME_WEIGHTS_GAP:.0e} nats "
    "per token",
)


class IncompleteRunsError(RuntimeError):
    """Runs the document needs are missing or did not reach their last step."""


@dataclass(frozen=True)
class Run:
    """One run directory: metrics rows, resolved config, timing (None before timing.json)."""

    rows: List[dict]
    config: object
    timing: Optional[dict]


@dataclass(frozen=True)
class Phase:
    """RL steps ``first..last`` (inclusive), named in the document by ``label``."""

    label: str
    first: int
    last: int


@dataclass(frozen=True)
class Reproduction:
    """Every run of one reproduction: ``runs[variant][seed]`` and ``cold_starts[seed]``."""

    out: Path
    cold_starts: Dict[int, Run]
    runs: Dict[str, Dict[int, Run]]

    @property
    def seeds(self) -> List[int]:
        return sorted(self.cold_starts)

    @property
    def variants(self) -> List[str]:
        return list(self.runs)

    @property
    def config(self):
        """The first RL run's config (everything but ``algo`` is the same in every run)."""
        return next(iter(next(iter(self.runs.values())).values())).config

    @property
    def num_steps(self) -> int:
        return self.config.trainer.num_steps

    def rows(self) -> Dict[str, Dict[int, List[dict]]]:
        """``{variant: {seed: rows}}``, what ``comparison.py`` takes."""
        return {v: {s: run.rows for s, run in by_seed.items()} for v, by_seed in self.runs.items()}

    def per_seed(self, variant: str, value: Callable[[List[dict]], Optional[float]]) -> List[float]:
        """``value(rows)`` of each seed's run of ``variant``, in seed order."""
        return [value(self.runs[variant][seed].rows) for seed in self.seeds]

    def median(self, variant: str, value: Callable[[List[dict]], Optional[float]]) -> float:
        """The median over seeds of ``value(rows)``."""
        return statistics.median(self.per_seed(variant, value))

    def phase(self, name: str) -> "Phase":
        """``run``, ``early``, ``late``, ``last10`` or ``last20`` of this reproduction's runs."""
        return phases(self.num_steps)[name]

    def phase_median(self, variant: str, key: str, phase: str = "run") -> float:
        """The median over seeds of each run's mean of ``key`` over ``phase``."""
        return self.median(variant, phase_mean(key, self.phase(phase)))

    def all_runs(self) -> List[Run]:
        """Cold starts first, then every RL run."""
        return list(self.cold_starts.values()) + [r for v in self.runs.values() for r in v.values()]

    def with_loss(self, loss: str) -> List[str]:
        """The variants trained with ``algo.loss == loss`` in the paper's setting: an engine in
        the learner's precision (the bf16-engine variants are the routing-replay section's)."""
        configs = {v: next(iter(by_seed.values())).config for v, by_seed in self.runs.items()}
        return [v for v, c in configs.items()
                if c.algo.loss == loss and c.rollout.embedded_dtype == "fp32"]


def _read_run(run_dir: Path, last_step: Optional[int]) -> tuple:
    """``(Run, None)`` or ``(None, why it is incomplete)``."""
    if not (run_dir / "config.yaml").is_file():
        return None, f"{run_dir}/config.yaml: no file"
    rows = read_rows(run_dir)
    config = load_config(run_dir / "config.yaml", validate=False)
    last_step = config.trainer.num_steps if last_step is None else last_step
    if not rows or rows[-1].get("step") != last_step:
        reached = rows[-1].get("step") if rows else "no rows"
        return None, f"{run_dir}/metrics.jsonl: last step {reached}, expected {last_step}"
    timing_path = run_dir / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
    return Run(rows, config, timing), None


def load_reproduction(out: Path, variants: Sequence[str], seeds: Sequence[int]) -> Reproduction:
    """Read every cold start and RL run; raise ``IncompleteRunsError`` naming each one missing."""
    out = Path(out)
    wanted = [(None, seed, out / "sft" / f"seed{seed}") for seed in seeds]
    wanted += [(v, seed, out / v / f"seed{seed}") for v in variants for seed in seeds]
    cold, runs, missing = {}, {v: {} for v in variants}, []
    for variant, seed, run_dir in wanted:
        run, why = _read_run(run_dir, last_step=0 if variant is None else None)
        if run is None:
            missing.append(f"{variant or 'cold start'} seed {seed} ({why})")
        elif variant is None:
            cold[seed] = run
        else:
            runs[variant][seed] = run
    if missing:
        raise IncompleteRunsError(
            f"{len(missing)} run(s) missing or incomplete under {out}: " + "; ".join(missing)
            + ". Run tools/reproduce_paper.py to complete them, or leave their variants out "
            "with --variants.")
    return Reproduction(out, cold, runs)


def phases(num_steps: int) -> Dict[str, Phase]:
    """The run, its first half, its last quarter, its last 10 and last 20 steps."""
    quarter = max(1, num_steps // 4)
    return {"run": Phase(f"steps 1-{num_steps}", 1, num_steps),
            "early": Phase(f"steps 1-{max(1, num_steps // 2)}", 1, max(1, num_steps // 2)),
            "late": Phase(f"steps {num_steps - quarter + 1}-{num_steps}",
                          num_steps - quarter + 1, num_steps),
            "last10": Phase("the last 10 steps", max(1, num_steps - 9), num_steps),
            "last20": Phase("the last 20 steps", max(1, num_steps - 19), num_steps)}


def phase_mean(key: str, phase: Phase) -> Callable[[List[dict]], Optional[float]]:
    """A function of one run's rows: the mean of ``key`` over the steps of ``phase``."""
    def mean(rows: List[dict]) -> Optional[float]:
        values = [r[key] for r in rows if key in r and phase.first <= r["step"] <= phase.last]
        return statistics.fmean(values) if values else None
    return mean


def end_accuracy(rows: List[dict]) -> float:
    """The last held-out accuracy of the run."""
    return [r[ACCURACY] for r in rows if ACCURACY in r][-1]


def mean_accuracy(rows: List[dict]) -> float:
    """The mean held-out accuracy over the evaluations after the start (step > 0)."""
    return statistics.fmean([r[ACCURACY] for r in rows if ACCURACY in r and r["step"] > 0])


def num_evaluations(rows: List[dict]) -> int:
    """Evaluations after the start."""
    return sum(1 for r in rows if ACCURACY in r and r["step"] > 0)


def collapsed(rows: List[dict]) -> bool:
    """The run ends more than ``COLLAPSE_DROP`` below its best held-out accuracy."""
    return end_accuracy(rows) < max(r[ACCURACY] for r in rows if ACCURACY in r) - COLLAPSE_DROP


def separation(a: Sequence[float], b: Sequence[float]) -> str:
    """``ahead``, ``behind`` (a relative to b) or ``not separated``: see ``SEPARATION_NOTE``."""
    spread = max(max(a) - min(a), max(b) - min(b))
    diff = statistics.median(a) - statistics.median(b)
    if abs(diff) <= spread:
        return "not separated"
    return "ahead" if diff > 0 else "behind"


def close(a: float, b: float) -> bool:
    """Within ``CLOSE_REL`` of the larger value."""
    return abs(a - b) <= CLOSE_REL * max(abs(a), abs(b))


def ratio(a: float, b: float) -> float:
    """``a / b``; infinite when only ``b`` is 0, 1 when both are (neither is larger)."""
    if b == 0:
        return math.inf if a > 0 else 1.0
    return a / b


def orders_of_magnitude(ratio: float) -> int:
    """``ratio`` rounded to a power of ten (8 -> 1, 50 -> 2)."""
    return round(math.log10(ratio)) if ratio > 0 else 0


def num_parameters(safetensors_path: Path) -> int:
    """Parameters in a safetensors file, from its header alone."""
    with open(safetensors_path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
