"""Reference rollout server: SGLang 0.5.23's native HTTP API (the part we use) on the embedded engine.

Lets the disaggregated and colocated modes run end to end on machines without GPUs, and is the
strict stand-in the SGLang client is tested against: every rule below is SGLang's (file names are
sglang's), or stricter where SGLang would misbehave silently; old client behaviour that the real
server would refuse fails the tests here too.

- routes and methods: ``srt/entrypoints/http_server.py`` (``ROUTES``; checked against the wheel
  by tests/test_rollout_sglang_conformance.py); a wrong method answers 405, an unknown path 404.
- ``/generate``: :mod:`rollout.standin.request_validation` (JSON contract, context length, token ids);
  waits while generation is paused; cancelled by ``/abort_request`` or a client disconnect.
- ``/ready``: 200, or 503 while generation is paused (no token generated).
- ``/health`` and ``/health_generate`` generate one token (0.5.23 enables generation on both):
  200 once any decoding step ran after the call, 503 after ``health_timeout_s`` (SGLang's
  ``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s) or while memory is released.
- pause / continue / abort / flush / memory: :mod:`rollout.standin.scheduler`; weight updates:
  :mod:`rollout.standin.weights`.
- ``/release_memory_occupation`` needs ``--enable-memory-saver`` (stricter: without it SGLang
  answers 200 and frees nothing) and an idle server (SGLang's assertion and message).

Fault injection for tests (:class:`FaultPlan`, or ``--fail-requests 3,5 --delay-s 0.5
--exit-on-request 4 --hang-requests 2``): the k-th ``/generate`` request (1-based, counted on
arrival) answers 500, sleeps, kills the process before answering, or hangs.

    python -m gspo_megatron.rollout.standin.server --model-path DIR --port 30000 [--enable-memory-saver]
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.server_keys import ServerKeys, read_keys
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, GeneratedRow
from gspo_megatron.rollout.routed_experts import encode_sglang
from gspo_megatron.rollout.standin.http_server import ClosingHTTPServer
from gspo_megatron.rollout.standin.memory_ledger import LEDGER_ENV, MemoryLedger, OutOfMemory, ServerMemory
from gspo_megatron.rollout.standin.request_validation import ContractError, RequestError, parse_generate
from gspo_megatron.rollout.standin.scheduler import Job, ReferenceScheduler, Refused
from gspo_megatron.rollout.standin.weights import WeightReceiver
from gspo_megatron.rollout.types import SamplingParams

log = logging.getLogger(__name__)

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")

ROUTES: Dict[str, Tuple[str, ...]] = {
    api.GENERATE: ("POST", "PUT"), api.HEALTH: ("GET",), api.HEALTH_GENERATE: ("GET",),
    api.READY: ("GET",), api.MODEL_INFO: ("GET",), api.MODEL_INFO_DEPRECATED: ("GET",),
    api.SERVER_INFO: ("GET",),
    api.FLUSH_CACHE: ("GET", "POST"), api.PAUSE: ("POST",), api.CONTINUE: ("POST",),
    api.ABORT: ("POST",), api.RELEASE_MEMORY: ("GET", "POST"), api.RESUME_MEMORY: ("GET", "POST"),
    api.BEGIN_UPDATE: ("POST",), api.END_UPDATE: ("POST",), api.INIT_GROUP: ("POST",),
    api.DESTROY_GROUP: ("POST",), api.UPDATE_FROM_DISTRIBUTED: ("POST",),
    api.UPDATE_FROM_TENSOR: ("POST",), api.UPDATE_FROM_DISK: ("POST",),
    api.GET_WEIGHTS_BY_NAME: ("GET", "POST")}
"""Every route the stand-in serves, with SGLang's methods for it."""


@dataclass
class FaultPlan:
    """Which ``/generate`` requests (1-based arrival order) misbehave, and how."""

    fail_requests: FrozenSet[int] = frozenset()
    """Answer HTTP 500 without generating."""
    hang_requests: FrozenSet[int] = frozenset()
    """Never answer (sleep for ``hang_s``)."""
    exit_on_request: Optional[int] = None
    """Kill this server process (``os._exit``) when this request arrives: a crash mid-batch."""
    delay_s: float = 0.0
    """Extra seconds before every ``/generate`` answer (a slow server)."""
    hang_s: float = 3600.0


