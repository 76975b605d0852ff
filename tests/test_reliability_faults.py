"""Fault injection, one test per problem of issue 18 (the faults live in tools/reliability/):

1. two jobs in one run directory;      2. a damaged newest checkpoint (shard, common.pt);
3. a full disk (before and during a checkpoint write, a leftover .partial; gspo-convert onto a
   full disk, gspo-export running into ENOSPC);
4. metrics.jsonl after a crash before the first checkpoint and with a torn last line;
5. no process outlives a SIGKILLed trainer;   7. SIGUSR1 during start-up.

Each runs the tiny trainer as a subprocess (about 10 s a run) and compares a resumed run with an
uninterrupted one: identical metrics and bit-identical exported weights.
"""

from __future__ import annotations

import pytest

from tools.reliability import disk_faults, faults
from tools.reliability.harness import Workspace

CASES = [faults.two_jobs, faults.damaged_distcp, faults.damaged_common,
         disk_faults.disk_full_precheck, disk_faults.disk_full_mid_write, disk_faults.leftover_partial,
         disk_faults.convert_disk_full, disk_faults.export_enospc,
         faults.sigkill_before_first_checkpoint, faults.torn_metrics, faults.sigkill_orphans,
         faults.sigusr1_at_start]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("faults"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", CASES, ids=lambda f: f.__name__)
def test_fault_is_survived(ws, fault):
    result = fault(ws)
    assert result.ok, f"{result.name}: {result.verdict} (exit {result.exit_codes}; {result.line})"
