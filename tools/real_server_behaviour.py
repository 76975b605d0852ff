"""Send the same requests to the real SGLang server (CPU) and to the stand-in; write the table.

    make sglang-venv && .venv/bin/python tools/real_server_behaviour.py --full [--json out.json]

Runs ``tools/server_behaviour`` (probes in ``probes*.py``, the run in ``run.py``) and rewrites
the table between ``<!-- real server behaviour: begin/end -->`` in docs/rollout.md: the real
server's and the stand-in's cells come from this run, the request and "our side" columns from
``server_behaviour/rows.py``. Without ``--full`` the rows that need extra server starts
(``run.FULL_ONLY_ROWS``) keep the cells the doc has. Exit 0 when every row behaves as
``rows.py`` expects (the same on both servers, or a known difference), 1 otherwise (the doc is
written either way: it says what was observed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.server_behaviour import rows as table  # noqa: E402
from tools.server_behaviour.run import observe, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="also the rows that need extra starts")
    p.add_argument("--doc", default=str(REPO / "docs" / "rollout.md"))
    p.add_argument("--json", default=None, help="also write the observations here")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="real_server_behaviour_") as work:
        timings = {}
        observed = observe(Path(work), full=args.full, timings=timings)
    seconds = time.monotonic() - t0
    if args.json:
        write_json(observed, Path(args.json), seconds, args.full, timings)
    doc_path = Path(args.doc)
    doc = doc_path.read_text()
    cells = table.doc_cells(doc) if not args.full else {}
    cells.update({o.row: (o.real, o.stand_in) for o in observed})
    doc_path.write_text(table.replace_table(doc, table.render(cells)))
    for o in observed:
        print(f"{o.row}: {'same' if o.same else 'differs'} {o.measured or ''}")
    errors = table.unexpected(observed)
    print(f"{len(observed)} rows in {seconds:.0f} s ({timings}); {len(errors)} unexpected",
          file=sys.stderr)
    for e in errors:
        print("unexpected:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
