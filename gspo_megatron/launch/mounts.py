"""Container mounts from the paths a resolved config reads and writes.

A pyxis container sees only what is mounted into it. Every path the run touches comes from the
config (model, data, initial checkpoint, checkpoints, run directory, disk weight-sync folder,
the servers' key file), so the mounts are derived from it rather than listed by hand: each is
mounted at the same path inside the container, a path already under another mount is dropped,
and the user's own mounts (``GSPO_CONTAINER_MOUNTS``, pyxis syntax ``SRC[:DST[:FLAGS]]``) are added after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Iterable, List, Optional, Sequence, Tuple

# (config key, mount the parent directory rather than the path itself: a file).
CONFIG_PATHS: Tuple[Tuple[str, bool], ...] = (
    ("logging.run_dir", False),
    ("model.hf_path", False),
    ("data.train_path", True),
    ("data.eval_path", True),
    ("checkpoint.load_dir", False),
    ("checkpoint.dir", False),
    ("rollout.weight_sync.disk_dir", False),
    ("rollout.sglang.key_file", True),
)


@dataclass(frozen=True)
class Mount:
    """One ``--container-mounts`` entry and why it is there."""

    source: str
    target: str
    origin: str
    """The config key it comes from, ``repository``, or ``GSPO_CONTAINER_MOUNTS``."""
    flags: str = ""

    def spec(self) -> str:
        return ":".join([self.source, self.target] + ([self.flags] if self.flags else []))


def absolute_path(path: str, base: str) -> str:
    """``path`` as the job sees it: relative paths are relative to ``base`` (the repository,
    every step's working directory)."""
    p = PurePosixPath(path)
    return str(p if p.is_absolute() else PurePosixPath(base) / p)


def _get(cfg, dotted: str) -> Optional[str]:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return None if node in (None, "") else str(node)


def _normalise(path: str) -> str:
    parts: List[str] = []
    for part in PurePosixPath(path).parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def parse_user_mounts(text: str) -> List[Mount]:
    """``GSPO_CONTAINER_MOUNTS`` (comma-separated ``SRC[:DST[:FLAGS]]``) as mounts."""
    mounts = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) > 3 or not fields[0].startswith("/"):
            raise ValueError(f"GSPO_CONTAINER_MOUNTS entry '{item}': expected /SRC[:/DST[:FLAGS]]")
        target = fields[1] if len(fields) > 1 and fields[1] else fields[0]
        mounts.append(Mount(fields[0], target, "GSPO_CONTAINER_MOUNTS", fields[2] if len(fields) > 2 else ""))
    return mounts


def container_mounts(cfg, repo: str, user: Iterable[Mount] = ()) -> List[Mount]:
    """The repository and every config path (absolute, relative ones under ``repo``), nested
    ones dropped, then the user's mounts (a user mount of the same source replaces ours)."""
    user = list(user)
    wanted: List[Mount] = [Mount(_normalise(repo), _normalise(repo), "repository")]
    for key, is_file in CONFIG_PATHS:
        value = _get(cfg, key)
        if value is None:
            continue
        path = _normalise(absolute_path(value, repo))
        if is_file:
            path = str(PurePosixPath(path).parent)
        wanted.append(Mount(path, path, key))
    user_sources = {m.source for m in user}
    kept: List[Mount] = []
    for mount in sorted(wanted, key=lambda m: len(m.source)):
        if mount.source in user_sources:
            continue
        if not any(_inside(mount.source, k.source) and k.source == k.target for k in kept):
            kept.append(mount)
    order = {id(m): i for i, m in enumerate(wanted)}
    return sorted(kept, key=lambda m: order[id(m)]) + user


def mounts_spec(mounts: Sequence[Mount]) -> str:
    """The ``--container-mounts`` value."""
    return ",".join(m.spec() for m in mounts)
