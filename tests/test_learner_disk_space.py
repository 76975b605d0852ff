"""Free-space checks before a large write, and one readable sentence for a failed write."""

from __future__ import annotations

import errno
from collections import namedtuple

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from gspo_megatron.learner import disk_space
from gspo_megatron.learner.disk_space import (OutputWriteError, check_free_space,
                                              describe_write_failure, existing_ancestor)

Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda _: Usage(10**12, 0, free))


def test_not_enough_space_names_the_path_and_both_numbers(tmp_path, monkeypatch):
    _free(monkeypatch, 5_000_000)
    target = tmp_path / "ckpt" / "step_000001"
    with pytest.raises(OutputWriteError) as info:
        check_free_space(target, 10_000_000, "checkpoint step_000001")
    text = str(info.value)
    assert str(target) in text and "10000000 bytes" in text and "5000000 bytes" in text
    assert f"free on {tmp_path}" in text  # the existing file system it would land on
    check_free_space(target, 3_000_000, "checkpoint step_000001")  # fits with the margin


def test_existing_ancestor(tmp_path):
    assert existing_ancestor(tmp_path / "a" / "b") == tmp_path


def _worker_failure():
    """What dist_checkpointing reports when a writer process hits a full disk."""
    try:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as inner:
        try:
            raise RuntimeError(f"Worker failure: {inner}") from inner
        except RuntimeError as outer:
            return outer


def test_enospc_anywhere_in_the_chain_says_no_space_left(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("Worker failure: [Errno 28]") from exc
    except RuntimeError as exc:
        err = exc
    assert describe_write_failure(err, tmp_path, "checkpoint step_000002") == (
        f"no space left on {tmp_path} while writing checkpoint step_000002 "
        "(No space left on device)")


def test_enospc_inside_a_dcp_failure_map(tmp_path):
    failure = CheckpointException("write", {1: (OSError(errno.ENOSPC, "No space left on device"),
                                                None)})
    assert describe_write_failure(failure, tmp_path, "x").startswith(f"no space left on {tmp_path}")


def test_unreadable_writer_error_on_a_full_disk_still_says_no_space(tmp_path, monkeypatch):
    _free(monkeypatch, 4096)
    text = describe_write_failure(_worker_failure(), tmp_path, "checkpoint step_000003")
    assert text.startswith(f"no space left on {tmp_path} while writing checkpoint step_000003")
    assert "unexpected pos 704 vs 598" in text  # the writer's own words are kept


def test_other_failures_give_the_real_cause(tmp_path, monkeypatch):
    _free(monkeypatch, 10**12)
    err = PermissionError(errno.EACCES, "Permission denied")
    assert describe_write_failure(err, tmp_path, "x") == (
        f"writing x to {tmp_path} failed: PermissionError: [Errno 13] Permission denied")
    assert "unexpected pos 704" in describe_write_failure(_worker_failure(), tmp_path, "x")


def test_native_writer_errors_mentioning_a_full_disk(tmp_path, monkeypatch):
    _free(monkeypatch, 10**12)
    err = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert describe_write_failure(err, tmp_path, "x").startswith(f"no space left on {tmp_path}")
