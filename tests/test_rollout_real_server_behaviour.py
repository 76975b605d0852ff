"""The differential test: the same requests to the real SGLang 0.5.23 server (CPU) and to the
stand-in, compared by behaviour, and docs/rollout.md's real-server table checked against it.

``tools/server_behaviour`` runs the probes (``run.observe``): a stand-in process and, one at a
time, a standard real server (every probe that leaves it alive, then a wrong-shape tensor, which
kills it), a real server with ``--dtype auto`` and no ``--sleep-on-idle`` (then
``/release_memory_occupation``, which kills it) and one with ``--enable-deterministic-inference``
(exits at start). Both servers serve the tiny float32 checkpoint. What is compared:

* greedy (``temperature: 0``): token ids equal, log-probs within ``LOGPROB_TOL`` = 1e-5 (measured
  on this machine: bit-identical, 0.0);
* sampled, temperature 1 and 0.7: the real server on CPU does not honour ``sampling_seed``
  (deterministic inference is refused with ``torch_native`` attention), so the tokens differ by
  design. Compared instead: the log-probs the real server returned for its own tokens against
  the stand-in's model scoring those tokens teacher-forced, ``log_softmax(logits / T)`` (the
  same checkpoint loaded as the stand-in loads it): within 1e-5 (measured: 2.4e-7, one float32
  ulp at |log-prob| ~ 4). The stand-in gets the same requests and must answer them alike;
* refusals and plain requests: status code, the body's fields and SGLang's message, or "dies"
  with the exception the real server's log ends with; the fields of a ``/generate`` answer.

Every row must match, except those ``tools/server_behaviour/rows.py`` lists with a reason (and
those must still differ, so a fixed difference gets its reason removed). The observed cells of
the doc's table must equal this run's, except the two rows that need extra starts
(``run.FULL_ONLY_ROWS``: ``tools/real_server_behaviour.py --full`` observes them). The run's
observations are written to ``<tmp>/real_server_behaviour.json``, by a process that runs them
while the session's first tests run (``tests/ahead.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ahead import Command
from tools.server_behaviour import rows as table
from tools.server_behaviour.probes import LOGPROB_TOL, Observed
from tools.server_behaviour.run import FULL_ONLY_ROWS

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "rollout.md"


OBSERVE = """
import sys, time
from pathlib import Path
from tools.server_behaviour.run import observe, write_json
out, t0, timings = Path(sys.argv[1]), time.monotonic(), {}
observed = observe(out / "work", timings=timings)
write_json(observed, out / "real_server_behaviour.json", time.monotonic() - t0, full=False,
           timings=timings)
"""
AHEAD = {"test_the_stand_in_behaves_like_the_real_server_and_the_doc_says_what_it_does": Command(
    ["{python}", "-c", OBSERVE, "{dir}"], early=True, foreground_priority=True, timeout_s=1200,
    min_available_gib=9.0)}
"""The probes (three real-server starts, ~100 CPU-seconds) while the first tests of the session
run, which hold no server (``tests/ahead.py``); at the foreground's priority: the idle-CPU probe
measures a spinning server's share of a core."""


@pytest.mark.slow
def test_the_stand_in_behaves_like_the_real_server_and_the_doc_says_what_it_does(ahead):
    artifact = ahead.dir / "real_server_behaviour.json"
    assert ahead.returncode == 0 and artifact.is_file(), ahead.stdout + ahead.stderr[-3000:]
    recorded = json.loads(artifact.read_text())
    observed = [Observed(**row) for row in recorded["rows"]]
    print(f"phases (s): {recorded['timings']}")
    by_row = {o.row: o for o in observed}
    assert sorted(by_row) == sorted(set(table.ROW_IDS) - set(FULL_ONLY_ROWS))

    greedy = by_row["greedy"].measured
    assert greedy["tokens_equal"] and greedy["greedy_max_abs_logprob_diff"] <= LOGPROB_TOL, greedy
    for row in ("sampled_t1", "sampled_t07"):
        assert by_row[row].measured[f"{row}_max_abs_logprob_diff"] <= LOGPROB_TOL, by_row[row]
    assert not table.unexpected(observed), "\n".join(table.unexpected(observed))

    in_doc = table.doc_cells(DOC.read_text())
    stale = {o.row: {"doc": in_doc[o.row], "observed": (o.real, o.stand_in)} for o in observed
             if in_doc[o.row] != (o.real, o.stand_in)}
    assert not stale, (f"docs/rollout.md's table is not what the servers do ({artifact}); rerun "
                       f"tools/real_server_behaviour.py --full:\n{json.dumps(stale, indent=1)}")


def test_the_doc_table_has_every_row_with_the_written_columns_of_rows_py():
    """Fast: the doc's table parses into :data:`rows.ROWS` and re-renders to itself, so the
    hand-written columns (request, our side, known differences) are the ones rows.py holds."""
    doc = DOC.read_text()
    cells = table.doc_cells(doc)
    assert list(cells) == table.ROW_IDS
    assert table.replace_table(doc, table.render(cells)) == doc


def test_cells_with_a_pipe_survive_the_round_trip():
    cells = {r: (f"real {r} a|b", f"stand-in {r}") for r in table.ROW_IDS}
    doc = "intro\n" + table.render(cells) + "\nafter\n"
    assert table.doc_cells(doc) == cells
    observed = [type("O", (), {"row": "greedy", "real": "x", "stand_in": "y", "same": False})()]
    assert table.unexpected(observed) == ["greedy: real 'x', stand-in 'y'"]
