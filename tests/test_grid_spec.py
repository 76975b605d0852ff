"""grid/spec.py: axis parsing, grid expansion, every point loaded as a config before sbatch, the
array option, the point files the job array reads, and grid.json."""

from __future__ import annotations

import pytest

from gspo_megatron.grid import spec as gs
from tests.test_config import REPO

TINY = str(REPO / "configs" / "tiny_cpu.yaml")


def test_axes_expand_to_the_cartesian_product_first_axis_slowest():
    axes = [gs.parse_axis("optimizer.lr=1e-6,2e-6"), gs.parse_axis("batch.num_prompts_per_step=128,256,512")]
    points = gs.expand_grid(axes, ["trainer.num_steps=50"])
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
    with pytest.raises(gs.GridError, match=message) as exc:
        gs.parse_axis(text)
    assert repr(text) in str(exc.value)


def test_repeated_axis_key_is_rejected():
    with pytest.raises(gs.GridError, match="appears twice"):
        gs.expand_grid([("a.b", ["1"]), ("a.b", ["2"])])


@pytest.mark.parametrize("axis, message", [
    ("optimizer.lrr=1e-6,2e-6", r"grid point 0 \(optimizer.lrr=1e-6\) does not load with .*tiny_cpu.yaml: "
                                r".*unknown key 'optimizer.lrr'"),
    ("trainer.num_steps=2,2.5", r"grid point 1 \(trainer.num_steps=2.5\) .*bad value for 'trainer.num_steps'"),
])
def test_a_point_whose_config_does_not_load_is_refused_before_sbatch(axis, message):
    axes = [gs.parse_axis(axis)]
    with pytest.raises(gs.GridError, match=message):
        gs.check_points(TINY, gs.expand_grid(axes), axes)


def test_array_option_for_a_whole_grid_and_for_some_points():
    assert gs.array_option(range(6), None) == "--array=0-5"
    assert gs.array_option(range(6), 2) == "--array=0-5%2"
    assert gs.array_option([3, 1], None) == "--array=1,3"


def test_the_record_round_trips_and_knows_each_points_latest_task(tmp_path):
    record = gs.GridRecord(name="g", script="s.sh", config="c.yaml", axes={"a.b": ["1", "2"]},
                           points=[{"index": i, "overrides": ["x.y=0", f"a.b={v}"], "run_dir": f"/r/{i}"}
                                   for i, v in enumerate(("1", "2"))])
    record.add_job("100", [0, 1], ["sbatch"])
    record.add_job("200", [1], ["sbatch"])
    record.write(tmp_path)
    again = gs.GridRecord.read(tmp_path)
    assert again.latest_job(0) == "100_0" and again.latest_job(1) == "200_1"
    assert again.point_axes(1) == {"a.b": "2"}
    with pytest.raises(gs.GridError, match="is not a grid directory: it has no grid.json"):
        gs.GridRecord.read(tmp_path / "elsewhere")
    (tmp_path / "grid.json").write_text("[1, 2]")
    with pytest.raises(gs.GridError, match="grid.json: not a grid record"):
        gs.GridRecord.read(tmp_path)
