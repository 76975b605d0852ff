"""``bench_vs_trl.py --sweep``: gspo-train against TRL over several shapes, each side on the whole
machine at its own best thread setting.

    python benchmarks/bench_vs_trl.py --sweep --doc docs/performance.md --readme README.md \\
        --results benchmarks/results/vs_trl_sweep.json
    python benchmarks/bench_vs_trl.py --sweep --from-results benchmarks/results/vs_trl_sweep.json \\
        --doc docs/performance.md --readme README.md      # re-render a finished sweep
    python benchmarks/bench_vs_trl.py --sweep --shapes base,wide --rounds 3

Per shape (model width, experts, top-k, prompts per step, response length; ``SHAPES``), both
sides get the same model, prompts and recipe (``vs_trl_setup.py``, as ``bench_vs_trl.py``) and
every CPU of the machine. The candidates are each side's thread settings the machine allows (``candidates``):
TRL and on-policy gspo-train with 1 .. ``os.cpu_count()`` OpenMP threads; the overlap with
``rollout.overlap_thread_split`` ``share`` (the learner gives the engine's process its thread)
and ``full`` (the learner keeps every thread). A probe round runs every candidate once, the
sides interleaved; each side keeps the one with the lowest median step; then ``--rounds``
interleaved rounds of the winners are timed (the probe is not counted, so picking the lucky
one of two runs does not flatter a side). Last, one overlapped run with the trainer's own
choice (``overlap_thread_split=auto``, its probe of the first steps) records the split it kept
and whether it warned that the overlap does not pay.

The gspo sides (``GSPO_SIDES``): on-policy with the engine's log-probs as pi_old
(``algo.old_logprob_source=rollout``, no extra forward pass), on-policy with the learner's
(``=learner``: one forward pass per step, as TRL, which recomputes them: the equal-work
comparison) and the one-step overlap. Each run's steady state (the median of steps 2-N) and the
mean of all its N steps are both kept: a short run pays for the first step and, in the trainer's
own overlapped run, for its thread probe.

Rows are sorted by gspo-train's better mode against TRL, best first; the range of each ratio
over the shapes follows. ``--doc`` replaces the file's section between ``MARK_BEGIN`` and
``MARK_END`` with the table, the command, the machine and the date, and ``--readme`` the
paragraph between ``HEADLINE_BEGIN`` and ``HEADLINE_END`` with the range over the shapes and
its conditions: numbers in the docs are written by the run that measured them
(``--from-results`` renders a finished run's record again, without measuring).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

try:
    from benchmarks import vs_trl_setup as bench  # imported from the repository root (tests)
except ImportError:  # run as bench_vs_trl.py --sweep, with benchmarks/ on sys.path
    import vs_trl_setup as bench

MARK_BEGIN = "<!-- bench_vs_trl --sweep: begin (written by the benchmark; do not edit) -->"
MARK_END = "<!-- bench_vs_trl --sweep: end -->"
AUTO_PROBE_STEPS = 2
PROBE_TIMEOUT_FACTOR = 2  # a probe run this many times slower than the quickest (+20 s) stops
HEADLINE_BEGIN = "<!-- bench_vs_trl --sweep headline: begin (written by the benchmark) -->"
HEADLINE_END = "<!-- bench_vs_trl --sweep headline: end -->"
DEFAULTS = {"steps": 6, "rounds": 3, "sides": "trl,gspo,gspo_learner_lp,gspo_overlap",
            "shapes": None}
SIDE_NAMES = {"trl": "TRL", "gspo": "on-policy", "gspo_learner_lp": "on-policy, learner log-probs",
              "gspo_overlap": "overlap"}
LOGPROB_SOURCE = {  # where each gspo side's pi_old comes from (TRL recomputes it: a forward pass)
    "gspo": "the engine's log-probs (`algo.old_logprob_source=rollout`, no extra forward pass)",
    "gspo_learner_lp": "the learner's log-probs (`algo.old_logprob_source=learner`, one forward "
                       "pass, as TRL: equal work)",
    "gspo_overlap": "the engine's log-probs",
}
RECORD_KEYS = ("args", "sides", "rows", "wall_s", "started", "num_cpus")
"""What a results record must hold to be rendered: the conditions are the measuring run's."""


