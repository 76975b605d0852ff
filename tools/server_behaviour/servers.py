"""The two servers under comparison, as black boxes: an address, a log, a process to watch.

A real server is ``tests/real_sglang.py``'s :class:`RealServer` (its own virtualenv, the CPU
engine, a process group of its own); the stand-in runs as its own process too
(``python -m gspo_megatron.rollout.standin.server``, the command ``rollout.engine=reference``
launches), so that both answer the same HTTP requests over the same sockets and a broadcast
group can form with either (two group members in one process would share torch.distributed's
group-name registry). Every process started here is stopped here, by its PID.
"""

from __future__ import annotations

import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import psutil
import requests

from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.launcher import ServerLauncher
from gspo_megatron.rollout.standin.launcher import reference_server_command
from tests.real_sglang import RealServer

EXCEPTION_LINE = re.compile(r"^(\w+(?:Error|Exception)): (.+)$", re.M)


@dataclass
class Answer:
    """One HTTP answer: ``status`` None when none came (``error`` says why)."""

    status: Optional[int]
    body: Any = None
    error: str = ""

    @property
    def shape(self) -> str:
        """The body's top-level fields (``{a, b}``), ``[list]``, ``text`` or ``empty``."""
        if isinstance(self.body, dict):
            return "{" + ", ".join(sorted(self.body)) + "}"
        if isinstance(self.body, list):
            return "[list]"
        return "text" if self.body else "empty"

    @property
    def message(self) -> str:
        """SGLang's error message (FastAPI's ``detail`` too), or the text body."""
        if isinstance(self.body, dict) and isinstance(self.body.get("detail"), str):
            return self.body["detail"]
        return api.error_message(self.body).strip() if self.body else ""


@dataclass
class Target:
    """One server under comparison."""

    name: str
    address: str
    alive: Callable[[], bool]
    log_path: Path
    pid: Callable[[], Optional[int]]
    _log_mark: int = field(default=0, repr=False)

    def call(self, method: str, path: str, body: Any = None, raw: Optional[bytes] = None,
             timeout_s: float = 60.0) -> Answer:
        url = f"http://{self.address}{path}"
        try:
            if raw is not None:
                resp = requests.request(method, url, data=raw, timeout=timeout_s,
                                        headers={"Content-Type": "application/json"})
            else:
                resp = requests.request(method, url, json=body, timeout=timeout_s)
        except requests.Timeout:
            return Answer(None, error=f"no answer in {timeout_s:g} s")
        except requests.ConnectionError:
            return Answer(None, error="connection closed without an answer")
        try:
            return Answer(resp.status_code, resp.json())
        except ValueError:
            return Answer(resp.status_code, resp.text)

    def mark_log(self) -> None:
        """Later :meth:`log_exception` calls read only what the log gains after this."""
        self._log_mark = self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_exception(self) -> Optional[str]:
        """The last ``SomeError: message`` line the log gained since :meth:`mark_log`."""
        if not self.log_path.exists():
            return None
        with open(self.log_path, "rb") as f:
            f.seek(self._log_mark)
            found = EXCEPTION_LINE.findall(f.read().decode(errors="replace"))
        return f"{found[-1][0]}: {found[-1][1].strip()}" if found else None

    def wait_dead(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.alive()

    def cpu_seconds(self) -> float:
        """CPU time used so far by the process and its children."""
        total = 0.0
        root = psutil.Process(self.pid())
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total


def idle_cpu_shares(targets: List[Target], seconds: float = 3.0) -> Dict[str, float]:
    """CPU seconds per second of each idle target over the same ``seconds``, by name."""
    before = [t.cpu_seconds() for t in targets]
    time.sleep(seconds)
    return {t.name: (t.cpu_seconds() - b) / seconds for t, b in zip(targets, before)}


def real_target(server: RealServer) -> Target:
    return Target("real", server.address, server.alive, server.log_path,
                  lambda: server.process.pid if server.process else None)


@contextmanager
def real_server(model_dir: Path, log_path: Path, launched: Optional[RealServer] = None,
                **kwargs) -> Iterator[RealServer]:
    """A started real server (``RealServer`` arguments, or one ``launched`` ahead: its start
    overlapped other work), stopped on the way out."""
    server = launched or RealServer(str(model_dir), log_path, **kwargs).launch()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@contextmanager
def stand_in(model_dir: Path, log_dir: Path, extra: List[str] = ()) -> Iterator[Target]:
    """The stand-in in a process of its own (:func:`wait_healthy` before use); stopped, by
    PID, on the way out."""
    launcher = ServerLauncher(str(log_dir), env={"OMP_NUM_THREADS": "1"})
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        proc = launcher.start(reference_server_command(str(model_dir), port, python=sys.executable,
                                                       extra=list(extra)), address)
        yield Target("stand-in", address, lambda: proc.process.poll() is None,
                     Path(proc.log_path), lambda: proc.process.pid)
    finally:
        launcher.stop()


def wait_healthy(target: Target, timeout_s: float = 180.0) -> Target:
    deadline = time.monotonic() + timeout_s
    while target.call("GET", "/health_generate", timeout_s=20).status != 200:
        if not target.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{target.name} at {target.address} did not start: "
                               f"{target.log_path.read_text()[-2000:]}")
        time.sleep(0.5)
    return target
