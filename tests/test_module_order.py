"""tests/module_order.py: ``make test`` runs the modules in a seeded shuffled order, whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.module_order import ENV_VAR, parse, shuffled_by_module
from tests.test_conftest import conftest_package


def _items(spec):
    return [SimpleNamespace(nodeid=f"{module}::{test}") for module, tests in spec for test in tests]


def test_modules_move_whole_and_keep_their_tests_order():
    spec = [(f"tests/test_m{i:02d}.py", [f"t{j}" for j in range(i % 3 + 1)]) for i in range(12)]
    items = _items(spec)
    out = shuffled_by_module(items, seed=7)
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in items)  # nothing lost or added
    modules = [i.nodeid.split("::")[0] for i in out]
    runs = [m for k, m in enumerate(modules) if k == 0 or modules[k - 1] != m]
    assert len(runs) == len(set(runs)) == 12  # each module's tests together
    for module, tests in spec:
        assert [i.nodeid.split("::")[1] for i in out if i.nodeid.startswith(module)] == tests
    assert shuffled_by_module(items, seed=7) == out  # a seed is one order
    orders = {tuple(dict.fromkeys(i.nodeid.split("::")[0] for i in shuffled_by_module(items, s)))
              for s in range(5)}
    assert len(orders) == 5  # 12 modules: five seeds, five orders


def test_the_setting_is_parsed_and_a_bad_one_names_the_variable():
    assert parse("") is None and parse("file") is None
    assert parse("shuffle:1234") == 1234
    assert 0 <= parse("shuffle") < 10**6
    for bad in ("random", "shuffle:x"):
        with pytest.raises(pytest.UsageError, match=ENV_VAR):
            parse(bad)


CASE = '''
import os
def test_a():
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(__name__ + "\\n")
def test_b():
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(__name__ + "\\n")
'''


def _session(package: Path, order: str, log: Path):
    log.unlink(missing_ok=True)
    env = dict(os.environ, ORDER_LOG=str(log), **{ENV_VAR: order})
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
                         cwd=package, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    ran = log.read_text().split()
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in ran)), ran, out.stdout


def test_a_session_runs_the_order_its_seed_names_and_says_so(tmp_path):
    package = conftest_package(tmp_path)
    names = [f"test_case_{c}" for c in "abcdef"]
    for name in names:
        (package / f"{name}.py").write_text(CASE)
    log = tmp_path / "order.log"
    files, ran, stdout = _session(package, "file", log)
    assert files == names and len(ran) == 12 and "module order: the files'" in stdout
    expected = [i.nodeid.split(".py")[0] for i in shuffled_by_module(
        _items([(f"{n}.py", ["test_a", "test_b"]) for n in names]), 11)][::2]
    assert expected != names  # seed 11 moves them (else the check below could not fail)
    shuffled, ran, stdout = _session(package, "shuffle:11", log)
    assert shuffled == expected and len(ran) == 12
    assert f"seed 11 ({ENV_VAR}=shuffle:11 runs this order again)" in stdout
    again, _, _ = _session(package, "shuffle:11", log)
    assert again == shuffled
