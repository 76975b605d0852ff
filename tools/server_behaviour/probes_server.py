"""Probes of how a server is started and what kills it: flags, idling, memory release, bad ids.

``--dtype auto``, the idle scheduler and ``/dev/shm`` need a server started another way;
``/release_memory_occupation`` and an out-of-vocabulary token id kill the real CPU server, and
``--enable-deterministic-inference`` / ``--enable-return-routed-experts`` stop it at start.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

import torch

from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs
from gspo_megatron.rollout.sglang import api
from tools.server_behaviour.probes import (LOGPROB_TOL, Context, Observed, tokens_and_logprobs,
                                           cell, generate_body, same_row, shorten)
from tools.server_behaviour.probes_weights import outcome
from tools.server_behaviour.servers import Target
from tests.real_sglang import RealServer

SPINS, SLEEPS = 0.1, 0.05
"""CPU seconds per second of an idle server's processes: above SPINS it spins, below SLEEPS it
sleeps. Measured here: 0.87 spinning (load ~4 on 2 cores; a spinner keeps ~2/(load+1) of a core,
still 0.2 at a load of 9), 0.02 with ``--sleep-on-idle``, 0.0 for the stand-in."""
KV_DTYPE = re.compile(r"KV Cache is allocated\. dtype: (torch\.\w+)")


def _greedy_gap_to_float32(ctx: Context, t: Target) -> float:
    """Max |server log-prob - the float32 model's, teacher-forced| over greedy answers."""
    gaps = []
    with torch.no_grad():
        for i, ids in enumerate(ctx.prompts):
            answer = t.call("POST", api.GENERATE, generate_body(f"dtype{i}", ids, temperature=0,
                                                                max_new_tokens=16))
            tokens, logprobs = tokens_and_logprobs(answer)
            ref = teacher_forced_logprobs(ctx.model, ids, tokens, 1.0)
            gaps.append(float((torch.tensor(logprobs) - ref).abs().max()))
    return max(gaps)


def probe_dtype_auto(ctx: Context) -> Observed:
    """``ctx.real`` was started with ``--dtype auto`` on the float32 checkpoint."""
    out, measured = {}, {}
    for t in ctx.both:
        gap = _greedy_gap_to_float32(ctx, t)
        measured[f"dtype_auto_{t.name}_max_abs_logprob_diff_to_float32"] = gap
        text = t.log_path.read_text(errors="replace") if t.log_path.exists() else ""
        kv = KV_DTYPE.findall(text)
        out[t.name] = (f"greedy log-probs {'within' if gap <= LOGPROB_TOL else 'more than'} "
                       f"{LOGPROB_TOL:g} {'of' if gap <= LOGPROB_TOL else 'off'} the float32 "
                       f"model's" + (f"; KV cache `{kv[-1]}`" if kv else ""))
    return same_row("dtype_auto", out["real"], out["stand-in"], **measured)


def idle_state(share: float) -> str:
    return "spins" if share > SPINS else "sleeps" if share < SLEEPS else f"unclear ({share:.2f})"


def shm_idle_row(shm_files: List[str], idle: Dict[str, float]) -> Observed:
    """``idle``: CPU share of the real server with and without ``--sleep-on-idle`` and of the
    stand-in; ``shm_files``: what the first real server left in ``/dev/shm``."""
    real = (f"leaves {'a' if shm_files else 'no'} `/dev/shm/sglang_loads_*.shm` file; idle: "
            f"{idle_state(idle['real_without_flag'])} without `--sleep-on-idle`, "
            f"{idle_state(idle['real_with_flag'])} with it")
    stand_in = f"leaves no file; idle: {idle_state(idle['stand-in'])}"
    return same_row("shm_idle", real, stand_in, **{f"idle_cpu_share_{k}": v for k, v in idle.items()})


def probe_release_memory(ctx: Context) -> Observed:
    """Kills the real CPU server: runs last on one."""
    out = {}
    for t in (ctx.stand_in, ctx.real):
        t.mark_log()
        out[t.name] = outcome(t, t.call("POST", api.RELEASE_MEMORY, api.memory_payload(None),
                                        timeout_s=60))
    return same_row("release_memory", out["real"], out["stand-in"])


def probe_oov_token(ctx: Context) -> Observed:
    """A token id far outside the vocabulary: kills the real CPU server."""
    out = {}
    for t in (ctx.stand_in, ctx.real):
        t.mark_log()
        out[t.name] = outcome(t, t.call("POST", api.GENERATE,
                                        generate_body("oov", [10 ** 6]), timeout_s=60))
    return same_row("oov_token", out["real"], out["stand-in"])


def start_refusal(model_dir: Path, log_path: Path, flag: str, limit: int = 120,
                  launched: Optional[RealServer] = None) -> str:
    """How a real server started with ``flag`` ends (``launched``: the one already launched
    with it): it starts, or the exception it exits with."""
    server = launched or RealServer(str(model_dir), log_path, extra_args=[flag]).launch()
    try:
        server.wait_ready()
        return "starts"
    except AssertionError:
        target = Target("real", server.address, server.alive, log_path, lambda: None)
        return "exits at start: " + shorten(target.log_exception() or "no exception in its log",
                                            limit)
    finally:
        server.stop()


def with_start_refusal(seeded: Observed, refusal: str) -> Observed:
    """The ``deterministic`` row: the seed probe, and the flag that would make seeds count."""
    seeded.real += f"; `--enable-deterministic-inference`: {refusal}"
    seeded.same = seeded.real == seeded.stand_in
    return seeded


def r3_start_row(real_refusal: str, stand_in: Target, prompt: List[int]) -> Observed:
    """``--enable-return-routed-experts``: the real server's start; a stand-in started with it."""
    answer = stand_in.call("POST", api.GENERATE, dict(generate_body("r3", prompt),
                                                      return_routed_experts=True))
    captured: Optional[str] = None
    if answer.status == 200:
        captured = "with" if "routed_experts" in answer.body["meta_info"] else "without"
    si = (f"starts; 200 {captured} `meta_info.routed_experts`" if captured else cell(answer))
    return same_row("r3_start", real_refusal, si)
