"""Reference rollout server: SGLang's native HTTP API (the subset we use) on the embedded engine.

Lets the disaggregated mode (learner and rollout in different processes or nodes) run end to end
on machines without GPUs, and is the server the SGLang client is tested against. Request and
response bodies follow :mod:`rollout.sglang_api` (SGLang's exact field names); weight updates go
through a torch.distributed group (gloo on CPU), a safetensors directory, or not at all
(``/update_weights_from_tensor`` needs CUDA IPC and answers 400 here). Unknown ``/generate``
fields are refused with 400, so a client that drifts from the documented schema fails loudly.

Concurrent ``/generate`` requests are batched: a worker thread takes what has queued (up to
``max_batch_size``) and generates it in one pass; per-request ``sampling_seed`` keeps each
sample independent of its batch-mates.

Fault injection for tests (:class:`FaultPlan`, or ``--fail-requests 3,5 --delay-s 0.5
--exit-on-request 4 --hang-requests 2``): the k-th ``/generate`` request (1-based, counted on
arrival) answers 500, sleeps, kills the process before answering, or hangs.

    python -m gspo_megatron.rollout.reference_server --model-path DIR --port 30000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.embedded import EmbeddedEngine, GeneratedRow
from gspo_megatron.rollout.reference_weights import WeightReceiver
from gspo_megatron.rollout.types import SamplingParams

log = logging.getLogger(__name__)


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


@dataclass
class _Job:
    prompt: List[int]
    seed: Optional[int]
    params: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[GeneratedRow] = None
    error: Optional[str] = None


def _params_from_json(sp: Dict[str, Any]) -> Tuple[SamplingParams, Optional[int]]:
    unknown = set(sp) - api.SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"sampling_params fields not supported by the reference server: {sorted(unknown)}")
    stop = sp.get("stop") or ()
    params = SamplingParams(temperature=float(sp.get("temperature", 1.0)),
                            top_p=float(sp.get("top_p", 1.0)),
                            max_new_tokens=int(sp.get("max_new_tokens", 128)),
                            stop=(stop,) if isinstance(stop, str) else tuple(stop),
                            stop_token_ids=tuple(sp.get("stop_token_ids") or ()))
    seed = sp.get("sampling_seed")
    return params, (int(seed) if seed is not None else None)


class ReferenceServer:
    """An HTTP server around one :class:`EmbeddedEngine`; ``start()`` serves in a thread."""

    def __init__(self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0,
                 faults: Optional[FaultPlan] = None, max_batch_size: int = 64,
                 model_path: str = "") -> None:
        self.engine = engine
        self.faults = faults or FaultPlan()
        self.max_batch_size = max_batch_size
        self.model_path = model_path
        self.weights = WeightReceiver(engine)
        self.request_log: List[Tuple[str, Any]] = []
        """Every (path, JSON body) received, for tests that check the client's fields."""
        self._num_generate = 0
        self._counter_lock = threading.Lock()
        self._jobs: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self.httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self.httpd.daemon_threads = True
        self._threads: List[threading.Thread] = []

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> "ReferenceServer":
        for target in (self._batch_loop, self.httpd.serve_forever):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        threading.Thread(target=self._batch_loop, daemon=True).start()
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=10)

    # --- generation -------------------------------------------------------------------------
    def _batch_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._jobs.get(timeout=0.005)
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                batch.append(nxt)
            self._run_batch(batch)

    def _run_batch(self, batch: List[_Job]) -> None:
        groups: Dict[SamplingParams, List[_Job]] = {}
        for job in batch:
            groups.setdefault(job.params, []).append(job)
        for params, jobs in groups.items():
            try:
                rows = self.engine.generate_token_ids([j.prompt for j in jobs],
                                                      [j.seed for j in jobs], params)
                for j, row in zip(jobs, rows):
                    j.result = row
            except Exception as exc:  # report to every waiting request, keep serving
                log.exception("generation failed")
                for j in jobs:
                    j.error = f"{type(exc).__name__}: {exc}"
            for j in jobs:
                j.done.set()

    def handle_generate(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        with self._counter_lock:
            self._num_generate += 1
            ordinal = self._num_generate
        f = self.faults
        if f.exit_on_request == ordinal:
            log.warning("fault injection: exiting on /generate request %d", ordinal)
            os._exit(17)
        if ordinal in f.hang_requests:
            time.sleep(f.hang_s)
        if f.delay_s:
            time.sleep(f.delay_s)
        if ordinal in f.fail_requests:
            return 500, {"error": {"message": f"injected failure on request {ordinal}"}}
        unknown = set(body) - api.GENERATE_FIELDS
        if unknown:
            return 400, {"error": {"message": f"unsupported /generate fields: {sorted(unknown)}"}}
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "input_ids must be a non-empty list of ints"}}
        try:
            params, seed = _params_from_json(body.get("sampling_params") or {})
        except (ValueError, TypeError) as exc:
            return 400, {"error": {"message": str(exc)}}
        t0 = time.perf_counter()
        job = _Job(ids, seed, params)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            return 500, {"error": {"message": job.error}}
        return 200, self._response(body, job.result, len(ids), time.perf_counter() - t0)

    def _response(self, body: Dict[str, Any], row: GeneratedRow, prompt_len: int,
                  latency: float) -> Dict[str, Any]:
        reason = row.finish_reason or "length"
        finish = ({"type": "stop", "matched": row.matched} if reason == "stop"
                  else {"type": "length", "length": len(row.tokens)})
        tok = self.engine.tokenizer
        text = tok.decode(row.tokens) if tok is not None else ""
        return api.generate_response(str(body.get("rid") or ""), prompt_len, row.tokens,
                                     row.logprobs, finish, latency, text, self.engine.weight_version)

    # --- routing ----------------------------------------------------------------------------
    def route(self, method: str, path: str, body: Any) -> Tuple[int, Any]:
        self.request_log.append((path, body))
        if path == api.GENERATE and method == "POST":
            return self.handle_generate(body or {})
        if path in (api.HEALTH, "/health_generate"):
            return 200, None
        if path == api.MODEL_INFO:
            return 200, {"model_path": self.model_path, "is_generation": True,
                         "weight_version": self.engine.weight_version}
        if path == api.FLUSH_CACHE:
            return 200, "Cache flushed.\n"
        if path == api.RELEASE_MEMORY:
            self.engine.release_memory()
            return 200, None
        if path == api.RESUME_MEMORY:
            self.engine.resume_memory()
            return 200, None
        return self.weights.route(path, body or {})

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError as exc:
                    status, out = 400, {"error": {"message": f"invalid JSON: {exc}"}}
                else:
                    status, out = server.route(method, self.path.split("?")[0], body)
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
    p.add_argument("--fail-requests", type=_int_set, default=frozenset())
    p.add_argument("--hang-requests", type=_int_set, default=frozenset())
    p.add_argument("--exit-on-request", type=int, default=None)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engine = EmbeddedEngine.from_pretrained(args.model_path, logprob_mode=args.logprob_mode)
    faults = FaultPlan(fail_requests=args.fail_requests, hang_requests=args.hang_requests,
                       exit_on_request=args.exit_on_request, delay_s=args.delay_s)
    server = ReferenceServer(engine, args.host, args.port, faults, args.max_batch_size,
                             model_path=args.model_path)
    log.info("reference server for %s listening on %s", args.model_path, server.address)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