@dataclass(frozen=True)
class Shape:
    """One point of the sweep (4 layers, heads 4 / 2 KV of dim 32, expert width 64 throughout)."""

    name: str
    hidden_size: int
    num_experts: int
    top_k: int
    prompts: int
    max_new_tokens: int
    samples: int = 8

    def describe(self) -> str:
        return (f"hidden {self.hidden_size}, {self.num_experts} experts top-{self.top_k}, "
                f"{self.prompts} x {self.samples}, <= {self.max_new_tokens} tokens")


SHAPES = {s.name: s for s in [
    Shape("base", 128, 8, 2, 8, 16),       # the setup the code was tuned on
    Shape("long", 128, 8, 2, 8, 48),       # longer responses: generation weighs more
    Shape("batch", 128, 8, 2, 32, 16),     # 4x the prompts per step
    Shape("wide", 256, 16, 4, 16, 16),     # issue 30's losing shape: wider, more experts, top-4
    Shape("wide_long", 256, 16, 4, 16, 48),
]}


@dataclass(frozen=True)
class Setting:
    """A side's thread setting: the process's OpenMP threads and gspo-train overrides."""

    label: str
    threads: int
    overrides: tuple = ()


def candidates(side: str, num_cpus: int) -> List[Setting]:
    """The thread settings of ``side`` that a machine of ``num_cpus`` allows."""
    if side != "gspo_overlap":
        return [Setting(f"{t} thread{'s' * (t > 1)}", t) for t in range(1, num_cpus + 1)]
    out: Dict[str, Setting] = {}
    for split in ("share", "full"):
        learner = num_cpus if split == "full" else max(1, num_cpus - 1)
        label = f"learner {learner} + engine 1"
        out.setdefault(label, Setting(label, num_cpus, (f"rollout.overlap_thread_split={split}",
                                                        "rollout.embedded_num_threads=1")))
    return list(out.values())


def _shape_args(args, shape: Shape, steps: int):
    a = argparse.Namespace(**vars(args))
    a.prompts, a.samples, a.max_new_tokens, a.steps = (shape.prompts, shape.samples,
                                                       shape.max_new_tokens, steps)
    return a


def _print(res: dict) -> None:
    print(json.dumps({k: v for k, v in res.items() if k != "step_s_all"}), flush=True)


def probe_timeout(fastest_s: float):
    """Seconds a probe run may take, given the quickest probe of its shape so far (None: none)."""
    return None if fastest_s == float("inf") else PROBE_TIMEOUT_FACTOR * fastest_s + 20


def run_shape(shape: Shape, args, sides: List[str], work: Path, trl_python: Path) -> dict:
    """Probe every side's candidates, time the winners, run the trainer's own choice once."""
    name = f"assets_h{shape.hidden_size}_e{shape.num_experts}_k{shape.top_k}"
    assets = bench.make_assets(work / name, shape.hidden_size, shape.num_experts, shape.top_k)
    a = _shape_args(args, shape, args.steps)
    run_dir = work / shape.name
    num_cpus = os.cpu_count() or 1
    probes: Dict[str, Dict[str, float]] = {s: {} for s in sides}
    best: Dict[str, Setting] = {}
    order = [(s, c) for s in sides for c in candidates(s, num_cpus)]
    fastest = float("inf")  # whole-process seconds of the quickest probe so far
    for i, (side, c) in enumerate(order[::2] + order[1::2]):  # a side's candidates apart
        res = bench.run_side(side, a, assets, run_dir, trl_python, f"probe{i}", c.threads,
                             c.overrides, timeout_s=probe_timeout(fastest))
        _print({**res, "shape": shape.name, "setting": c.label})
        probes[side][c.label] = res["step_s_median"]
        fastest = min(fastest, res.get("whole_process_s", fastest))
    for side in sides:
        label = min(probes[side], key=probes[side].get)
        best[side] = next(c for c in candidates(side, num_cpus) if c.label == label)
    timed: Dict[str, List[float]] = {s: [] for s in sides}
    first_n: Dict[str, List[float]] = {s: [] for s in sides}  # mean of every step, the 1st too
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            c = best[side]
            res = bench.run_side(side, a, assets, run_dir, trl_python, r, c.threads, c.overrides)
            _print({**res, "shape": shape.name, "setting": c.label})
            timed[side].append(res["step_s_median"])
            first_n[side].append(statistics.mean(res["step_s_all"]))
    out = {"shape": asdict(shape), "probe": probes, "timed": timed,
           "setting": {s: best[s].label for s in sides},
           "step_s": {s: statistics.median(v) for s, v in timed.items()},
           "first_n_s": {s: statistics.median(v) for s, v in first_n.items()}}
    if "gspo_overlap" in sides:
        out["auto"] = run_auto(shape, args, assets, run_dir, num_cpus)
    return out