def _error(message: str, status: int = 400) -> Tuple[int, Dict[str, Any]]:
    return status, {"error": {"message": message}}


class ReferenceServer:
    """An HTTP server around one :class:`EmbeddedEngine`; ``start()`` serves in a thread."""

    def __init__(self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0,
                 faults: Optional[FaultPlan] = None, max_batch_size: int = 64,
                 model_path: str = "", enable_memory_saver: bool = False,
                 context_length: Optional[int] = None, health_timeout_s: float = 20.0,
                 update_idle_timeout_s: float = 600.0, request_log_path: Optional[str] = None,
                 keys: Optional[ServerKeys] = None, memory: Optional[ServerMemory] = None) -> None:
        self.engine = engine
        self.memory = memory
        """The static pool on a simulated GPU's ledger (``memory_ledger.py``); None: untracked."""
        self.keys = keys
        """With keys, SGLang's levels (``srt/utils/auth.py``): the admin key on the management
        endpoints, the ordinary key elsewhere, none on ``/health*`` (``server_keys.for_path``)."""
        self.faults = faults or FaultPlan()
        self.model_path = model_path
        self.enable_memory_saver = enable_memory_saver
        cfg = engine.model.config
        self.context_length = int(context_length or getattr(cfg, "max_position_embeddings", 4096))
        self.vocab_size = int(cfg.vocab_size)
        self.health_timeout_s = health_timeout_s
        self.scheduler = ReferenceScheduler(engine, max_batch_size)
        self.weights = WeightReceiver(self.scheduler, update_idle_timeout_s)
        self.request_log: List[Tuple[str, str, Any]] = []
        """Every (method, path, JSON body) received, in arrival order (tests check the client)."""
        self.request_log_path = request_log_path
        """Also append ``{"method", "path"}`` lines here (tests of server processes)."""
        self._num_generate = 0
        self._counter_lock = threading.Lock()
        self.httpd = ClosingHTTPServer((host, port), self._handler_class())
        self._stopping = threading.Event()
        """Set by ``stop()``: ends injected hangs, so a stopped server leaves no thread behind."""
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> "ReferenceServer":
        self.scheduler.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.scheduler.start()
        self.httpd.serve_forever()

    def stop(self) -> None:
        self._stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.scheduler.stop()
        self.httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- generation -------------------------------------------------------------------------
    def _inject_faults(self) -> Optional[Tuple[int, Any]]:
        with self._counter_lock:
            self._num_generate += 1
            ordinal = self._num_generate
        f = self.faults
        if f.exit_on_request == ordinal:
            log.warning("fault injection: exiting on /generate request %d", ordinal)
            os._exit(17)
        if ordinal in f.hang_requests:
            self._stopping.wait(f.hang_s)
        if f.delay_s:
            self._stopping.wait(f.delay_s)
        if ordinal in f.fail_requests:
            return _error(f"injected failure on request {ordinal}", 500)
        return None

    def handle_generate(self, body: Any, client_gone: Callable[[], bool]) -> Optional[Tuple[int, Any]]:
        injected = self._inject_faults()
        if injected:
            return injected
        try:
            rid, ids, params, seed, want_logprobs, want_routing, prefill_only = parse_generate(
                body, self.vocab_size, self.context_length)
        except ContractError as exc:
            return 400, {"error": str(exc)}
        except RequestError as exc:
            return _error(str(exc))
        job = Job(rid or uuid.uuid4().hex, ids, seed, params)
        t0 = time.perf_counter()
        admit = self.scheduler.admit if prefill_only else self.scheduler.submit
        try:
            while not admit(job, gate_timeout_s=0.2):  # paused: wait at the gate
                if client_gone():
                    return None
        except Refused as exc:
            return _error(str(exc))
        if prefill_only:  # the prompt is cached; no token is generated
            job.result = GeneratedRow([], [], "length")
            self.scheduler.finished(job)
            job.done.set()
        while not job.done.wait(0.1):
            if client_gone():  # SGLang aborts a request whose client disconnected
                self.scheduler.abort(job.rid)
                job.done.wait()
                return None
        if job.error is not None:
            return _error(job.error, 500)
        return 200, self._response(job, job.result, len(ids), time.perf_counter() - t0,
                                   want_logprobs, want_routing)

    def _response(self, job: Job, row: GeneratedRow, prompt_len: int, latency: float,
                  want_logprobs: bool, want_routing: bool) -> Dict[str, Any]:
        """SGLang's body; routed experts only when asked for *and* captured (started with
        ``--enable-return-routed-experts``): SGLang leaves them out silently otherwise."""
        reason = row.finish_reason or "length"
        finish = ({"type": "stop", "matched": row.matched} if reason == "stop"
                  else {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                  if reason == "abort" else {"type": "length", "length": len(row.tokens)})
        tok = self.engine.tokenizer
        text = tok.decode(row.tokens) if tok is not None else ""
        routing = encode_sglang(row.routing) if want_routing and row.routing is not None else None
        out = api.generate_response(job.rid, prompt_len, row.tokens, row.logprobs, finish, latency,
                                    text, self.weight_version, routed_experts=routing)
        if not want_logprobs:
            for key in ("input_token_logprobs", "output_token_logprobs",
                        "output_token_logprobs_length"):
                out["meta_info"].pop(key)
        return out

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version or "default"  # server_args.weight_version's default

    def handle_health(self) -> Tuple[int, Any]:
        """http_server.health_generate: any decoding progress after the call within the timeout."""
        if self.scheduler.released & {"weights", "kv_cache"}:
            return 503, ""
        tic = time.monotonic()
        job = Job(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], None, SamplingParams(max_new_tokens=1))
        try:
            admitted = self.scheduler.submit(job, gate_timeout_s=self.health_timeout_s)
        except Refused:
            return 503, ""
        deadline = tic + self.health_timeout_s
        while admitted and time.monotonic() < deadline:
            if job.done.wait(0.05) or self.scheduler.last_progress > tic:
                return 200, ""
        self.scheduler.abort(job.rid)
        return 503, ""

    # --- control ----------------------------------------------------------------------------
    def handle_memory(self, path: str, body: Dict[str, Any]) -> Tuple[int, Any]:
        tags = body.get("tags") or list(api.MEMORY_TAGS)
        unknown = sorted(set(tags) - set(api.MEMORY_TAGS))
        if unknown:
            return _error(f"unknown memory tags {unknown}; expected {list(api.MEMORY_TAGS)}")
        sched = self.scheduler
        if path == api.RELEASE_MEMORY:
            if not self.enable_memory_saver:
                return _error("release_memory_occupation needs a server started with "
                              "--enable-memory-saver (reference server rule: without it SGLang "
                              "answers 200 and frees nothing)")
            if not sched.is_idle():
                return _error("release_memory_occupation should be called only when server is idle.")
            if "kv_cache" in tags:
                sched.flush()
            if self.memory is not None:
                self.memory.release(sorted(set(tags) - sched.released))
            sched.released |= set(tags)
            return 200, None
        missing = sorted(set(tags) - sched.released)
        if missing:
            return _error(f"resume_memory_occupation: {missing} not released "
                          "(a KeyError in SGLang's scheduler)")
        if self.memory is not None:
            try:
                self.memory.resume(sorted(tags))
            except OutOfMemory as exc:  # SGLang: a CUDA out-of-memory error in its scheduler
                return _error(f"resume_memory_occupation: out of memory: {exc}")
        sched.released -= set(tags)
        return 200, None

    def route(self, method: str, path: str, body: Any,
              client_gone: Callable[[], bool] = lambda: False) -> Optional[Tuple[int, Any]]:
        self.request_log.append((method, path, body))
        if self.request_log_path:
            with self._counter_lock, open(self.request_log_path, "a") as f:
                f.write(json.dumps({"method": method, "path": path}) + "\n")
        if path not in ROUTES:
            return 404, {"detail": "Not Found"}
        if method not in ROUTES[path]:
            return 405, {"detail": "Method Not Allowed"}
        body = body if body is not None else {}
        if path == api.GENERATE:
            return self.handle_generate(body, client_gone)
        if path in (api.HEALTH, api.HEALTH_GENERATE):
            return self.handle_health()
        if path == api.READY:  # SGLang answers with an empty body
            return (503 if self.scheduler.paused else 200), ""
        if path in (api.MODEL_INFO, api.MODEL_INFO_DEPRECATED):
            return 200, {"model_path": self.model_path, "is_generation": True,
                         "weight_version": self.weight_version, "load_format": "auto"}
        if path == api.SERVER_INFO:
            return 200, {"version": api.SGLANG_VERSION, "frontend": "python",
                         "model_path": self.model_path, "context_length": self.context_length,
                         "enable_memory_saver": self.enable_memory_saver, "reference_server": True}
        if path == api.FLUSH_CACHE:
            return (200, FLUSHED) if self.scheduler.flush() else (400, "Flush cache failed.\n")
        if path == api.PAUSE:
            try:
                self.scheduler.pause(body.get("mode", "abort"))
            except Refused as exc:
                return 400, {"object": "error", "message": str(exc), "type": "Bad Request", "code": 400}
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == api.CONTINUE:
            self.scheduler.resume_generation()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == api.ABORT:
            self.scheduler.abort(str(body.get("rid") or ""), bool(body.get("abort_all")))
            return 200, ""
        if path in (api.RELEASE_MEMORY, api.RESUME_MEMORY):
            return self.handle_memory(path, body)
        return self.weights.route(path, body)

    def authorize(self, path: str, header: Optional[str]) -> Optional[Tuple[int, Any]]:
        """None when the request may proceed, else SGLang's 401 answer."""
        if self.keys is None:
            return None
        expected = self.keys.for_path(path)
        if expected is None:
            return None
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), expected.encode()):
            return None
        return 401, {"error": "Unauthorized"}

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _client_gone(self) -> bool:
                # poll, not select: select refuses a descriptor >= 1024 (FD_SETSIZE), which a
                # long-lived process (the test session) reaches: every request then failed
                poller = select.poll()
                poller.register(self.connection, select.POLLIN)
                try:
                    readable = poller.poll(0)
                    return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError as exc:  # FastAPI's validation error, SGLang's body
                    answer = (400, {"object": "error", "message": f"JSON decode error: {exc}",
                                    "type": "Bad Request", "param": None, "code": 400})
                else:
                    answer = (server.authorize(self.path, self.headers.get("Authorization")) or
                              server.route(method, self.path.split("?")[0], body, self._client_gone))
                if answer is None:  # the client is gone: nothing to write
                    self.close_connection = True
                    return
                status, out = answer
                data = (out if isinstance(out, str) else json.dumps(out)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(out, str)
                                 else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_PUT(self) -> None:
                self._serve("PUT")

            def log_message(self, fmt: str, *args) -> None:
                log.debug("%s " + fmt, self.address_string(), *args)

        return Handler


def _int_set(text: str) -> FrozenSet[int]:
    return frozenset(int(x) for x in text.split(",") if x.strip())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--logprob-mode", default="scaled", choices=("scaled", "sampled"))
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="allow /release_memory_occupation (SGLang's flag of the same name)")
    p.add_argument("--context-length", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    p.add_argument("--request-log", default=None, help="append one JSON line per request here")
    p.add_argument("--fail-requests", type=_int_set, default=frozenset())
    p.add_argument("--hang-requests", type=_int_set, default=frozenset())
    p.add_argument("--exit-on-request", type=int, default=None)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--key-file", default=None,
                   help="JSON {api_key, admin_api_key} (mode 0600): require SGLang's bearer keys")
    p.add_argument("--memory-ledger", default=os.environ.get(LEDGER_ENV),
                   help="simulated GPU memory ledger (memory_ledger.py); default: $" + LEDGER_ENV)
    p.add_argument("--mem-fraction-static", type=float, default=0.7,
                   help="SGLang's flag: the static pool's share of the free memory (ledger only)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="SGLang's flag: capture the experts of every token, returned to requests "
                        "that set return_routed_experts")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engine = EmbeddedEngine.from_pretrained(args.model_path, logprob_mode=args.logprob_mode,
                                            max_batch_size=args.max_batch_size,
                                            record_routing=args.enable_return_routed_experts)
    faults = FaultPlan(fail_requests=args.fail_requests, hang_requests=args.hang_requests,
                       exit_on_request=args.exit_on_request, delay_s=args.delay_s)
    memory = None
    if args.memory_ledger:
        weights = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        memory = ServerMemory(MemoryLedger(args.memory_ledger), f"server:{args.port}", weights,
                              args.mem_fraction_static)
    server = ReferenceServer(engine, args.host, args.port, faults, args.max_batch_size,
                             model_path=args.model_path, enable_memory_saver=args.enable_memory_saver,
                             context_length=args.context_length, request_log_path=args.request_log,
                             keys=read_keys(args.key_file) if args.key_file else None, memory=memory)
    log.info("reference server for %s listening on %s", args.model_path, server.address)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
