"""tools/check_image_requirements.py: the GPU image's pins add to the SGLang base image without
contradicting it, resolve for CPython 3.12 / manylinux and form one stack. The rules run on small
hand-made reports and lock files (each must catch its fault); the slow tests resolve against the
package index: the file as it was before issue 29 fails (it pinned four packages at versions
published after the image), today's passes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.ahead import Command

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_image_requirements",
                                               REPO / "tools" / "check_image_requirements.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def report(**overrides):
    """A report shaped like pip's, for the packages the rules look at."""
    packages = {
        "sglang": ("0.5.23", ["torch==2.14.1", "transformers==5.19.0"]),
        "torch": ("2.14.1", ['nvidia-nccl-cu13==2.30.7; platform_system == "Linux"']),
        "nvidia-nccl-cu13": ("2.30.7", []),
        "megatron-core": ("0.16.1", ["torch>=2.6.0",
                                     'transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0; extra == "dev"']),
        "transformer_engine": ("2.11.0", ['transformer_engine_cu13==2.11.0; extra == "core-cu13"']),
        "transformer_engine_cu13": ("2.11.0", []),
    }
    packages.update(overrides)
    return {"install": [{"metadata": {"name": n, "version": vr[0], "requires_dist": vr[1]}}
                        for n, vr in packages.items() if vr is not None]}


PINS = {"sglang": "0.5.23", "torch": "2.14.1", "megatron-core": "0.16.1", "transformer-engine": "2.11.0"}


def problems(rep, pins=PINS, te_torch=("2.10.0", "2.11.0")):
    return check.check_stack(check.Resolved(rep), dict(pins), list(te_torch))


def test_a_consistent_stack_passes():
    assert problems(report()) == []


@pytest.mark.parametrize("overrides, message", [
    ({"nvidia-nccl-cu12": ("2.27.3", [])}, "NCCL wheels ['nvidia-nccl-cu12', 'nvidia-nccl-cu13']"),
    ({"torch": ("2.13.0", ['nvidia-nccl-cu13==2.30.7; platform_system == "Linux"'])},
     "torch 2.13.0 is not the torch sglang 0.5.23 requires"),
    ({"transformer_engine": ("2.12.0", []), "transformer_engine_cu13": ("2.12.0", [])},
     "outside megatron-core 0.16.1's tested range"),
    ({"transformer_engine_cu13": None, "transformer_engine_cu12": ("2.11.0", [])},
     "needs its core wheel transformer-engine-cu13"),
])
def test_each_inconsistency_is_named(overrides, message):
    found = problems(report(**overrides), pins={})
    assert any(message in p for p in found), found


def test_a_pin_that_resolved_to_something_else_and_a_missing_sdist_are_reported():
    found = problems(report(), pins={**PINS, "torch": "2.14.0"}, te_torch=("2.10.0",))
    assert "torch: pinned 2.14.0, resolved 2.14.1" in found
    assert "transformer-engine-torch 2.11.0 (the sdist the image builds) is not on the index" in found


def test_requirement_file_must_pin_every_line(tmp_path):
    path = tmp_path / "req.txt"
    path.write_text("torch==2.14.1  # why\n\n# comment\nnumpy>=2\n")
    with pytest.raises(ValueError, match="'numpy>=2' is not pinned with =="):
        check.read_pins(path)
    assert check.read_pins(REPO / "requirements-gpu.txt")["megatron-core"] == "0.16.1"


def test_lock_files_are_read_by_canonical_name(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# a header\nPyYAML==6.0.3\n    # via sglang\ntorch==2.14.1 ; sys_platform == 'linux'\n"
                    "uvicorn[standard]==0.40.0\n")
    assert check.read_lock(lock) == {"pyyaml": "6.0.3", "torch": "2.14.1", "uvicorn": "0.40.0"}


def test_a_pin_the_base_holds_is_refused_naming_the_base_version():
    base = {"packaging": "26.3", "torch": "2.14.1", "sglang": "0.5.23"}
    found = check.pins_the_base_decides({"packaging": "26.4", "torch": "2.14.1", "wandb": "0.31.0"}, base)
    assert len(found) == 2
    assert found[0].startswith("packaging==26.4 contradicts the base image (sglang==0.5.23 as of 2026-10-31), "
                               "which holds packaging==26.3: the image build fails (ResolutionImpossible)")
    assert found[1].startswith("torch==2.14.1 is already in the base image") and "remove the pin" in found[1]
    assert check.pins_the_base_decides({"wandb": "0.31.0"}, base) == []


def test_the_base_the_check_models_is_the_dockerfile_base():
    dockerfile = (REPO / "Dockerfile").read_text()
    version = check.BASE_REQUIREMENT.split("==")[1]
    assert f"ARG SGLANG_IMAGE=lmsysorg/sglang:v{version}\n" in dockerfile
    assert "-c /tmp/base-image.txt" in dockerfile  # the constraints the check applies too


def test_pyproject_gpu_extra_pins_what_the_image_pins():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = check.read_pins(REPO / "requirements-gpu.txt")
    base = check.Requirement(check.BASE_REQUIREMENT)
    pins[check.canonicalize_name(base.name)] = next(iter(base.specifier)).version
    for line in extra:
        req = check.Requirement(line)
        assert str(req.specifier) == f"=={pins[check.canonicalize_name(req.name)]}", line


def test_platform_tags_cover_the_glibc_range():
    tags = check.platforms()
    assert tags[0] == "manylinux2014_x86_64" and tags[-1] == "manylinux_2_35_x86_64" and len(tags) == 20


TOOL = ["{python}", "{repo}/tools/check_image_requirements.py"]
AHEAD = {
    "test_the_file_before_issue_29_fails_on_the_base_image": Command(
        [*TOOL, "--requirements", "{repo}/tests/data/requirements-gpu-before-issue-29.txt"],
        waits=True),
    "test_image_requirements_resolve_on_the_base_for_python_312_and_form_one_stack": Command(
        [*TOOL, "--base-lock", "{dir}/base.txt"], waits=True),
}
"""The tool's run of each slow test (``tests/ahead.py``): each waits mostly on the package index
(~10 s of uv, then ~40 s of pip's dry run, ~28 CPU-seconds in all), so both start when the
session does and run beside the others."""


@pytest.mark.slow
def test_the_file_before_issue_29_fails_on_the_base_image(ahead):
    """What the image build met at its first RUN: four pins newer than the base's versions."""
    assert ahead.returncode == 1, ahead.stdout + ahead.stderr
    for pin, held in (("packaging==26.4", "packaging==26.3"), ("pydantic==2.14.4", "pydantic==2.14.2"),
                      ("pyyaml==6.0.4", "pyyaml==6.0.3"), ("pyarrow==26.0.1", "pyarrow==26.0.0")):
        assert f"{pin} contradicts the base image (sglang==0.5.23 as of 2026-10-31), which holds {held}" \
            in ahead.stderr, ahead.stderr
    assert "torch==2.14.1 is already in the base image" in ahead.stderr


@pytest.mark.slow
def test_image_requirements_resolve_on_the_base_for_python_312_and_form_one_stack(ahead):
    assert ahead.returncode == 0, ahead.stdout + ahead.stderr
    assert "torch                    2.14.1" in ahead.stdout and "nvidia-nccl-cu13         2.30.7" in ahead.stdout
    base = check.read_lock(ahead.dir / "base.txt")
    assert (base["sglang"], base["torch"], base["packaging"], base["pydantic"], base["pyyaml"],
            base["pyarrow"], base["numpy"]) == ("0.5.23", "2.14.1", "26.3", "2.14.2", "6.0.3", "26.0.0", "2.3.5")
