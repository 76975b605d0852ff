"""Expert volatility against the number of experts at Qwen3-30B-A3B's widths, for
docs/paper_reproduction.md: the section that ``tools/volatility_vs_experts.py`` writes between
:data:`BEGIN` and :data:`END`, and that ``paper_report.write_doc`` carries over when it
regenerates the rest of the document (the runs behind it take the 24 GiB machine for ~30 min and
are not part of the paper grid).

Per routing (experts, top-k): the mean over the run's GSPO steps of
``routing/activated_expert_changed_frac`` (activated experts of a (response token, layer) pair
no longer activated after the step's updates, the paper's measure) and of
``routing/expert_set_changed_frac`` (pairs whose top-k set changed), with the steps' min-max.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Sequence

ACTIVATED = "routing/activated_expert_changed_frac"
TOPK_SET = "routing/expert_set_changed_frac"
BEGIN = "<!-- volatility_vs_experts: begin (written by tools/volatility_vs_experts.py; do not edit) -->"
END = "<!-- volatility_vs_experts: end -->"


@dataclass(frozen=True)
class ExpertPoint:
    """One routing's run: its per-step volatility."""

    num_experts: int
    top_k: int
    activated: List[float]
    """``routing/activated_expert_changed_frac`` of each GSPO step."""
    topk_set: List[float]
    """``routing/expert_set_changed_frac`` of each GSPO step."""
    s_per_step: float

    @property
    def activated_mean(self) -> float:
        return statistics.fmean(self.activated)

    @property
    def topk_set_mean(self) -> float:
        return statistics.fmean(self.topk_set)

    @property
    def label(self) -> str:
        return f"{self.num_experts} experts top-{self.top_k}"


def point_from_rows(num_experts: int, top_k: int, rows: Sequence[dict]) -> ExpertPoint:
    """One run's metrics rows (``metrics.jsonl``) -> its point; raises when no step measured."""
    steps = [r for r in rows if ACTIVATED in r]
    if not steps:
        raise RuntimeError(f"{num_experts} experts top-{top_k}: no {ACTIVATED} in the run's rows")
    return ExpertPoint(num_experts, top_k, [r[ACTIVATED] for r in steps],
                       [r[TOPK_SET] for r in steps],
                       statistics.median(r["time/step_s"] for r in steps))


def save_points(path: Path, points: Sequence[ExpertPoint], setting: Dict[str, object]) -> None:
    path.write_text(json.dumps({"setting": setting, "points": [asdict(p) for p in points]},
                               indent=1))


def load_points(path: Path) -> tuple:
    data = json.loads(Path(path).read_text())
    return [ExpertPoint(**p) for p in data["points"]], data["setting"]


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def trend(points: Sequence[ExpertPoint]) -> str:
    """How the top-8 points' activated-expert volatility moves with the expert count."""
    top8 = sorted((p for p in points if p.top_k == 8), key=lambda p: p.num_experts)
    if len(top8) < 2:
        return "too few top-8 points for a trend"
    means = [p.activated_mean for p in top8]
    rising = all(b > a for a, b in zip(means, means[1:]))
    ratio = means[-1] / means[0] if means[0] > 0 else float("inf")
    return (f"{'rises with every step up in' if rising else 'does not rise monotonically with'} "
            f"the expert count from {top8[0].num_experts} to {top8[-1].num_experts} experts "
            f"({_pct(means[0])} -> {_pct(means[-1])}, {ratio:.1f}x)")


def section(points: Sequence[ExpertPoint], setting: Dict[str, object]) -> str:
    """The marked Markdown section (see the module doc)."""
    lines = [BEGIN, "", "### Expert volatility against the number of experts, at the real widths",
             "", f"```bash\n{setting['command']}\n```", "",
             f"Run {setting['date']} ({setting['cpus']} CPUs, load average {setting['load']}), "
             f"code {setting['code']}. {setting['what']}", "",
             "| routing | GSPO steps | activated experts changed per step: mean (steps' min-max) "
             "| top-k set changed | s / step |", "|---|---|---|---|---|"]
    for p in sorted(points, key=lambda q: (q.num_experts, q.top_k)):
        lines.append(f"| {p.label} | {len(p.activated)} | {_pct(p.activated_mean)} "
                     f"({_pct(min(p.activated))}-{_pct(max(p.activated))}) | "
                     f"{_pct(p.topk_set_mean)} | {p.s_per_step:.0f} |")
    lines += ["", f"Reading: at these widths the activated-expert volatility {trend(points)}."
              + _against_tiny(points), "", END]
    return "\n".join(lines)


def _against_tiny(points: Sequence[ExpertPoint]) -> str:
    """128 experts top-8 against 8 experts top-2 and the paper's ~10%, when both were run."""
    by = {(p.num_experts, p.top_k): p for p in points}
    big, tiny = by.get((128, 8)), by.get((8, 2))
    if big is None or tiny is None:
        return ""
    ratio = big.activated_mean / tiny.activated_mean if tiny.activated_mean > 0 else float("inf")
    return (f" 128 experts top-8 (Qwen3-30B-A3B's routing) change {_pct(big.activated_mean)} of "
            f"their activated experts per step, 8 experts top-2 (the tiny models' routing) "
            f"{_pct(tiny.activated_mean)}: {ratio:.1f}x, on the same prompts, widths and "
            f"updates; the top-k set of a (token, layer) pair changes in "
            f"{_pct(big.topk_set_mean)} of pairs against {_pct(tiny.topk_set_mean)} (with "
            f"{big.top_k} slots instead of {tiny.top_k}, one change among them is more likely"
            f"{', while the share of slots that change is within 1.5x' if 1 / 1.5 <= ratio <= 1.5 else ''}"
            "). The paper's ~10% is for the trained "
            "48-layer model; these are one randomly initialised layer (near-uniform router "
            "logits) after two updates at lr 1e-5, so the comparison is between routings, not "
            "with the paper's number.")


def empty_section() -> str:
    """The markers alone (a document that has not had the tool's run yet)."""
    return f"{BEGIN}\n\n*Not measured yet: `python tools/volatility_vs_experts.py --doc " \
           f"docs/paper_reproduction.md`.*\n\n{END}"


def existing_section(doc_path: Path) -> str:
    """The marked section of ``doc_path`` as it is (markers included), else :func:`empty_section`."""
    path = Path(doc_path)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        return BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    return empty_section()


def write_section(doc_path: Path, text: str) -> None:
    """Replace the marked section of ``doc_path`` with ``text``; refuses a document without it."""
    path = Path(doc_path)
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path}: no section marked {BEGIN!r} ... {END!r}")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(head + text + rest.split(END, 1)[1])
