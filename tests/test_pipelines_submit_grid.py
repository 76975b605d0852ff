"""pipelines/submit_grid.py: axis parsing, grid expansion, the array option, the point files the
job array reads, and the grid.json record (sbatch faked; tests/test_slurm_infra.py runs it)."""

from __future__ import annotations

import json
import subprocess

import pytest

from pipelines import submit_grid as sg


def test_axes_expand_to_the_cartesian_product_first_axis_slowest():
    axes = [sg.parse_axis("optimizer.lr=1e-6,2e-6"), sg.parse_axis("batch.num_prompts_per_step=128,256,512")]
    points = sg.expand_grid(axes, ["trainer.num_steps=50"])
    assert len(points) == 6
    assert points[0] == ["trainer.num_steps=50", "optimizer.lr=1e-6", "batch.num_prompts_per_step=128"]
    assert points[3] == ["trainer.num_steps=50", "optimizer.lr=2e-6", "batch.num_prompts_per_step=128"]
    assert len({tuple(p) for p in points}) == 6


@pytest.mark.parametrize("text, message", [
    ("optimizer.lr", "expected KEY=V1,V2"),
    ("1bad.key=1,2", "expected KEY=V1,V2"),
    ("optimizer.lr=1e-6,,2e-6", "empty value"),
    ("optimizer.lr=1e-6,1e-6", "repeated value"),
])
def test_bad_axes_are_rejected_naming_the_axis(text, message):
    with pytest.raises(ValueError, match=message) as exc:
        sg.parse_axis(text)
    assert repr(text) in str(exc.value)


def test_repeated_axis_key_is_rejected():
    with pytest.raises(ValueError, match="appears twice"):
        sg.expand_grid([("a.b", ["1"]), ("a.b", ["2"])])


def test_array_option_with_and_without_throttle():
    assert sg.array_option(6, None) == "--array=0-5"
    assert sg.array_option(6, 2) == "--array=0-5%2"


def test_submit_writes_points_and_records_the_job(tmp_path):
    calls = []

    def fake(cmd, **kwargs):
        calls.append((list(cmd), kwargs["env"]))
        return subprocess.CompletedProcess(cmd, 0, "555\n", "")

    spec = sg.GridSpec(grid_dir=tmp_path / "grid", script="slurm/gspo_30b.sh",
                       axes=[sg.parse_axis("algo.loss=gspo,grpo")], common_overrides=["trainer.num_steps=5"],
                       max_parallel=1, sbatch_args=["--nodes=4"])
    sub, points = sg.submit_grid(spec, runner=fake)
    cmd, env = calls[0]
    grid_dir = str((tmp_path / "grid").resolve())
    assert cmd == ["sbatch", "--parsable", "--array=0-1%1", f"--output={grid_dir}/logs/%x-%A_%a.out",
                   "--nodes=4", "slurm/gspo_30b.sh"]
    assert env["GSPO_GRID_DIR"] == grid_dir and sub.job_id == "555"
    assert (tmp_path / "grid/points/1.overrides").read_text() == "trainer.num_steps=5\nalgo.loss=grpo\n"
    record = json.loads((tmp_path / "grid/grid.json").read_text())
    assert record["job"]["job_id"] == "555" and record["axes"] == {"algo.loss": ["gspo", "grpo"]}
    assert record["points"][1] == {"index": 1, "overrides": points[1], "run_dir": f"{grid_dir}/point_1"}


def test_cli_rejects_a_missing_script(capsys):
    with pytest.raises(SystemExit) as exc:
        sg.parse_args(["--grid-dir", "g", "--script", "slurm/nope.sh", "--axis", "a.b=1,2"])
    assert exc.value.code == 2 and "file not found: slurm/nope.sh" in capsys.readouterr().err
