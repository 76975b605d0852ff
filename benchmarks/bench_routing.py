#!/usr/bin/env python
"""Which server a sample goes to: our least-loaded and prompt-affinity choices against
sglang-router, on batches whose samples share prompts (issue 50).

GSPO draws ``n`` samples of each prompt; every sample is one ``/generate`` request carrying the
whole prompt. A server that already holds a prompt in its radix cache prefills only the part it
has not seen; one that does not prefills all of it. Three ways to place a batch on two real SGLang
0.5.23 CPU servers (each on its own core, like one GPU each), through our real client
(``SGLangEngine``):

- ``least_loaded``: the member with the fewest requests in flight (our default until now);
- ``prompt_affinity``: a prompt's samples stay on the server that took its first one while its
  load allows (``rollout.sglang.routing``, ``rollout/sglang/server_pool.py``);
- ``prompt_affinity`` also prefills each prompt once on its server before its samples go
  there (``rollout/sglang/prefix_warmup.py``: SGLang's default ``fcfs`` schedule prefills
  requests that arrive together each in full);
- ``router``: one address, sglang-router 0.3.2's Rust router (``policy cache_aware``, its
  defaults) in front of both servers, which matches each request's prefix against a tree of what
  it sent to each worker;
- ``router+warm-up``: the router, given our warm-up too (each prompt's prefill request goes
  through it first, then the samples).

Per arm and shape the same requests (same prompts, same per-sample seeds), the servers' caches
flushed before each; arms interleaved, repeated. Recorded: the batch's wall time, the share of
input tokens the servers' caches held (their own ``meta_info.cached_tokens``), and how the
requests spread over the servers (each server's ``#new-token`` / ``#cached-token`` prefill
log lines: the router does not say where it sent a request). Writes the marked section of
docs/rollout.md with ``--doc``.

    make sglang-venv && .venv-sglang/bin/pip install --no-deps sglang-router==0.3.2
    .venv/bin/python benchmarks/bench_routing.py --doc docs/rollout.md  # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gspo_megatron.distributed.ports import free_port  # noqa: E402
from gspo_megatron.rollout.sglang.engine import SGLangEngine  # noqa: E402
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.real_sglang import SGLANG_PYTHON, RealServer  # noqa: E402

BEGIN = "<!-- bench_routing: begin (written by the benchmark; do not edit) -->"
END = "<!-- bench_routing: end -->"
ARMS = ("least_loaded", "prompt_affinity", "router", "router+warm-up")
ROUTER_VERSION = "0.3.2"
SHARED_PREFIX_TOKENS = 64
"""Tokens every prompt starts with (a chat template and system prompt): a prefix all groups share."""
PREFILL_LINE = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


class Router:
    """sglang-router in front of ``workers``, started from the SGLang virtualenv."""

    def __init__(self, workers: Sequence[str], log_path: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        command = [SGLANG_PYTHON, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                   "--port", str(self.port), "--policy", "cache_aware", "--log-level", "warn",
                   # its health checks (SGLang's /health) go unanswered while a CPU server is
                   # in a long prefill, and the router then stops sending to it
                   "--disable-health-check",
                   "--worker-urls", *[f"http://{w}" for w in workers]]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.log_path = log_path
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"sglang-router exited with {self.process.returncode}:\n"
                                 f"{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if requests.get(f"http://{self.address}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"sglang-router not healthy after 120 s: {log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)


def workload(prompts: int, n: int, prompt_tokens: int, seed: int) -> List[GenerationRequest]:
    """``prompts`` prompts of ``prompt_tokens`` random ordinary token ids (the first
    ``SHARED_PREFIX_TOKENS`` the same in all), ``n`` samples each."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 150000) for _ in range(SHARED_PREFIX_TOKENS)]
    return [GenerationRequest(f"p{g}", shared + [rng.randrange(100, 150000)
                                                 for _ in range(prompt_tokens - SHARED_PREFIX_TOKENS)], n=n)
            for g in range(prompts)]


