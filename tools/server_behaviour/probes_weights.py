"""Probes of the weight-update endpoints: what a killed trainer leaves, unknown names, wrong shapes.

Every probe leaves a server that lives on as it found it (session ended, group destroyed,
generation continued); :func:`probe_wrong_shape` kills the real server, so it runs last on one.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import torch

from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.update_group import create_update_group, destroy_update_group
from gspo_megatron.weight_sync.tensor_ipc import serialize_named_tensors
from tools.server_behaviour.probes import (HEALTH_WAIT_S, Context, Observed, cell, died,
                                           generate_body, same_row, tokens_and_logprobs)
from tools.server_behaviour.servers import Answer, Target

UNKNOWN_NAME = "model.layers.9.mlp.gate.weight"
"""A name of the Qwen3-MoE family this 2-layer checkpoint does not have."""


def _load_tensors(t: Target, named: List[Tuple[str, torch.Tensor]]) -> Answer:
    """Pause, open a session, send ``named`` through tensor handles; the caller closes it."""
    t.call("POST", api.PAUSE, api.pause_payload("abort"))
    t.call("POST", api.BEGIN_UPDATE, {})
    t.mark_log()
    return t.call("POST", api.UPDATE_FROM_TENSOR,
                  api.update_tensor_payload([serialize_named_tensors(named)]), timeout_s=60)


def _close_session(t: Target) -> None:
    for path in (api.END_UPDATE, api.FLUSH_CACHE, api.CONTINUE):
        t.call("POST", path, {} if path != api.FLUSH_CACHE else None)


def outcome(t: Target, answer: Answer) -> str:
    """The answer's cell, or how the server died when none came."""
    if answer.status is None or not t.alive():
        return died(t)
    return cell(answer)


def probe_unknown_name(ctx: Context) -> Observed:
    """A name the model lacks, then the greedy answer of the first prompt again."""
    out = {}
    for t in ctx.both:
        gate = ctx.model.state_dict()["model.layers.1.mlp.gate.weight"].clone()
        answer = _load_tensors(t, [(UNKNOWN_NAME, gate)])
        _close_session(t)
        again = t.call("POST", api.GENERATE, generate_body("after-unknown", ctx.prompts[0],
                                                           temperature=0, max_new_tokens=16))
        unchanged = again.status == 200 and \
            tokens_and_logprobs(again)[0] == ctx.greedy.get(t.name, [None])[0]
        out[t.name] = (f"{outcome(t, answer)}; greedy answers after it "
                       f"{'unchanged' if unchanged else 'changed'}")
    return same_row("unknown_name", out["real"], out["stand-in"])


def probe_killed_trainer(ctx: Context) -> Observed:
    """Paused, in a session and in a broadcast group (what a SIGKILLed trainer leaves); the same
    group name again; ``/health_generate`` meanwhile. Cleaned up afterwards."""
    out = {}
    for t in ctx.both:
        t.call("POST", api.PAUSE, api.pause_payload("abort"))
        t.call("POST", api.BEGIN_UPDATE, {})
        port = free_port()
        name = f"behaviour_probe_{port}"
        body = api.init_group_payload("127.0.0.1", port, 1, 2, name, "gloo")
        joined: Dict[str, Answer] = {}
        joiner = threading.Thread(target=lambda: joined.setdefault(
            "a", t.call("POST", api.INIT_GROUP, body)), name="probe-group-join")
        joiner.start()
        group = create_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60)
        joiner.join(timeout=60)
        again = t.call("POST", api.INIT_GROUP, body, timeout_s=20)
        health = t.call("GET", api.HEALTH_GENERATE, timeout_s=HEALTH_WAIT_S)
        t.call("POST", api.END_UPDATE, {})
        t.call("POST", api.DESTROY_GROUP, {"group_name": name})
        destroy_update_group(group)
        t.call("POST", api.CONTINUE, {})
        out[t.name] = (f"init: {cell(joined['a'])}; the same name again: {cell(again)}; "
                       f"`/health_generate`: {cell(health)}")
    return same_row("killed_trainer", out["real"], out["stand-in"])


def probe_wrong_shape(ctx: Context) -> Observed:
    """``lm_head.weight`` one column short: the real server dies, so this runs last on it."""
    out = {}
    for t in (ctx.stand_in, ctx.real):
        short = ctx.model.state_dict()["lm_head.weight"][:, :-1].clone()
        answer = _load_tensors(t, [("lm_head.weight", short)])
        out[t.name] = outcome(t, answer)
        if t.alive():
            _close_session(t)
    return same_row("wrong_shape", out["real"], out["stand-in"])
