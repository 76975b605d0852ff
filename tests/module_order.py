"""The order the session runs its test modules in: the files' order, or shuffled (issue 41 item 1).

    GSPO_TEST_ORDER=shuffle        make test   # a fresh seed, printed in pytest's header
    GSPO_TEST_ORDER=shuffle:1234   pytest      # that seed's order again
    GSPO_TEST_ORDER=file           pytest      # the files' order (pytest's own; the default)

Why: one full run in three once failed nine trainer tests with ``LookupError`` from
``ContextVar.reset``, long after whatever broke the interpreter's state; run alone they passed.
A suite that always runs in one order hides such a dependence: the culprit always runs before
the same victims, or after them. ``make test`` (and so CI) shuffles the modules with a fresh seed
each run, so over runs every module follows different ones; the header and the summary
name the seed, so a
red order can be run again as it was. Only whole modules move: the tests of one module keep
their order (module fixtures, and tests that end the module's server after every test that needs
it, rely on it). ``tests/conftest.py``'s per-test checks (threads, the context) then name the
test that left the state broken, whichever order found it.

Modules whose tests take a command run ahead (``tests/ahead.py``) land in the second half of the
order, among the others: their commands then have the first half's time to finish beside it. In
the first half a test waited for its command at setup while a core idled (fresh clone 16: 142 s
for the server probes, clone 15: 56 s for the reliability faults).
"""

from __future__ import annotations

import os
import random
from typing import Collection, List, Optional

import pytest

ENV_VAR = "GSPO_TEST_ORDER"
_SEED = pytest.StashKey[Optional[int]]()


def parse(value: str) -> Optional[int]:
    """``None`` for the files' order, else the shuffle's seed (a fresh one for ``shuffle``)."""
    value = value.strip()
    if value in ("", "file"):
        return None
    kind, _, seed = value.partition(":")
    if kind != "shuffle":
        raise pytest.UsageError(f"{ENV_VAR}={value!r}: expected 'file', 'shuffle' or "
                                f"'shuffle:<seed>'")
    if not seed:
        return random.SystemRandom().randrange(10**6)
    try:
        return int(seed)
    except ValueError:
        raise pytest.UsageError(f"{ENV_VAR}={value!r}: the seed must be an integer") from None


def shuffled_by_module(items: List, seed: int, late: Collection[str] = ()) -> List:
    """``items`` with their modules in the order ``seed`` picks, each module's tests in theirs;
    the modules named in ``late`` only in the second half of the order (mixed with others)."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rng = random.Random(seed)
    names = sorted(modules)
    rng.shuffle(names)
    first = [n for n in names if n not in late][:len(names) // 2]
    second = [n for n in names if n not in first]
    if late:
        rng.shuffle(second)
    return [item for name in first + second for item in modules[name]]


def _modules_with_commands_ahead(items: List) -> set:
    from tests.ahead import _command

    return {item.nodeid.split("::", 1)[0] for item in items
            if getattr(item, "module", None) is not None and _command(item) is not None}


def pytest_configure(config) -> None:
    config.stash[_SEED] = parse(os.environ.get(ENV_VAR, ""))


def describe(seed: Optional[int]) -> str:
    if seed is None:
        return f"module order: the files' ({ENV_VAR}=shuffle shuffles it)"
    return f"module order: shuffled, seed {seed} ({ENV_VAR}=shuffle:{seed} runs this order again)"


def pytest_report_header(config) -> str:
    return describe(config.stash.get(_SEED, None))


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Also at the end (``-q`` prints no header), next to the failures it may explain."""
    terminalreporter.write_line(describe(config.stash.get(_SEED, None)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    seed = config.stash.get(_SEED, None)
    if seed is not None:
        items[:] = shuffled_by_module(items, seed, late=_modules_with_commands_ahead(items))
