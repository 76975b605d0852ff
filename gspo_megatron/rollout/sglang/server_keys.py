"""Per-job keys of the rollout servers: made with a CSPRNG, kept in a 0600 file, sent as bearer
tokens.

On a shared cluster every job and user on the network can reach a server's port. SGLang 0.5.23
has two keys (``srt/utils/auth.py``): ``--api-key`` guards its ordinary endpoints (``/generate``,
``/model_info``, ``/server_info``), ``--admin-api-key`` the ones marked ``ADMIN_OPTIONAL`` in
``srt/entrypoints/http_server.py`` (weights, sessions, groups, pause / continue / abort, flush,
memory). ``/health*``, ``/ready*`` and ``/metrics`` stay open for probes.

The keys never travel on a command line (``ps``, the launch plan, a Slurm dry run, a log): they
live in one JSON file, mode 0600, by default in the run directory
(``rollout.sglang.key_file``); servers read it at start (``rollout/sglang/keyed_launch.py`` for
SGLang, ``--key-file`` for the reference server) and every client of this process sends them
(:func:`use_keys`, read by ``SGLangServerClient``): a process-wide default, because clients are
made deep inside the weight transports of every pipeline stage, which all belong to one job.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

KEY_FILE_NAME = "rollout_server_keys.json"
"""Default file name, under ``<run_dir>/secrets/``."""

ADMIN_PATHS = frozenset({
    "/flush_cache", "/update_weights_from_disk", "/init_weights_update_group",
    "/destroy_weights_update_group", "/update_weights_from_tensor", "/begin_weight_update",
    "/end_weight_update", "/update_weights_from_distributed", "/get_weights_by_name",
    "/release_memory_occupation", "/resume_memory_occupation", "/abort_request",
    "/pause_generation", "/continue_generation",
})
"""The endpoints we call that sglang 0.5.23 marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)``
(``srt/entrypoints/http_server.py``): with an admin key configured they take only that key.
``tests/test_rollout_sglang_server_keys.py`` re-reads the installed server's source."""

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Always answered without a key (``decide_request_auth``)."""


class KeyFileError(RuntimeError):
    """The key file is unreadable, malformed, or readable by others."""


@dataclass(frozen=True)
class ServerKeys:
    """The two bearer tokens of one job's rollout servers."""

    api_key: str
    admin_api_key: str

    def __repr__(self) -> str:  # never print a key by accident
        return "ServerKeys(api_key=<redacted>, admin_api_key=<redacted>)"

    __str__ = __repr__

    def for_path(self, path: str) -> Optional[str]:
        """The token SGLang wants on ``path`` (None for the always-open probes)."""
        path = path.split("?", 1)[0]
        if path.startswith(OPEN_PREFIXES):
            return None
        return self.admin_api_key if path in ADMIN_PATHS else self.api_key


def new_keys() -> ServerKeys:
    """Two fresh 256-bit tokens from the OS's CSPRNG (``secrets``)."""
    return ServerKeys(secrets.token_urlsafe(32), secrets.token_urlsafe(32))


def _write_temp(path: str, keys: ServerKeys) -> str:
    """The keys in a new 0600 file next to ``path``, flushed to disk; returns its name."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"api_key": keys.api_key, "admin_api_key": keys.admin_api_key}, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(temp)
        raise
    return temp


def write_keys(path: str, keys: ServerKeys) -> None:
    """Create ``path`` with mode 0600, whole or not at all, never over an existing file.

    The keys go to a temporary file first, which is then hard-linked to ``path`` (``link``
    fails if ``path`` exists, as ``O_EXCL`` did): a crash leaves at most a stray temporary file,
    never an empty or half-written key file that later launches could not read."""
    temp = _write_temp(path, keys)
    try:
        os.link(temp, path)
    finally:
        os.unlink(temp)


def _replace_unreadable(path: str) -> None:
    """Replace a key file that holds no keys (empty or cut short: a crash of a writer older than
    :func:`write_keys`) with new ones. No server can have started with keys nobody could read,
    so nothing is lost; one process at a time repairs (``flock``), and each re-checks first."""
    import fcntl

    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            read_keys(path)
            return  # repaired by another process meanwhile
        except KeyFileError as exc:
            if not isinstance(exc.__cause__, ValueError):
                raise
        log.warning("rollout server key file %s holds no keys (left by a crash); making new ones",
                    path)
        os.replace(_write_temp(path, new_keys()), path)


def read_keys(path: str) -> ServerKeys:
    """The keys in ``path``; refuses a file that others can read, naming it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise KeyFileError(f"rollout server key file {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"rollout server key file {path} has mode {stat.filemode(mode)}: others "
                           f"could read the keys; run `chmod 600 {path}`")
    try:
        with open(path) as f:
            data = json.load(f)
        keys = ServerKeys(str(data["api_key"]), str(data["admin_api_key"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"rollout server key file {path} is not "
                           '{"api_key": ..., "admin_api_key": ...}: ' f"{type(exc).__name__}") from exc
    if not keys.api_key or not keys.admin_api_key:
        raise KeyFileError(f"rollout server key file {path} holds an empty key")
    return keys


def ensure_keys(path: str) -> ServerKeys:
    """The job's keys: read ``path``, or make them there when it does not exist (first launch;
    a resumed or requeued job keeps its keys, so servers it left behind still accept it)."""
    if not os.path.exists(path):
        try:
            write_keys(path, new_keys())
            log.info("made rollout server keys in %s (mode 0600)", path)
        except FileExistsError:  # another rank or job step made them first
            pass
    try:
        return read_keys(path)
    except KeyFileError as exc:
        if not isinstance(exc.__cause__, ValueError):  # unreadable by mode or OS: the user's
            raise
    _replace_unreadable(path)
    return read_keys(path)


def key_file_path(key_file: Optional[str], run_dir: str) -> str:
    """``rollout.sglang.key_file``, or ``<run_dir>/secrets/rollout_server_keys.json``."""
    return key_file or os.path.join(run_dir, "secrets", KEY_FILE_NAME)


_process_keys: Optional[ServerKeys] = None


def use_keys(keys: Optional[ServerKeys]) -> None:
    """Make ``keys`` the default of every ``SGLangServerClient`` made in this process."""
    global _process_keys
    _process_keys = keys


def process_keys() -> Optional[ServerKeys]:
    return _process_keys
