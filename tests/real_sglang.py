"""The real SGLang 0.5.23 server on CPU, for tests: start one, wait for it, end it and its files.

The server runs from its own virtualenv (``make sglang-venv``: sglang 0.5.23, the CUDA-only
``sglang-kernel`` removed, our CPU ``sgl_kernel`` from ``sglang_cpu/``), with the command line
our launcher builds for ``rollout.sglang.device=cpu`` (``rollout/sglang/launcher.py``). No skip:
a server that does not start fails the test with the tail of its log.

SGLang's launcher forks a scheduler and a detokenizer; the server starts in a session of its own
so that teardown can end the whole group it started (by its PID) and nothing else. A start costs
~30 s of CPU (three interpreters import SGLang), ~21 s on an idle 2-core machine: a test that
needs another server soon can :meth:`RealServer.launch` it ahead and :meth:`~RealServer.wait_ready`
when it needs it (``SpareServers`` does that for a module's tests). Each launch
also leaves a ``/dev/shm/sglang_loads_*.shm`` file; the server's own, the ones its processes map
or hold open, are removed with it (never another server's that started meanwhile: a suite or a
tool running beside this one on the same machine keeps its files).

:func:`left_state` reads what a trainer may leave on a server (paused, a weight-update session,
broadcast groups) without changing it.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Set

import requests

from gspo_megatron.config.schema import SGLangConfig
from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.rollout.sglang.engine import BIND_FAILURE
from gspo_megatron.rollout.sglang.launcher import sglang_server_command, sglang_server_env

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = os.environ.get("GSPO_SGLANG_PYTHON", str(REPO / ".venv-sglang" / "bin" / "python"))
START_TIMEOUT_S = 240.0
POLL_S = 0.25
"""Between health probes of a starting server (a probe of a server still loading fails at once)."""
SHM_PATTERN = "/dev/shm/sglang_loads_*"
NO_CRASH_DIAGNOSTICS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
                        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
"""A server whose scheduler dies (our SIGTERM to its process group, a start it refuses, a request
that kills it) otherwise sleeps 5 s "to let GPU activity settle" before py-spy / CUDA coredump
diagnostics (``tokenizer_manager``), on every stop of every test; how it dies is the same."""


def listening_pids(port: int) -> List[int]:
    """PIDs of the processes listening on TCP ``port`` of this machine, however they were
    started (``-m sglang.launch_server``, the keyed launcher run by path, the stand-in): a
    server that was not stopped still holds its port. Issue 41: a check by command-line name
    (``sglang.launch_server``) stopped finding servers once they started through the keyed
    launcher, and so could never fail."""
    import psutil

    return sorted({c.pid for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   and c.pid is not None})


def cpu_server_config(port: int, **overrides) -> SGLangConfig:
    """The fleet config of one real CPU server on ``port`` (what a user would write)."""
    return SGLangConfig(port=port, device="cpu", python=SGLANG_PYTHON, max_total_tokens=4096,
                        **overrides)


class RealServer:
    """One real SGLang server process group on ``127.0.0.1``."""

    def __init__(self, model_path: str, log_path: Path, port: Optional[int] = None,
                 extra_args: Optional[List[str]] = None, key_file: Optional[str] = None,
                 drop_args: Sequence[str] = (), **config) -> None:
        """``config``: ``SGLangConfig`` fields over the defaults (``dtype="auto"``);
        ``drop_args``: flags left out of the launcher's command line (``--sleep-on-idle``)."""
        if not os.path.exists(SGLANG_PYTHON):
            raise AssertionError(f"{SGLANG_PYTHON} is missing: run `make sglang-venv` (the README's "
                                 "test command does)")
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cfg = cpu_server_config(self.port, **config)
        self.command = [a for a in sglang_server_command(cfg, model_path, 0, python=SGLANG_PYTHON,
                                                         key_file=key_file)
                        if a not in drop_args] + list(extra_args or [])
        self.env = dict(os.environ, **sglang_server_env(cfg), OMP_NUM_THREADS="1",
                        **NO_CRASH_DIAGNOSTICS)
        self._own_shm: Set[str] = set()
        self.process: Optional[subprocess.Popen] = None
        self._launched_at = 0.0
        self._log_start = 0  # where this launch's lines begin in the log (appended to)

    def start(self) -> "RealServer":
        """Launch the server and wait until it answers ``/health_generate``."""
        return self.launch().wait_ready()

    def launch(self) -> "RealServer":
        """Start the server's processes and return at once; :meth:`wait_ready` waits for it."""
        with open(self.log_path, "ab") as out:
            self._log_start = out.tell()
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True, cwd=str(REPO))
        self._launched_at = time.monotonic()
        return self

    def wait_ready(self) -> "RealServer":
        """Wait until the launched server answers ``/health_generate`` (``START_TIMEOUT_S`` from
        its launch); a server that exits, cannot listen on its port or never answers fails with
        its log's tail. SGLang 0.5.23 lives on after its HTTP port turned out taken (the engine's
        ``BIND_FAILURE``): that one is stopped at once rather than at the deadline."""
        deadline = self._launched_at + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"real SGLang server exited with {self.process.returncode} "
                                     f"during start-up:\n{self.log_tail()}")
            if self._failed_to_bind():
                self.stop(grace_s=0)
                raise AssertionError(f"real SGLang server could not listen on {self.address} "
                                     f"(another process holds it):\n{self.log_tail()}")
            if _healthy(self, timeout_s=20):
                self.new_shm_files()  # known now, so that a kill need not look for them first
                return self
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        self.stop()
        raise AssertionError(f"real SGLang server not healthy after {START_TIMEOUT_S}s:\n"
                             f"{self.log_tail()}")

    def _failed_to_bind(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return BIND_FAILURE.encode() in f.read()
        except OSError:
            return False

    def new_shm_files(self) -> List[str]:
        """This server's ``/dev/shm/sglang_loads_*`` files: the ones its processes map or hold
        open (remembered, so they are still known once the server has stopped)."""
        if self.alive():
            self._own_shm |= _files_of_tree(self.process.pid, SHM_PATTERN)
        return sorted(self._own_shm)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self, grace_s: float = 20.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL) and its shared-memory files.
        ``grace_s=0`` is a kill, signalled at once: its files are the ones found when it became
        ready (looking for them again reads every process's maps, ~1 s in which a batch that a
        test means to cut can finish)."""
        own_files = self.new_shm_files() if grace_s > 0 else sorted(self._own_shm)
        if self.process is not None:
            pgid = self.process.pid  # start_new_session: the group is the server's own
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
                if not _group_alive(pgid):
                    break
                time.sleep(0.5)
            self.process = None
        for path in own_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class SpareServers:
    """Second servers for a module's tests that wedge or kill one, each started ahead of its test.

    ``num_wanted`` is how many tests will :meth:`take` one. :meth:`launch_ahead` begins the next
    start while other tests run (the module's own server answering them leaves a core idle for
    most of a start's ~30 CPU-seconds); a test that leaves its server alive and healthy
    :meth:`give_back` s it for the next one, so a wedge and a kill share one start. At most one
    spare is held or starting at a time (each holds ~3.6 GB once up). Every server started
    here is stopped here, by :meth:`RealServer.stop`.
    """

    def __init__(self, model_path: str, log_dir: Path, num_wanted: int) -> None:
        self.model_path, self.log_dir, self.num_wanted = model_path, log_dir, num_wanted
        self._next: Optional[RealServer] = None
        self._count = 0

    def launch_ahead(self) -> None:
        """Begin starting a spare if a later test wants one and none is held or starting."""
        if self.num_wanted > 0 and self._next is None:
            self._next = self._new()

    def _new(self) -> RealServer:
        self._count += 1
        return RealServer(self.model_path, self.log_dir / f"spare{self._count}.log").launch()

    def take(self) -> RealServer:
        """A healthy server of the test's own: the spare launched ahead, else one started now."""
        if self._next is None:  # none launched ahead (a test run alone, or one taker too many)
            self._next = self._new()
        server, self._next = self._next, None
        self.num_wanted = max(0, self.num_wanted - 1)
        try:
            return server.wait_ready()
        except BaseException:
            server.stop()
            raise

    def give_back(self, server: RealServer) -> None:
        """After its test: kept for the next taker when it still answers, else stopped; then the
        next spare starts ahead if one is wanted."""
        if self.num_wanted > 0 and self._next is None and server.alive() and _healthy(server):
            self._next = server
        else:
            server.stop()
        self.launch_ahead()

    def stop(self) -> None:
        if self._next is not None:
            self._next.stop()
            self._next = None


def no_later_test_uses(items: list, item, fixture: str) -> bool:
    """Whether no test of ``item``'s module after it in this run (``session.items``) uses
    ``fixture``: then ``item`` may end the server that fixture holds."""
    return not any(later.module is item.module and fixture in later.fixturenames
                   for later in items[items.index(item) + 1:])


@dataclass
class LeftState:
    """What a trainer may leave on a real server, read without changing it (:func:`left_state`)."""

    paused: bool
    """``/ready`` answers 503: generation is paused (``tokenizer_manager.is_ready``)."""
    session: bool
    """A weight-update session is open (``/begin_weight_update`` refused: "already open")."""
    groups: List[str]
    """The names of the weight-update groups the server holds."""


NO_SUCH_GROUP = "left-state-probe"


def left_state(address: str) -> LeftState:
    """Whether the server is paused, inside a weight-update session, and which broadcast groups
    it holds. SGLang 0.5.23 lists its groups nowhere: they live in a dict by name
    (``srt/model_executor/model_runner_components/weight_updater.py``, ``_model_update_group``),
    and ``receive_weights_from_distributed`` asserts the group is in it with a message that names
    every key ("Group X not in [...]"), which ``srt/managers/scheduler_components/
    weight_updater.py`` returns as the refusal of ``/update_weights_from_distributed`` (inside a
    session; outside one it refuses earlier). So: a session is opened (unless one is, which is
    the answer to the second question), a bucket for a group that does not exist is sent (refused
    before anything is received or loaded), and the session is closed again if opened here."""
    client = SGLangServerClient(address, 30.0, 30.0, keys=None)
    paused = not client.ready()
    try:
        client.begin_weight_update()
        session = False
    except api.ServerRefused as exc:
        assert "already open" in exc.message, exc
        session = True
    try:
        client.update_weights_from_distributed(api.update_distributed_payload(
            ["probe"], ["float32"], [[1]], NO_SUCH_GROUP))
        raise AssertionError(f"{address} took a bucket for the group {NO_SUCH_GROUP!r}")
    except api.ServerRefused as exc:
        listed = re.search(rf"Group {NO_SUCH_GROUP} not in (\[.*?\])", exc.message)
        assert listed, exc
        groups = ast.literal_eval(listed.group(1))
    finally:
        if not session:
            client.end_weight_update()
    return LeftState(paused, session, groups)


def _healthy(server: RealServer, timeout_s: float = 30.0) -> bool:
    """Whether the server generates (``/health_generate`` answers 200)."""
    try:
        return requests.get(f"http://{server.address}/health_generate",
                            timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def _files_of_tree(pid: int, pattern: str) -> Set[str]:
    """Files matching ``pattern`` that ``pid`` or a descendant maps or holds open."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found: Set[str] = set()
    for proc in procs:
        try:
            paths = [m.path for m in proc.memory_maps()] + [f.path for f in proc.open_files()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found |= {p for p in paths if fnmatch.fnmatch(p, pattern)}
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
