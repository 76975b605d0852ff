"""tools/check_image_requirements.py: the GPU image's pins resolve for CPython 3.12 / manylinux and
form one stack. The consistency rules run on small hand-made reports (each must catch its fault);
the slow test resolves the real requirements-gpu.txt against the package index.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert check.read_pins(REPO / "requirements-gpu.txt")["sglang"] == "0.5.23"


def test_pyproject_gpu_extra_pins_what_the_image_pins():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = check.read_pins(REPO / "requirements-gpu.txt")
    for line in extra:
        req = check.Requirement(line)
        assert str(req.specifier) == f"=={pins[check.canonicalize_name(req.name)]}", line


def test_platform_tags_cover_the_glibc_range():
    tags = check.platforms()
    assert tags[0] == "manylinux2014_x86_64" and tags[-1] == "manylinux_2_35_x86_64" and len(tags) == 20


@pytest.mark.slow
def test_image_requirements_resolve_for_python_312_and_form_one_stack():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_image_requirements.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch                    2.14.1" in proc.stdout and "nvidia-nccl-cu13         2.30.7" in proc.stdout