def prefill_counts(server: RealServer, since: int) -> Dict[str, int]:
    """New and cached prompt tokens the server's scheduler logged after byte ``since``."""
    with open(server.log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    seqs = new = cached = 0
    for m in PREFILL_LINE.finditer(text):
        seqs, new, cached = seqs + int(m.group(1)), new + int(m.group(2)), cached + int(m.group(3))
    return {"requests": seqs, "new_tokens": new, "cached_tokens": cached}


def run_arm(arm: str, servers: List[RealServer], router: Router,
            reqs: List[GenerationRequest], params: SamplingParams) -> dict:
    for s in servers:
        requests.post(f"http://{s.address}/flush_cache", timeout=60).raise_for_status()
    marks = [s.log_path.stat().st_size for s in servers]
    addresses = [router.address] if arm.startswith("router") else [s.address for s in servers]
    routing = {"router": "least_loaded", "router+warm-up": "prompt_affinity"}.get(arm, arm)
    engine = SGLangEngine(addresses, request_timeout_s=900, max_retries=0,
                          max_concurrency_per_server=256, routing=routing)
    try:
        t0 = time.perf_counter()
        samples = engine.generate(reqs, params)
        wall_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    time.sleep(1.0)  # the last prefill lines reach the logs
    per_server = [prefill_counts(s, m) for s, m in zip(servers, marks)]
    return {"arm": arm, "wall_s": wall_s, "prefix_cache_hit": engine.metrics.prefix_cache_hit,
            "generated_tokens": sum(len(s.response_token_ids) for s in samples),
            "retries": engine.metrics.num_retries, "per_server": per_server}


def warm_up_servers(servers: List[RealServer]) -> None:
    """A first small batch on each server, not measured: a fresh CPU server's first prefill
    and decode run far slower than the later ones."""
    engine = SGLangEngine([s.address for s in servers], request_timeout_s=900)
    try:
        engine.generate(workload(len(servers) * 2, 2, SHARED_PREFIX_TOKENS + 32, seed=12345),
                        SamplingParams(max_new_tokens=4))
    finally:
        engine.shutdown()


def run_shape(shape: dict, servers: List[RealServer], router: Router, repeats: int,
              seed: int) -> List[dict]:
    reqs = workload(shape["prompts"], shape["n"], shape["prompt_tokens"], seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=shape["new_tokens"], seed=seed)
    out = []
    for r in range(repeats):
        order = list(ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)])  # a different arm first each time
        for arm in order:
            trial = run_arm(arm, servers, router, reqs, params)
            trial.update(shape=shape, repeat=r)
            print(json.dumps(trial), flush=True)
            out.append(trial)
    return out


