"""Test-session settings shared by every test module.

The suite runs on two pytest-xdist workers (``make test``: ``-n 2 --dist loadgroup``). Tests
that drive the one local Slurm cluster (``tools/slurm_local.sh``) share its queue and node
states, so they form one xdist group and run one after the other on a single worker. Each worker
runs torch (and the processes its tests spawn) with one OpenMP thread.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one OpenMP thread each (and in the processes tests spawn), or
    # OpenMP's spinning barriers oversubscribe the cores and multi-process tests crawl.
    os.environ["OMP_NUM_THREADS"] = "1"

SLURM_MODULES = {"test_pipelines_submit_grid.py", "test_pipelines_submit_pipeline.py",
                 "test_slurm_infra.py", "test_slurm_pipeline.py", "test_slurm_scripts.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLURM_MODULES:
            item.add_marker(pytest.mark.xdist_group("slurm"))
