"""The shape of the library stays as docs/architecture.md draws it: packages by floor with no
upward import and no circle (nor among the modules of tools/ and benchmarks/), rollout's rooms
as the table lists them with the stand-in out of production's reach, rollout never reaching
Megatron, learner never reaching SGLang, launch never reaching torch, algorithms on torch alone,
each concern in one place, no test-only code, short functions.

Every rule runs twice: on the real tree (it must hold, up to the entries of ``KNOWN``), and on a
planted tree that repeats each problem issues 19 and 42 found (it must report every one), so a
rule that silently stopped seeing its problem fails too.

``KNOWN`` lists breaches that another engineer is fixing in this round, each with its owner. The
lead removes an entry once the fix has landed; an entry that no longer matches anything fails
the test, so none is forgotten. Nothing else is exempt.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict

import pytest

from tests import architecture_rules as rules

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
LIB_MEGATRON = {"distributed", "model", "learner", "checkpoint", "gpu_check"}
LIB_SGLANG = {"rollout", "weight_sync"}
STAND_IN = "rollout/standin"
PRODUCTION_ROOMS = ("rollout/sglang", "rollout/embedded")

KNOWN: Dict[str, Dict[str, str]] = {
    # The one loop is weight_sync/sync.py; the GPU kit keeps a second one until its first GPU run.
    "bucket_loop": {f"bucket loop in gspo_megatron.{m}":
                    "lead: the GPU kit times CudaIpcTransport.send_bucket alone, without an "
                    "engine session; move it onto weight_sync.sync.run_update after its first GPU run"
                    for m in ("gpu_check.weight_sync_check", "weight_sync.sync")},
}


def _product_files(root: Path, with_benchmarks: bool):
    dirs = ["gspo_megatron", "tools", "pipelines"] + (["benchmarks"] if with_benchmarks else [])
    return [p for d in dirs for p in sorted((root / d).rglob("*.py"))]


def _product_text(root: Path, tree) -> str:
    """What starts library code from outside it: tools, pipelines, Slurm scripts, Makefile,
    pyproject's console scripts, and the library's own command lines."""
    files = [p for p in _product_files(root, with_benchmarks=False)
             if "gspo_megatron" not in p.parts]
    files += sorted((root / "slurm").glob("*.sh")) + [root / "Makefile", root / "pyproject.toml"]
    texts = [p.read_text() for p in files if p.is_file()]
    return "\n".join(texts + [rules.library_strings(tree)])


def check_all(root: Path) -> Dict[str, Dict[str, str]]:
    """Every rule's breaches in the tree under ``root``, by rule."""
    tree = rules.scan(root)
    floors, allowed = rules.read_floors(DOC)
    return {
        "floors": {**rules.floor_violations(tree, floors, allowed),
                   **rules.entry_point_import_violations(tree)},
        "rooms": rules.room_violations(tree, *rules.read_rooms(DOC)),
        "stand_in": rules.stand_in_violations(tree, STAND_IN, PRODUCTION_ROOMS),
        "cycles": {**rules.cycle_violations(tree),
                   **rules.cycle_violations(rules.scan_entry_points(root))},
        "reach": {**rules.reach_violations(tree, "rollout", rules.MEGATRON),
                  **rules.reach_violations(tree, "learner", rules.SGLANG),
                  **rules.reach_violations(tree, "launch", ("torch",) + rules.MEGATRON)},
        "third_party": {**rules.third_party_violations(tree, rules.MEGATRON, LIB_MEGATRON),
                        **rules.third_party_violations(tree, rules.SGLANG, LIB_SGLANG)},
        "algorithms": rules.algorithms_violations(tree),
        "test_only": rules.unused_definition_violations(
            tree, _product_files(root, with_benchmarks=True), _product_text(root, tree)),
        "orphans": rules.orphan_module_violations(tree, _product_text(root, tree)),
        "losses": rules.loss_violations(tree),
        "bucket_loop": rules.one_place_violations(tree, "bucket loop", rules.bucket_loop_lines),
        "engine": rules.one_place_violations(tree, "SGLangEngine construction",
                                             lambda m: rules.call_lines(m, "SGLangEngine")),
        "build": rules.build_violations(tree),
        "long_functions": rules.long_function_violations(tree),
        "config": rules.unread_config_field_violations(tree),
    }


@pytest.fixture(scope="module")
def found():
    return check_all(REPO)


RULES = ("floors", "rooms", "stand_in", "cycles", "reach", "third_party", "algorithms", "test_only",
         "orphans", "losses", "bucket_loop", "engine", "build", "long_functions", "config")


@pytest.mark.parametrize("rule", RULES)
def test_the_library_keeps_its_shape(found, rule):
    known = KNOWN.get(rule, {})
    new = {k: v for k, v in found[rule].items() if k not in known}
    assert not new, f"{rule}: " + "; ".join(f"{k} ({v})" for k, v in sorted(new.items()))
    stale = sorted(set(known) - set(found[rule]))
    assert not stale, f"{rule}: fixed, remove from KNOWN in tests/test_architecture.py: {stale}"


def test_the_table_puts_every_package_on_a_floor():
    floors, allowed = rules.read_floors(DOC)
    packages = {p.name for p in (REPO / "gspo_megatron").iterdir()
                if (p / "__init__.py").is_file()}
    assert set(floors) == packages
    assert floors["config"] == 0 and not allowed["config"] and not allowed["algorithms"]


# ---- the planted tree: each problem of issues 19 and 42, which the rules must report -------

