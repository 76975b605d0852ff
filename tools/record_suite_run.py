"""Record one ``make test`` run (a CI log) in docs/test_suite.md: outcome, time, conditions.

    bash .ci/run > ci.log 2>&1            # on a fresh clone (what CI does)
    python tools/record_suite_run.py ci.log --label "fresh clone 1"

Reads what the run itself printed: the commit and start time (``.ci/run``'s header), the CPU
count and load average at its start and end, the wall time of ``make test`` (installs
included), pytest's closing line (counts and seconds) and its ``--durations`` table. Each call
adds a row to the runs table between the markers and rewrites the slowest tests below it, so
the doc only ever holds numbers measured by a run, on the machine that ran it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BEGIN, END = "<!-- suite runs: begin -->", "<!-- suite runs: end -->"
SLOW_BEGIN, SLOW_END = "<!-- slowest tests: begin -->", "<!-- slowest tests: end -->"
HEADER = ("| label | commit | started (UTC) | cpus | load start / end | outcome | pytest | "
          "make test (with installs) |\n|---|---|---|---:|---|---|---:|---:|")


class LogError(ValueError):
    """The log lacks a line the record needs."""


def _find(pattern: str, text: str, what: str, path: str) -> re.Match:
    match = re.search(pattern, text, re.M)
    if match is None:
        raise LogError(f"{path}: no {what} (is it the output of .ci/run?)")
    return match


def parse_log(text: str, path: str = "log") -> dict:
    """The run's facts from ``.ci/run``'s output."""
    head = _find(r"^== (\S+) CI on (\S+)$", text, "'== <time> CI on <commit>' header", path)
    start = _find(r"^== start \S+ cpus (\d+) load ([\d.]+)", text, "'== start' conditions", path)
    end = _find(r"^== end \S+ cpus \d+ load ([\d.]+)", text, "'== end' conditions", path)
    wall = _find(r"^== wall (\d+) s, exit (\d+)$", text, "'== wall' line", path)
    summary = _find(r"^=*\s*((?:\d+ \w+(?: \w+)?, )*\d+ \w+.*?) in ([\d.]+)s", text,
                    "pytest summary line", path)
    counts = dict((name, int(n)) for n, name in re.findall(r"(\d+) (passed|failed|errors?|skipped)",
                                                             summary.group(1)))
    slowest = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$", text, re.M)
    return {"started": head.group(1), "commit": head.group(2), "cpus": int(start.group(1)),
            "load_start": float(start.group(2)), "load_end": float(end.group(1)),
            "wall_s": int(wall.group(1)), "exit": int(wall.group(2)), "counts": counts,
            "pytest_s": float(summary.group(2)), "slowest": slowest}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def row(facts: dict, label: str) -> str:
    counts = facts["counts"]
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    outcome = (f"**green**: {counts.get('passed', 0)} passed" if bad == 0 and facts["exit"] == 0
               else f"**red**: {bad} failed or errors, {counts.get('passed', 0)} passed")
    return (f"| {label} | `{facts['commit']}` | {facts['started']} | {facts['cpus']} | "
            f"{facts['load_start']:.1f} / {facts['load_end']:.1f} | {outcome} | "
            f"{_minutes(facts['pytest_s'])} | {_minutes(facts['wall_s'])} |")


def _replace_between(text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        return text.rstrip("\n") + f"\n\n{begin}\n{body}\n{end}\n"
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1]


def update_doc(doc: str, facts: dict, label: str) -> str:
    """``doc`` with the run's row added to the runs table and its slowest tests listed."""
    rows = []
    if BEGIN in doc:
        rows = [line for line in doc.split(BEGIN, 1)[1].split(END, 1)[0].splitlines()
                if line.startswith("| ") and not line.startswith("| label")]
    rows.append(row(facts, label))
    doc = _replace_between(doc, BEGIN, END, HEADER + "\n" + "\n".join(rows))
    slow = "\n".join(f"| {float(s):.1f} | {phase} | `{name}` |" for s, phase, name in facts["slowest"])
    slow_body = (f"The slowest tests of the last recorded run ({label}, `{facts['commit']}`):\n\n"
                 f"| seconds | phase | test |\n|---:|---|---|\n{slow}")
    return _replace_between(doc, SLOW_BEGIN, SLOW_END, slow_body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the output of .ci/run")
    parser.add_argument("--label", required=True, help="what the run was, e.g. 'fresh clone 1'")
    parser.add_argument("--doc", default="docs/test_suite.md")
    args = parser.parse_args(argv)
    try:
        facts = parse_log(Path(args.log).read_text(errors="replace"), args.log)
    except (OSError, LogError) as exc:
        print(f"record_suite_run: {exc}", file=sys.stderr)
        return 2
    doc_path = Path(args.doc)
    doc_path.write_text(update_doc(doc_path.read_text() if doc_path.exists() else "", facts, args.label))
    print(row(facts, args.label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
