"""Run every probe in an order that costs the fewest real-server starts, each overlapping
other work where it can.

One stand-in process serves the whole run. Real servers, at most two alive at a time (a start
is ~30 CPU-seconds in three interpreters; probing a started server leaves a core mostly idle):

1. the standard CPU server (float32, ``--sleep-on-idle``): every probe that leaves it alive
   (the partial-rollout ones load a second checkpoint and the first again), then the
   wrong-shape tensor, which kills it;
2. one with ``--dtype auto`` and without ``--sleep-on-idle``, launched as soon as the first is
   up: the dtype and the idle probes, then ``/release_memory_occupation``, which kills it;
3. one with ``--enable-deterministic-inference``, which exits at start (~15 s), launched as soon
   as the first has died;
4. ``full`` only (each ~25-70 s more): one for the out-of-vocabulary token id, which kills
   it, and one with ``--enable-return-routed-experts``, which exits at start after loading.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from tools.server_behaviour import probes, probes_partial, probes_server, probes_weights
from tools.server_behaviour.probes import PROMPTS, Context, Observed
from tools.server_behaviour.servers import (idle_cpu_shares, real_server, real_target, stand_in,
                                            wait_healthy)
from tests.real_sglang import RealServer

FULL_ONLY_ROWS = ("oov_token", "r3_start")
"""Rows observed only by a ``full`` run (a real-server start each, ~25-70 s)."""


def _on_the_standard_server(ctx: Context) -> List[Observed]:
    rows = probes.probe_greedy(ctx)
    rows += [probes.probe_sampled(ctx, 1.0, "sampled_t1"), probes.probe_sampled(ctx, 0.7, "sampled_t07")]
    rows += probes.simple_rows(ctx)
    rows += [probes.probe_session_rules(ctx), probes.probe_flush_while_running(ctx),
             probes.probe_routed_experts_without_capture(ctx),
             probes_weights.probe_killed_trainer(ctx), probes_weights.probe_unknown_name(ctx)]
    return rows


def observe(work: Path, full: bool = False, timings: Optional[Dict[str, float]] = None
            ) -> List[Observed]:
    """Every row (``full``: with :data:`FULL_ONLY_ROWS`); logs and the checkpoint under ``work``;
    ``timings`` gets the seconds each phase took."""
    timings = {} if timings is None else timings
    clock = [time.monotonic()]

    def lap(phase: str) -> None:
        now = time.monotonic()
        timings[phase] = round(now - clock[0], 1)
        clock[0] = now

    model_dir = save_tiny_model(*build_tiny_policy(seed=0), work / "model")
    engine = EmbeddedEngine.from_pretrained(str(model_dir))  # the stand-in loads it so
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    rows: List[Observed] = []
    with ExitStack() as ahead:  # servers launched ahead are stopped however the run ends
        def launch(server: RealServer) -> RealServer:
            ahead.callback(server.stop)
            return server.launch()

        with stand_in(model_dir, work / "stand_in") as si:  # starts while the real server does
            with real_server(model_dir, work / "real_standard.log") as server:
                dtype_auto = launch(RealServer(str(model_dir), work / "real_dtype_auto.log",
                                               dtype="auto", drop_args=("--sleep-on-idle",)))
                ctx = Context(real_target(server), wait_healthy(si), engine.model, prompts)
                lap("start the stand-in and the standard real server")
                shares = idle_cpu_shares([ctx.real, si])
                idle = {"stand-in": shares["stand-in"], "real_with_flag": shares["real"]}
                shm_files = server.new_shm_files()
                seeded = probes.probe_seed(ctx)
                rows += _on_the_standard_server(ctx)
                lap("probes on the standard server")
                new_dir = save_tiny_model(*build_tiny_policy(seed=12), work / "model_v2")
                rows += probes_partial.probe_cut_and_resume(
                    ctx, model_dir, new_dir, EmbeddedEngine.from_pretrained(str(new_dir)).model)
                rows += probes_partial.probe_retract(ctx, model_dir)
                rows.append(probes_partial.probe_pause_wait(ctx))
                lap("partial-rollout probes")
                rows.append(probes_weights.probe_wrong_shape(ctx))
                lap("wrong shape (kills it)")
            deterministic = launch(RealServer(str(model_dir), work / "real_deterministic.log",
                                              extra_args=["--enable-deterministic-inference"]))
            with real_server(model_dir, work / "real_dtype_auto.log", launched=dtype_auto) as server:
                ctx = Context(real_target(server), si, engine.model, prompts)
                lap("start the --dtype auto server (launched with the probes above)")
                idle["real_without_flag"] = idle_cpu_shares([ctx.real])["real"]
                rows.append(probes_server.probe_dtype_auto(ctx))
                lap("dtype and idle probes")
                rows.append(probes_server.probe_release_memory(ctx))
                lap("release_memory (kills it)")
            rows.append(probes_server.shm_idle_row(shm_files, idle))
            rows.append(probes_server.with_start_refusal(seeded, probes_server.start_refusal(
                model_dir, work / "real_deterministic.log", "--enable-deterministic-inference",
                launched=deterministic)))
            lap("the --enable-deterministic-inference start")
            if full:
                with real_server(model_dir, work / "real_oov.log") as server:
                    rows.append(probes_server.probe_oov_token(
                        Context(real_target(server), si, engine.model, prompts)))
                lap("the out-of-vocabulary server")
    if full:
        refusal = probes_server.start_refusal(model_dir, work / "real_r3.log",
                                              "--enable-return-routed-experts")
        with stand_in(model_dir, work / "stand_in_r3", extra=["--enable-return-routed-experts"]) as r3:
            rows.append(probes_server.r3_start_row(refusal, wait_healthy(r3), prompts[0]))
        lap("the --enable-return-routed-experts start")
    return rows


def write_json(rows: List[Observed], path: Path, seconds: float, full: bool,
               timings: Optional[Dict[str, float]] = None) -> None:
    path.write_text(json.dumps({"full": full, "seconds": round(seconds, 1), "timings": timings or {},
                                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "rows": [vars(r) for r in rows]}, indent=1, default=float))