def _median(values: List[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def table(trials: List[dict]) -> List[str]:
    out = ["| shape (prompts x samples, prompt + new tokens) | routing | batch wall s, median (min-max) "
           "| vs least_loaded | input tokens cached | prompt tokens prefilled per server | requests per server |",
           "|---|---|---|---|---|---|---|"]
    shapes = []
    for t in trials:
        if t["shape"] not in shapes:
            shapes.append(t["shape"])
    for shape in shapes:
        rows = {a: [t for t in trials if t["shape"] == shape and t["arm"] == a] for a in ARMS}
        base = _median([t["wall_s"] for t in rows["least_loaded"]])
        label = f"{shape['prompts']} x {shape['n']}, {shape['prompt_tokens']} + {shape['new_tokens']}"
        for arm, ts in rows.items():
            walls = [t["wall_s"] for t in ts]
            hit = _median([t["prefix_cache_hit"] or 0.0 for t in ts])
            new = " / ".join(str(_median([t["per_server"][i]["new_tokens"] for t in ts]))
                             for i in range(len(ts[0]["per_server"])))
            reqs = " / ".join(str(_median([t["per_server"][i]["requests"] for t in ts]))
                              for i in range(len(ts[0]["per_server"])))
            out.append(f"| {label} | {arm} | {_median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) | "
                       f"{_median(walls) / base:.2f}x | {hit:.0%} | {new} | {reqs} |")
    return out


def write_section(doc: Path, lines: List[str]) -> None:
    text = doc.read_text()
    block = "\n".join([BEGIN, *lines, END])
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def _conditions(load_before: float, model: str) -> str:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
            f"load average (1 min) at start / end {load_before:.1f} / {os.getloadavg()[0]:.1f}, "
            f"code {commit}, sglang 0.5.23 (CPU engine, 1 thread per server), sglang-router "
            f"{ROUTER_VERSION}; model: {model}")


def _router_installed() -> bool:
    probe = subprocess.run([SGLANG_PYTHON, "-c", "import sglang_router.version as v; print(v.__version__)"],
                           capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == ROUTER_VERSION


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="an HF checkpoint directory (default: Qwen3-30B-A3B widths, 1 layer, "
                        "written under --work by make_qwen3_assets)")
    p.add_argument("--work", type=Path, default=Path("/tmp/gspo-bench-routing"))
    p.add_argument("--shapes", nargs="+", default=["4x8:256+8", "4x8:96+32"],
                   help="PROMPTSxN:PROMPT_TOKENS+NEW_TOKENS")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--doc", type=Path)
    p.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "routing.json")
    args = p.parse_args(argv)
    if not _router_installed():
        print(f"error: sglang-router {ROUTER_VERSION} is not installed in {SGLANG_PYTHON}'s "
              f"environment: .venv-sglang/bin/pip install --no-deps sglang-router=={ROUTER_VERSION}",
              file=sys.stderr)
        return 2
    shapes = []
    for spec in args.shapes:
        m = re.fullmatch(r"(\d+)x(\d+):(\d+)\+(\d+)", spec)
        if not m:
            p.error(f"--shapes {spec!r}: expected PROMPTSxN:PROMPT_TOKENS+NEW_TOKENS, e.g. 8x8:1024+16")
        prompts, n, prompt_tokens, new_tokens = map(int, m.groups())
        if prompt_tokens <= SHARED_PREFIX_TOKENS:
            p.error(f"--shapes {spec!r}: prompts need more than {SHARED_PREFIX_TOKENS} tokens")
        shapes.append({"prompts": prompts, "n": n, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens})
    args.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    model, model_label = args.model, f"{args.model}"
    if model is None:
        from gspo_megatron.real_geometry.assets import make_qwen3_assets
        assets = args.work / "assets"
        if not (assets / "model" / "config.json").exists():
            make_qwen3_assets(assets, "30b", 1, overwrite=True)
        model, model_label = assets / "model", "Qwen3-30B-A3B widths, 1 layer, random bf16 (make_qwen3_assets)"
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=args.work))
    max_tokens = max(s["prompts"] * s["n"] * (s["prompt_tokens"] + s["new_tokens"]) for s in shapes)
    servers = [RealServer(str(model), logs / f"server{i}.log",
                          extra_args=["--max-total-tokens", str(max_tokens)]) for i in range(2)]
    router = None
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        warm_up_servers(servers)
        router = Router([s.address for s in servers], logs / "router.log")
        trials = [t for shape in shapes for t in run_shape(shape, servers, router, args.repeats, args.seed)]
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(trials, indent=1) + "\n")
    lines = table(trials)
    print("\n".join(lines))
    if args.doc:
        command = "python benchmarks/bench_routing.py " + shlex.join(argv)
        write_section(args.doc, ["", f"Measured by `{command}` ({_conditions(load_before, model_label)}; "
                                     f"{args.repeats} repeats per arm, arms interleaved, caches flushed "
                                     "before each batch; every prompt starts with the same "
                                     f"{SHARED_PREFIX_TOKENS} tokens, then its own):", "", *lines, ""])
    return 0


if __name__ == "__main__":
    sys.exit(main())