PLANTED = {
    # CP index math in the learner, used by the model: a circle and an upward import.
    "learner/batch.py": "from gspo_megatron.learner.context_parallel import shard\n"
                        "from gspo_megatron.algorithms.types import LossOutput\n",
    "learner/context_parallel.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from gspo_megatron.learner.batch import MicroBatch\n"
                                   "def shard(): pass\n",
    "model/attention.py": "from gspo_megatron.learner.context_parallel import shard\n",
    # A loss outside the registry, built by the learner.
    "learner/sft_loss.py": "from gspo_megatron.algorithms.types import LossOutput\n"
                           "def sft_loss(x):\n    return LossOutput(x)\n",
    "algorithms/types.py": "class LossOutput:\n    pass\n",
    # Helpers only tests use, and numpy in algorithms/.
    "algorithms/logprobs.py": "import numpy\ndef padded_to_packed(x):\n    return x\n",
    # rollout reaching Megatron through a lazy import of the CPU-compatibility module.
    "rollout/embedded/engine.py": "def load(stats):\n"
                                  "    from gspo_megatron.distributed import cpu_compat\n"
                                  "    stats.num_buckets += 1\n",
    "distributed/cpu_compat.py": "import megatron.core\n",
    "rollout/factory.py": "from gspo_megatron.rollout.sglang.engine import SGLangEngine\n"
                          "def build():\n    return SGLangEngine([])\n",
    "rollout/sglang/engine.py": "class SGLangEngine:\n    @classmethod\n"
                                "    def from_config(cls):\n        return cls([])\n",
    # The bucket loop in each transport; a module only a benchmark imports; sglang in learner.
    "weight_sync/disk.py": "def send(stats):\n    stats.num_buckets += 1\n",
    "weight_sync/estimate.py": "X = 1\n",
    "learner/forward.py": "import sglang\n",
    # A builder that also scores, a very long function, a config key nothing reads.
    "trainer/build.py": "class RolloutScorer:\n    pass\ndef build_parts():\n    return RolloutScorer()\n"
                        "def validate():\n" + "    x = 1\n" * 60,
    "config/schema.py": "class RolloutConfig:\n    overlap_one_step: bool = False\n",
    # The registry loading a higher package by name while that package imports the registry.
    "rewards/registry.py": "import importlib\nBUILTIN = ('gspo_megatron.tiny_task.task',)\n"
                           "def load():\n    for m in BUILTIN:\n        importlib.import_module(m)\n",
    "tiny_task/task.py": "from gspo_megatron.rewards.registry import BUILTIN\n",
    # Issue 42: a stand-in module at rollout's top, the SGLang client importing the stand-in, the
    # embedded engine naming it on a command line, the library importing a benchmark.
    "rollout/reference_server.py": "X = 1\n",
    "rollout/standin/server.py": "X = 1\n",
    "rollout/sglang/client.py": "from gspo_megatron.rollout.standin.server import X\n",
    "rollout/embedded/process.py": "CMD = ['python', '-m', 'gspo_megatron.rollout.standin.server']\n",
    "trainer/loop.py": "from benchmarks.bench_vs_trl import run_side\n",
}

PLANTED_ENTRY_POINTS = {
    # Issue 42: two benchmarks importing each other, one by its bare name (run by path).
    "benchmarks/bench_vs_trl.py": "def main():\n    from bench_vs_trl_sweep import run_sweep\n",
    "benchmarks/bench_vs_trl_sweep.py": "try:\n    from benchmarks import bench_vs_trl as bench\n"
                                        "except ImportError:\n    import bench_vs_trl as bench\n",
}

EXPECTED = {
    "floors": {"model -> learner", "rollout -> distributed", "tiny_task -> rewards",
               "trainer -> benchmarks/"},
    "rooms": {"rollout/reference_server.py at the top, not named in its row",
              "rollout/sglang -> rollout/standin"},
    "stand_in": {"rollout/sglang reaches rollout/standin", "rollout/embedded names rollout/standin"},
    "cycles": {"circle: gspo_megatron.learner.batch <-> gspo_megatron.learner.context_parallel",
               "circle: gspo_megatron.rewards.registry <-> gspo_megatron.tiny_task.task",
               "circle: benchmarks.bench_vs_trl <-> benchmarks.bench_vs_trl_sweep"},
    "reach": {"rollout reaches megatron", "learner reaches sglang"},
    "third_party": {"sglang imported by learner/"},
    "algorithms": {"algorithms imports numpy"},
    "test_only": {"gspo_megatron.algorithms.logprobs.padded_to_packed"},
    "orphans": {"gspo_megatron.weight_sync.estimate"},
    "losses": {"LossOutput built in gspo_megatron.learner.sft_loss"},
    "bucket_loop": {"bucket loop in gspo_megatron.rollout.embedded.engine",
                    "bucket loop in gspo_megatron.weight_sync.disk"},
    "engine": {"SGLangEngine construction in gspo_megatron.rollout.factory",
               "SGLangEngine construction in gspo_megatron.rollout.sglang.engine"},
    "build": {"gspo_megatron.trainer.build defines RolloutScorer"},
    "long_functions": {"gspo_megatron.trainer.build.validate"},
    "config": {"RolloutConfig.overlap_one_step"},
}


def test_every_rule_reports_the_problems_it_exists_for(tmp_path):
    lib = tmp_path / "gspo_megatron"
    for rel, text in PLANTED.items():
        path = lib / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    (lib / "__init__.py").touch()
    for rel, text in PLANTED_ENTRY_POINTS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = check_all(tmp_path)
    assert set(found) == set(RULES) == set(EXPECTED)
    for rule, keys in EXPECTED.items():
        missing = keys - set(found[rule])
        assert not missing, f"{rule} did not report {missing}; it reported {sorted(found[rule])}"
