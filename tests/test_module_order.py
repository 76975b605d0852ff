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


def test_modules_with_commands_ahead_run_in_the_second_half_among_others():
    spec = [(f"tests/test_m{i:02d}.py", ["t0", "t1"]) for i in range(20)]
    late = {"tests/test_m03.py", "tests/test_m07.py", "tests/test_m11.py", "tests/test_m19.py"}
    followed_by_another = False
    for seed in range(20):
        out = shuffled_by_module(_items(spec), seed, late=late)
        assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in _items(spec))
        modules = list(dict.fromkeys(i.nodeid.split("::")[0] for i in out))
        assert all(modules.index(m) >= 10 for m in late), (seed, modules)
        assert shuffled_by_module(_items(spec), seed, late=late) == out
        followed_by_another |= any(m not in late for m in modules[modules.index(sorted(
            late, key=modules.index)[0]):])
    assert followed_by_another  # mixed with the others, not all at the very end
    plain = shuffled_by_module(_items(spec), 1)
    assert any(list(dict.fromkeys(i.nodeid.split("::")[0] for i in plain)).index(m) < 10
               for m in late)  # without ``late`` some of them come early (the check can fail)


def test_a_module_with_a_command_ahead_is_found_by_its_tests():
    from tests.module_order import _modules_with_commands_ahead

    with_ahead = SimpleNamespace(nodeid="tests/test_x.py::test_slow", name="test_slow",
                                 module=SimpleNamespace(AHEAD={"test_slow": object()}))
    other = SimpleNamespace(nodeid="tests/test_x.py::test_fast", name="test_fast",
                            module=with_ahead.module)
    plain = SimpleNamespace(nodeid="tests/test_y.py::test_a", name="test_a",
                            module=SimpleNamespace())
    assert _modules_with_commands_ahead([other, plain]) == set()
    assert _modules_with_commands_ahead([with_ahead, other, plain]) == {"tests/test_x.py"}


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
