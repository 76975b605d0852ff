"""rollout/sglang/fleet_pause.py and its use by the fleet control: the Slurm job's hang check
must see exactly the time a sync or a memory release of ours holds the servers paused."""

import os

from gspo_megatron.rollout.sglang.fleet_pause import PAUSE_FILE_ENV, mark_fleet_paused


def test_the_pause_file_exists_exactly_while_paused_and_only_in_a_job(tmp_path, monkeypatch):
    path = tmp_path / "fleet_paused.r0"
    monkeypatch.delenv(PAUSE_FILE_ENV, raising=False)
    mark_fleet_paused(True)  # outside a Slurm job: nothing
    assert not path.exists()
    monkeypatch.setenv(PAUSE_FILE_ENV, str(path))
    mark_fleet_paused(True)
    assert path.read_text() == f"{os.getpid()}\n"
    mark_fleet_paused(False)
    assert not path.exists()
    mark_fleet_paused(False)  # idempotent


def test_an_unwritable_pause_file_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(PAUSE_FILE_ENV, str(tmp_path / "missing-dir" / "fleet_paused"))
    mark_fleet_paused(True)
    assert "cannot write it" in caplog.text


def test_a_weight_sync_holds_the_pause_file_from_pause_to_continue(tmp_path, monkeypatch):
    """The control's pause (phase 1) creates it; generation continuing (phase 8) removes it."""
    from gspo_megatron.rollout.sglang.control import FleetControl
    from gspo_megatron.rollout.sglang.server_pool import ServerPool

    path = tmp_path / "fleet_paused.r0"
    monkeypatch.setenv(PAUSE_FILE_ENV, str(path))
    seen = []

    class Client:
        address = "a:1"

        def __getattr__(self, name):
            def call(*args, **kwargs):
                seen.append((name, path.exists()))
                return {}
            return call

    control = FleetControl(ServerPool([Client()]))
    control.begin(session=True)
    assert path.exists() and ("pause_generation", True) in seen
    control.finish("3")
    assert not path.exists() and seen[-1] == ("continue_generation", True)
