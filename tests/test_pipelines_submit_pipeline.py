"""pipelines/submit_pipeline.py and pipelines/sbatch.py: the sbatch command lines, the afterok
chain, cancellation when a later submission fails, and the JSON record (sbatch is faked here;
tests/test_slurm_infra.py submits for real)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gspo_megatron.grid import sbatch as sb
from pipelines import submit_pipeline as sp


class FakeSlurm:
    """Records every command; sbatch answers ids 100, 101, ...; ``fail_on`` makes that call fail."""

    def __init__(self, fail_on: int = -1):
        self.calls, self.envs, self.fail_on, self.next_id = [], [], fail_on, 100

    def __call__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        self.envs.append(kwargs.get("env", {}))
        if cmd[0] == "sbatch":
            if len([c for c in self.calls if c[0] == "sbatch"]) - 1 == self.fail_on:
                return subprocess.CompletedProcess(cmd, 1, "", "sbatch: error: Invalid partition name specified")
            self.next_id += 1
            return subprocess.CompletedProcess(cmd, 0, f"{self.next_id - 1};cluster\n", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def spec(tmp_path: Path, **kw) -> sp.PipelineSpec:
    return sp.PipelineSpec(config="configs/tiny_cpu.yaml", hf_dir=str(tmp_path / "hf"), run_dir=tmp_path / "run",
                           profile="cpu", overrides=["trainer.num_steps=3"], **kw)


def test_stages_are_chained_with_afterok_and_recorded(tmp_path):
    fake = FakeSlurm()
    subs = sp.submit_pipeline(spec(tmp_path, sbatch_args=["--partition=cpu"], train_sbatch_args=["--nodes=2"]),
                              runner=fake)
    assert [s.job_id for s in subs] == ["100", "101", "102"]
    convert, train, export = fake.calls
    run_dir = str((tmp_path / "run").resolve())
    assert convert == ["sbatch", "--parsable", "--job-name=gspo-convert", f"--output={run_dir}/logs/%x-%j.out",
                       "--partition=cpu", "slurm/convert.sh", "trainer.num_steps=3"]
    assert train[:2] == ["sbatch", "--dependency=afterok:100"]
    assert train[-3:] == ["--nodes=2", "slurm/tiny_cpu.sh", "trainer.num_steps=3"]
    assert export[1] == "--dependency=afterok:101" and export[-1] == "slurm/export.sh"
    env = fake.envs[1]
    assert env["GSPO_RUN_DIR"] == run_dir and env["GSPO_LOAD_DIR"] == f"{run_dir}/converted"
    assert env["GSPO_EXPORT_CHECKPOINT"] == f"{run_dir}/checkpoints"
    record = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert [(j["name"], j["job_id"]) for j in record["jobs"]] == [("convert", "100"), ("train", "101"),
                                                                   ("export", "102")]
    assert record["overrides"] == ["trainer.num_steps=3"] and record["jobs"][1]["command"] == train


def test_a_failed_submission_cancels_the_jobs_already_submitted(tmp_path):
    fake = FakeSlurm(fail_on=2)
    with pytest.raises(sb.SubmitError, match="sbatch for 'export' failed.*Invalid partition"):
        sp.submit_pipeline(spec(tmp_path), runner=fake)
    assert fake.calls[-1] == ["scancel", "100", "101"]
    record = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert [j["job_id"] for j in record["jobs"]] == ["100", "101", None]


def test_train_only_pipeline_starts_from_the_config_weights(tmp_path):
    fake = FakeSlurm()
    subs = sp.submit_pipeline(spec(tmp_path, stages=["train"]), runner=fake)
    assert len(fake.calls) == 1 and "--dependency" not in " ".join(fake.calls[0])
    assert [s.name for s in subs] == ["train"] and "GSPO_LOAD_DIR" not in subs[0].env


def test_gpu_profile_uses_the_production_script(tmp_path):
    subs = sp.build_submissions(sp.PipelineSpec(config="c.yaml", hf_dir="/m", run_dir=tmp_path))
    assert "slurm/gspo_30b.sh" in subs[1].command


def test_parse_job_id_accepts_cluster_suffix_and_rejects_noise():
    assert sb.parse_job_id("4242;gpu-cluster\n") == "4242"
    with pytest.raises(sb.SubmitError, match="could not read a job id"):
        sb.parse_job_id("Submitted batch job\n")


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/nope.yaml", "--hf-dir", "h", "--run-dir", "r"], "file not found: configs/nope.yaml"),
    (["--config", "configs/tiny_cpu.yaml", "--hf-dir", "h", "--run-dir", "r", "--stages", "convert,eval"],
     "unknown stage(s) ['eval']"),
])
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(sb.REPO_ROOT)
    with pytest.raises(SystemExit) as exc:
        sp.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_main_returns_1_when_sbatch_fails(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(sb.REPO_ROOT)

    def refuse(spec, runner=None):
        raise sb.SubmitError("sbatch for 'convert' failed (exit 1): sbatch: error: Batch job submission failed")

    monkeypatch.setattr(sp, "submit_pipeline", refuse)
    argv = ["--config", "configs/tiny_cpu.yaml", "--hf-dir", "h", "--run-dir", str(tmp_path / "r")]
    assert sp.main(argv) == 1
    assert "Batch job submission failed" in caplog.text


def test_config_path_is_made_absolute_for_the_jobs(tmp_path, monkeypatch):
    monkeypatch.chdir(sb.REPO_ROOT)
    parsed = sp.parse_args(["--config", "configs/tiny_cpu.yaml", "--hf-dir", "h", "--run-dir", "r", "--", "a.b=1"])
    assert parsed.config == str(sb.REPO_ROOT / "configs/tiny_cpu.yaml") and list(parsed.overrides) == ["a.b=1"]