def run_auto(shape: Shape, args, assets: Path, run_dir: Path, num_cpus: int) -> dict:
    """One overlapped run as a user would start it: the trainer probes and picks its split."""
    from gspo_megatron.trainer.schedule.one_step_threads import probe_phases

    # the warm-up step, every phase, then steps with the kept split
    steps = 1 + len(probe_phases("auto", num_cpus, 1)) * AUTO_PROBE_STEPS + 2
    a = _shape_args(args, shape, steps)
    overrides = ("rollout.overlap_thread_split=auto", "rollout.embedded_num_threads=1",
                 f"rollout.overlap_probe_steps={AUTO_PROBE_STEPS}")
    res = bench.run_side("gspo_overlap", a, assets, run_dir, Path(), "auto", num_cpus, overrides)
    res["overrides"] = list(overrides)
    probing = steps - 2  # the warm-up step and the probe phases
    res["probe_steps"] = probing
    res["steady_s"] = statistics.median(res["step_s_all"][probing:])
    res["first_n_mean_s"] = statistics.mean(res["step_s_all"])
    _print({**res, "shape": shape.name, "setting": "auto"})
    return res


def ratios(row: dict) -> Dict[str, float]:
    """RL steps per second of each gspo side relative to TRL (TRL's step time over ours)."""
    trl = row["step_s"]["trl"]
    return {s: trl / t for s, t in row["step_s"].items() if s != "trl"}


def _auto_cell(auto: dict) -> str:
    if not auto:
        return "-"
    probe = {k[len("overlap/probe_"):-len("_step_s")]: v for k, v in auto.items()
             if k.startswith("overlap/probe_")}
    if not probe:
        return "not probed"
    kept = min((p for p in probe if not p.startswith("serial")), key=probe.get)
    verdict = "**warned: slower than serial**" if auto.get("warned") else "pays, no warning"
    return f"kept `{kept}`; {verdict} ({' / '.join(f'{p} {v:.3f}' for p, v in probe.items())} s)"


