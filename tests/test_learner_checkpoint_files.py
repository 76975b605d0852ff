"""What makes a checkpoint complete: the manifest, damage detection, the newest complete step,
and tidying what an interrupted write left behind."""

from __future__ import annotations

import json
import logging

import pytest

from gspo_megatron.learner.checkpoint_files import (MANIFEST_FILE, CheckpointError, clean_leftovers,
                                                    newest_complete, require_complete, scan_steps,
                                                    step_dir, verify_checkpoint, write_manifest)

FILES = {"common.pt": 10, ".metadata": 20, "metadata.json": 5, "gspo_meta.json": 7,
         "__0_0.distcp": 300, "__0_1.distcp": 200}


def fake_checkpoint(directory, manifest: bool = True):
    """A directory with the files dist_checkpointing writes (sizes only matter here)."""
    directory.mkdir(parents=True)
    for name, size in FILES.items():
        (directory / name).write_bytes(b"x" * size)
    if manifest:
        write_manifest(directory)
    return directory


def test_manifest_lists_every_file_and_its_size(tmp_path):
    d = fake_checkpoint(tmp_path / "step_000001")
    body = json.loads((d / MANIFEST_FILE).read_text())
    assert body["files"] == FILES and body["total_bytes"] == sum(FILES.values())
    assert not list(d.glob("*.tmp"))  # written through a temporary file, renamed
    assert verify_checkpoint(d) == []


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / "__0_1.distcp").unlink(), "__0_1.distcp: missing"),
    (lambda d: (d / "common.pt").unlink(), "common.pt: missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b"x" * 7), "7 bytes, manifest.json says 300"),
    (lambda d: (d / MANIFEST_FILE).unlink(), "no manifest.json (the write did not finish)"),
    (lambda d: (d / MANIFEST_FILE).write_text("{"), "unreadable manifest"),
])
def test_damage_is_detected_and_named(tmp_path, damage, expected):
    d = fake_checkpoint(tmp_path / "step_000001")
    damage(d)
    problems = verify_checkpoint(d)
    assert problems and expected in problems[0]
    with pytest.raises(CheckpointError, match="damaged or incomplete checkpoint"):
        require_complete(d)


def test_a_directory_without_manifest_passes_only_when_asked_and_complete(tmp_path):
    d = fake_checkpoint(tmp_path / "converted", manifest=False)
    assert verify_checkpoint(d, require_manifest=False) == []
    (d / "metadata.json").unlink()
    assert verify_checkpoint(d, require_manifest=False) == [f"{d}: missing metadata.json"]


def test_newest_complete_skips_damaged_newer_steps_and_names_them(tmp_path, caplog):
    for step in (1, 2, 3):
        fake_checkpoint(step_dir(tmp_path, step))
    (step_dir(tmp_path, 3) / "__0_0.distcp").unlink()
    (tmp_path / "step_000004.partial").mkdir()  # not a step directory
    scan = scan_steps(tmp_path)
    assert [s for s, _ in scan.complete] == [1, 2] and [s for s, _, _ in scan.damaged] == [3]
    with caplog.at_level(logging.WARNING):
        assert newest_complete(tmp_path) == step_dir(tmp_path, 2)
    assert "skipping damaged checkpoint" in caplog.text and "step_000003" in caplog.text


def test_newest_complete_without_any_complete_step_is_a_clear_error(tmp_path):
    fake_checkpoint(step_dir(tmp_path, 5))
    (step_dir(tmp_path, 5) / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        newest_complete(tmp_path)
    with pytest.raises(CheckpointError, match="neither a gspo-megatron checkpoint"):
        newest_complete(tmp_path / "nowhere")


def test_leftovers_are_finished_or_removed(tmp_path):
    # A complete write whose final rename was interrupted: moved into place.
    fake_checkpoint(tmp_path / "step_000002.partial")
    # An unfinished write (no manifest): removed.
    fake_checkpoint(tmp_path / "step_000003.partial", manifest=False)
    # The previous version of a directory that was being replaced, the new one absent: restored.
    fake_checkpoint(tmp_path / "step_000001.old")
    # The previous version of a directory that was replaced successfully: removed.
    fake_checkpoint(tmp_path / "hf_export")
    (tmp_path / "hf_export.old").mkdir()
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_export", "step_000001",
                                                          "step_000002"]
    assert verify_checkpoint(tmp_path / "step_000002") == []
