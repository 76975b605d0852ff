"""``async_groups.jsonl``: what became of every prompt group of an asynchronous run.

One row per event batch, each naming groups by admission index and prompt id:
``{"step": s, "taken": [[index, prompt_id, lag, {version: tokens}], ...]}`` when step s took them
(``lag``: of the group's oldest token; the token counts per weight version are the engine's
own report, kept raw for audits that recount the lags, ``tests/lag_audit.py``),
and, from server engines, ``"served": [[index, prompt_id, {server: tokens}, [reason, ...]], ...]``
in the same row: which servers generated the group's tokens, and why any of its samples was sent
again (a server lost or timed out, our pause cut it; issue 50's audit that a dead server's groups
were finished elsewhere, once),
``{"step": s, "dropped": [[index, prompt_id, reason], ...]}`` (``too_old`` or ``equal_rewards``),
``{"step": s, "left": [[index, prompt_id], ...]}`` at the run's end (buffered or in flight).
Across a kill and a resume, rows past the resumed step are trimmed (as ``metrics.jsonl``'s are),
so the file of a finished run names each admitted index exactly once: the audit that no prompt
trained twice and none was lost (``tests/test_trainer_schedule_k_stale_real_sglang.py``).
Only the main rank writes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

LEDGER_FILE = "async_groups.jsonl"


class GroupLedger:
    """Appends rows; :meth:`start` trims to the resumed step first."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LEDGER_FILE

    def start(self, resumed_step: Optional[int]) -> None:
        """Keep the rows up to ``resumed_step`` (none on a fresh start)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = [] if resumed_step is None else [r for r in read_ledger(self.path)
                                                if r["step"] <= resumed_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def write(self, step: int, **lists) -> None:
        lists = {k: v for k, v in lists.items() if v}
        if lists:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **lists}) + "\n")


def read_ledger(path: str | Path) -> List[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
