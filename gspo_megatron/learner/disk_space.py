"""Disk space before a large write, and one readable sentence when a write fails anyway.

Checkpoints and exports are written into ``<out>.partial`` and renamed into place. Before such a
write, :func:`check_free_space` compares its expected size with the free space of the target
file system and fails early, naming the path and both numbers. When a write fails part-way,
the error that reaches us is often unreadable: dist_checkpointing's writer processes report
``RuntimeError: Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704
vs 598`` (PyTorch's zip writer hitting a full disk) with no path and no errno.
:func:`describe_write_failure` looks for the real cause (``ENOSPC`` / ``EDQUOT`` anywhere in the
exception chain, including torch.distributed.checkpoint's per-rank failure map) and, failing
that, for a file system left without free space, and says "no space left on <path>".

    check_free_space(out_dir, expected_bytes, "checkpoint step_000100")
    try: write(...)
    except Exception as exc: raise OutputWriteError(describe_write_failure(exc, out_dir, "..."))
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Iterator

# Room kept on top of an estimate, which already counts the formats' headers and metadata
# (within a few percent of what is written): a small margin, so that an output which fits is not
# refused (the reliability table's disk rows fill a real file system).
MARGIN_FRACTION = 0.03
MARGIN_BYTES = 64 << 10
# After a failed write, less free space than this means the disk filled up.
NEARLY_FULL_BYTES = 1 << 20


class OutputWriteError(RuntimeError):
    """An output (checkpoint, export, config) could not be written; its partial output is gone."""


def human_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"


def existing_ancestor(path: str | Path) -> Path:
    """``path`` or its nearest existing parent (the file system a new output will land on)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    return shutil.disk_usage(existing_ancestor(path)).free


def needed_bytes(expected_bytes: int) -> int:
    """``expected_bytes`` plus the safety margin."""
    return int(expected_bytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def check_free_space(path: str | Path, expected_bytes: int, what: str) -> None:
    """Raise :class:`OutputWriteError` when ``what`` (about ``expected_bytes``) cannot fit."""
    need = needed_bytes(expected_bytes)
    free = free_bytes(path)
    if free < need:
        raise OutputWriteError(
            f"not enough space for {what} at {path}: it needs about {human_bytes(need)} "
            f"({expected_bytes} bytes + margin), {human_bytes(free)} ({free} bytes) are free on "
            f"{existing_ancestor(path)}")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and torch DCP's per-rank failures, without repeats."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        # torch.distributed.checkpoint.api.CheckpointException: {rank: (exception, traceback)}
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception: first failure of a DCP failure map, else the cause chain."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            exc = first[0] if isinstance(first, tuple) else first
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        elif exc.__context__ is not None:
            exc = exc.__context__
        else:
            break
    return exc


def describe_write_failure(exc: BaseException, path: str | Path, what: str) -> str:
    """One sentence naming ``path`` and the real reason ``what`` could not be written."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return f"no space left on {path} while writing {what} ({e.strerror})"
        if "No space left on device" in str(e):  # native writers (safetensors), DCP's failure map
            return f"no space left on {path} while writing {what} ({_line_with(e, 'No space')})"
        if isinstance(e, OSError) and e.errno == errno.EDQUOT:
            return f"disk quota exceeded on {path} while writing {what}"
    try:
        free = free_bytes(path)
    except OSError:
        free = None
    if free is not None and free < NEARLY_FULL_BYTES:
        return (f"no space left on {path} while writing {what} ({human_bytes(free)} free; "
                f"the writer reported: {_first_line(_root_cause(exc))})")
    cause = _root_cause(exc)
    return f"writing {what} to {path} failed: {type(cause).__name__}: {_first_line(cause)}"


def _line_with(exc: BaseException, words: str) -> str:
    """The first line of ``str(exc)`` holding ``words`` (a wrapper such as torch's
    ``CheckpointException`` names its ranks on the first line and the cause further down)."""
    return next((line.strip() for line in str(exc).splitlines() if words in line),
                _first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