def table(rows: List[dict], sides: List[str]) -> str:
    """The markdown table, best first, and the range of each ratio over the shapes."""
    gspo = [s for s in sides if s != "trl"]
    rows = sorted(rows, key=lambda r: -max(ratios(r).values()))
    head = ["shape", "setup"] + [f"{SIDE_NAMES.get(s, s)}: threads, s / step" for s in sides]
    head += [f"{SIDE_NAMES.get(s, s)} vs TRL" for s in gspo]
    if {"gspo", "gspo_overlap"} <= set(sides):
        head += ["overlap vs on-policy",
                 "trainer's own split (`auto`; fastest s / step per probe phase)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rat = ratios(r)
        cells = [r["shape"]["name"], Shape(**r["shape"]).describe()]
        cells += [f"{r['setting'][s]}, {r['step_s'][s]:.3f}" for s in sides]
        cells += [f"**{rat[s]:.2f}x**" for s in gspo]
        if {"gspo", "gspo_overlap"} <= set(sides):
            cells.append(f"{r['step_s']['gspo'] / r['step_s']['gspo_overlap']:.2f}x")
            cells.append(_auto_cell(r.get("auto", {})))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for s in gspo:
        vals = [ratios(r)[s] for r in rows]
        lines.append(f"- {SIDE_NAMES.get(s, s)}: **{min(vals):.2f}x - {max(vals):.2f}x** TRL's "
                     f"RL steps per second over {len(rows)} shapes")
    if {"gspo", "gspo_overlap"} <= set(sides):
        slower = [r["shape"]["name"] for r in rows
                  if r["step_s"]["gspo_overlap"] > r["step_s"]["gspo"]]
        lines.append("- overlap slower than on-policy at: " + (", ".join(slower) or "no shape"))
    return "\n".join(lines)


def first_steps_table(rows: List[dict], sides: List[str]) -> str:
    """Steady state against the mean of every step of a run (the first, with its warm-up, and for
    the trainer's own overlapped run its thread probe too): what a short run sees."""
    gspo = [s for s in sides if s != "trl"]
    head = (["shape"] + [f"{SIDE_NAMES.get(s, s)}: steady / first-N mean s" for s in sides]
            + [f"{SIDE_NAMES.get(s, s)} vs TRL, first N" for s in gspo])
    if {"gspo", "gspo_overlap"} <= set(sides):
        head.append("trainer's own split: steady after its probe / first-N mean s (probe steps)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        first = r.get("first_n_s", {})
        cells = [r["shape"]["name"]]
        cells += [f"{r['step_s'][s]:.3f} / " + (f"{first[s]:.3f}" if s in first else "-")
                  for s in sides]
        cells += [f"{first['trl'] / first[s]:.2f}x" if {"trl", s} <= set(first) else "-"
                  for s in gspo]
        if {"gspo", "gspo_overlap"} <= set(sides):
            auto = r.get("auto", {})
            cells.append(f"{auto['steady_s']:.3f} / {auto['first_n_mean_s']:.3f} "
                         f"({auto['probe_steps']} of {len(auto['step_s_all'])})"
                         if "steady_s" in auto else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_table(rows: List[dict], sides: List[str]) -> str:
    """Each candidate's median s / RL step in the probe round (one run each)."""
    lines = ["| shape | " + " | ".join(f"{SIDE_NAMES.get(s, s)} candidates" for s in sides) + " |",
             "|" + "---|" * (len(sides) + 1)]
    for r in rows:
        cells = [" / ".join(f"{label}: " + (f"{t:.3f}" if t != float("inf") else "stopped")
                            for label, t in r["probe"][s].items()) for s in sides]
        lines.append(f"| {r['shape']['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _command(record: dict) -> str:
    argv = record.get("argv")
    if argv is None:  # a record from before argv was kept: the flags that change the run
        a = record["args"]
        argv = ["--sweep"] + [f"--{k} {a[k]}" for k in ("shapes", "steps", "rounds", "sides")
                              if a.get(k) not in (None, DEFAULTS.get(k))]
        argv += ["--with-diagnostics"] * bool(a.get("with_diagnostics"))
        argv += [f"--doc {a['doc']}"] * bool(a.get("doc"))
    return "python benchmarks/bench_vs_trl.py " + " ".join(argv)


def _conditions(record: dict) -> str:
    rows = record["rows"]
    return (f"{record['started']} UTC, {record['num_cpus']} CPUs, load average "
            f"{rows[0]['load'][0]:.1f} at the start and {rows[-1]['load'][1]:.1f} at the end")


def section(record: dict) -> str:
    """The docs section: command, conditions, table, probe round (with its markers)."""
    rows, sides, a, cpus = record["rows"], record["sides"], record["args"], record["num_cpus"]
    return "\n".join([
        MARK_BEGIN, "", "```bash", _command(record), "```", "",
        f"Measured {_conditions(record)} (the machine is shared: other jobs ran at a lower "
        f"priority), whole sweep {record['wall_s'] / 60:.1f} min. Every side gets the whole "
        f"machine and its best thread setting of a probe round (named in the table); seconds "
        f"per RL step are the median of steps 2-{a['steps']} of a run, then the median of "
        f"{a['rounds']} interleaved rounds of the winners; the expert-volatility diagnostic is "
        f"{'on' if a['with_diagnostics'] else 'off'}. Overlap settings: `share` is learner "
        f"{max(1, cpus - 1)} + engine 1, `full` learner {cpus} + engine 1 (OpenMP threads). "
        f"Rows: best first by gspo-train's better mode.", "",
        table(rows, sides), "",
        f"Steady state (the median above) against the mean of all {a['steps']} steps of a run, "
        f"the first with its warm-up included; the trainer's own overlapped run probes its "
        f"thread split in its first steps, which a short run pays for:", "",
        first_steps_table(rows, sides), "",
        f"The probe round (one run per candidate, s / RL step; `stopped`: ran over "
        f"{PROBE_TIMEOUT_FACTOR}x the quickest probe of the shape + 20 s and was killed):", "",
        probe_table(rows, sides), "", MARK_END])


def headline(record: dict) -> str:
    """The README's speed paragraph (with its markers): the range over shapes, its conditions."""
    rows, sides = record["rows"], record["sides"]
    shapes = [Shape(**r["shape"]) for r in rows]

    def span(vals, fmt="{}"):
        lo, hi = min(vals), max(vals)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"

    headline_names = dict(SIDE_NAMES, gspo_learner_lp=SIDE_NAMES["gspo"])  # the source says it
    parts = [f"{headline_names[s]}{' (`rollout.overlap_one_step=true`)' * (s == 'gspo_overlap')} "
             f"with {LOGPROB_SOURCE[s]} **{span([ratios(r)[s] for r in rows], '{:.2f}')}x**"
             for s in sides if s != "trl"]
    text = (f"**Speed** against TRL's `GRPOTrainer` over {len(rows)} shapes of a tiny MoE "
            f"(hidden {span([x.hidden_size for x in shapes])}, "
            f"{span([x.num_experts for x in shapes])} experts, "
            f"top-k {span([x.top_k for x in shapes])}, "
            f"{span([x.prompts for x in shapes])} prompts x {span([x.samples for x in shapes])} "
            f"samples, "
            f"<= {span([x.max_new_tokens for x in shapes])} new tokens), each side on the whole "
            f"machine at its own best thread setting, gspo-train's expert-volatility diagnostic "
            f"off ({_conditions(record)}): " + "; ".join(parts) + " TRL's RL steps per second "
            f"(TRL recomputes its old log-probs with a forward pass).")
    if {"gspo", "gspo_overlap"} <= set(sides):
        slower = [r["shape"]["name"] for r in rows
                  if r["step_s"]["gspo_overlap"] > r["step_s"]["gspo"]]
        text += (f" The overlap is slower than on-policy at {len(slower)} of {len(rows)} shapes"
                 f"{' (' + ', '.join(slower) + ')' if slower else ''}; the trainer probes its "
                 f"thread split and warns when overlapping does not pay.")
    source = f" from [{record['results_path']}]({record['results_path']})" \
        if record.get("results_path") else ""
    text += (f" [docs/performance.md](docs/performance.md){source}, "
             "`python benchmarks/bench_vs_trl.py --sweep`.")
    return "\n".join([HEADLINE_BEGIN, text, HEADLINE_END])


def write_doc(path: Path, text: str, begin: str = MARK_BEGIN, end: str = MARK_END) -> None:
    """Replace the section of ``path`` between ``begin`` and ``end`` with ``text`` (which
    carries the markers)."""
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no section marked {begin!r} ... {end!r}")
    head, rest = doc.split(begin, 1)
    path.write_text(head + text + rest.split(end, 1)[1])


def render(record: dict, doc: Optional[str], readme: Optional[str]) -> str:
    """Print the section; write it into ``doc`` and the headline into ``readme`` (when given)."""
    text = section(record)
    print("\n" + text + "\n\n" + headline(record), flush=True)
    if doc:
        write_doc(Path(doc), text)
    if readme:
        write_doc(Path(readme), headline(record), HEADLINE_BEGIN, HEADLINE_END)
    return text


def run_sweep(args) -> int:
    if args.from_results:  # re-render a finished sweep (its own numbers, command and date)
        record = load_record(Path(args.from_results))
        render(record, args.doc, args.readme)
        return 0
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDE_NAMES] + ([] if "trl" in sides else ["(trl)"])
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    if unknown or any(n not in SHAPES for n in names) or args.steps < 2:
        raise SystemExit(f"--sweep: sides must include trl and be among {sorted(SIDE_NAMES)} "
                         f"(got {args.sides}), shapes among {sorted(SHAPES)} (got {names}), "
                         f"--steps >= 2")
    work = Path(args.work) / "sweep"
    trl_python = bench.ensure_trl_venv(Path(args.trl_venv or Path(args.work) / "trl_venv"),
                                       args.trl_version)
    started = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M")
    t0 = time.perf_counter()
    rows = []
    for name in names:
        load_before = os.getloadavg()[0]
        row = run_shape(SHAPES[name], args, sides, work, trl_python)
        row["load"] = [load_before, os.getloadavg()[0]]
        rows.append(row)
    record = {"args": vars(args), "argv": sys.argv[1:], "sides": sides, "rows": rows,
              "wall_s": time.perf_counter() - t0, "started": started,
              "num_cpus": os.cpu_count() or 1}
    if args.results:
        record["results_path"] = args.results
        Path(args.results).write_text(json.dumps(record, indent=1) + "\n")
    (work / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    render(record, args.doc, args.readme)
    return 0


def load_record(path: Path) -> dict:
    """A finished sweep's record, refused when it lacks the measuring run's conditions (the
    machine that renders it is not the one that measured it)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--from-results {path}: cannot read a sweep record ({exc})") from None
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise SystemExit(f"--from-results {path}: the record has no {missing}; rerun the sweep "
                         f"(its conditions must come from the run that measured it)")
    return record
