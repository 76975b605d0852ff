"""Probes of what partial rollouts rely on (``rollout/sglang/partial_rollout.py``): a running
request cut by the ``abort`` pause, prompt + its partial response sent again after a weight
update with a new ``weight_version``, and the ``retract`` pause we chose not to use.

Each starts a long greedy request (500 tokens from ``abc``: the argmax never is EOS; ~2 s on
either server) and acts while it runs. Both servers take the same steps; every probe leaves
the checkpoint's weights loaded under the version ``default`` again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs
from gspo_megatron.rollout.sglang import api
from tools.server_behaviour.probes import (LOGPROB_TOL, Context, Observed, cell, generate_body,
                                           same_row, tokens_and_logprobs)
from tools.server_behaviour.servers import Answer, Target

RUN_BEFORE_S = 0.3
"""How long the long request runs before the pause (~70 tokens on either server)."""


def _long_request(t: Target, rid: str, ids: List[int]) -> Tuple[threading.Thread, Dict[str, Answer]]:
    done: Dict[str, Answer] = {}
    body = generate_body(rid, ids, temperature=0, max_new_tokens=500)
    worker = threading.Thread(target=lambda: done.setdefault(rid, t.call(
        "POST", api.GENERATE, body, timeout_s=120)), name=f"probe-{rid}")
    worker.start()
    time.sleep(RUN_BEFORE_S)
    return worker, done


def _spans(answer: Answer) -> str:
    spans = answer.body["meta_info"].get("weight_versions")
    if spans is None:
        return "no `weight_versions`"
    n = answer.body["meta_info"]["completion_tokens"]
    if len(spans) == 1 and spans[0]["start"] == 0 and spans[0]["end"] == n:
        return f"`weight_versions` one span of `{spans[0]['version']}` over them"
    return f"`weight_versions` {len(spans)} spans: " + " then ".join(
        f"`{s['version']}`" for s in spans)


def _restore(t: Target, model_dir: Path) -> None:
    """The checkpoint's weights under the version ``default`` (the start's), cache flushed."""
    t.call("POST", api.UPDATE_FROM_DISK, api.update_disk_payload(str(model_dir),
                                                                 weight_version="default"),
           timeout_s=120)
    t.call("POST", api.FLUSH_CACHE)


def _cut(ctx: Context, t: Target) -> Tuple[str, Answer]:
    """A running request cut by the ``abort`` pause: its answer, as a cell and raw."""
    worker, done = _long_request(t, "cut", ctx.prompts[2])
    pause = t.call("POST", api.PAUSE, api.pause_payload("abort"))
    worker.join(120)
    answer = done.get("cut", Answer(None, error="no answer"))
    if answer.status != 200:
        return f"pause: {cell(pause)}; the request: {cell(answer)}", answer
    meta = answer.body["meta_info"]
    tokens, logprobs = tokens_and_logprobs(answer)
    with torch.no_grad():
        ref = teacher_forced_logprobs(ctx.model, ctx.prompts[2], tokens, 1.0)
    fits = bool(tokens) and float((torch.tensor(logprobs) - ref).abs().max()) <= LOGPROB_TOL
    finish = meta["finish_reason"]
    code = finish.get("status_code", "absent")
    return (f"pause: {cell(pause)}; the request: 200, finish `{finish.get('type')}` "
            f"(`status_code` {'null' if code is None else code}), "
            + ("its tokens so far with their log-probs (the checkpoint's, within "
               f"{LOGPROB_TOL:g}), `completion_tokens` their count, " if fits and
               meta["completion_tokens"] == len(tokens) else "its tokens do not fit, ")
            + _spans(answer)), answer


def _resume(ctx: Context, t: Target, cut: Answer, new_dir: Path, new_model) -> str:
    """Update to other weights as ``v2`` (paused), flush, continue; prompt + the partial less
    its last token, sampled on: the new tokens' log-probs must be the new weights'."""
    update = t.call("POST", api.UPDATE_FROM_DISK,
                    api.update_disk_payload(str(new_dir), weight_version="v2"), timeout_s=120)
    flush = t.call("POST", api.FLUSH_CACHE)
    t.call("POST", api.CONTINUE, {})
    prefix = ctx.prompts[2] + tokens_and_logprobs(cut)[0][:-1]
    again = t.call("POST", api.GENERATE, generate_body("resumed", prefix, temperature=1.0,
                                                       max_new_tokens=16))
    head = f"update: {cell(update)}; flush: {cell(flush)}; prompt + partial again: "
    if again.status != 200:
        return head + cell(again)
    tokens, logprobs = tokens_and_logprobs(again)
    with torch.no_grad():
        ref = teacher_forced_logprobs(new_model, prefix, tokens, 1.0)
    gap = float((torch.tensor(logprobs) - ref).abs().max())
    return head + (f"200, {_spans(again)}, the new weights' log-probs after prompt + partial "
                   f"({'within' if gap <= LOGPROB_TOL else 'more than'} {LOGPROB_TOL:g})")


def probe_cut_and_resume(ctx: Context, model_dir: Path, new_dir: Path, new_model) -> List[Observed]:
    cut, resumed = {}, {}
    for t in ctx.both:
        cut[t.name], answer = _cut(ctx, t)
        resumed[t.name] = (_resume(ctx, t, answer, new_dir, new_model) if answer.status == 200
                           else "not run: the cut request did not answer")
        _restore(t, model_dir)
    return [same_row("pause_abort_cut", cut["real"], cut["stand-in"]),
            same_row("resume_after_update", resumed["real"], resumed["stand-in"])]


def _retract_then_update(ctx: Context, t: Target, model_dir: Path) -> str:
    worker, done = _long_request(t, "retracted", ctx.prompts[2])
    pause = t.call("POST", api.PAUSE, api.pause_payload("retract"))
    if pause.status != 200:
        t.call("POST", api.ABORT, {"rid": "retracted"})
        worker.join(120)
        return f"pause `retract`: {cell(pause)}"
    update = t.call("POST", api.UPDATE_FROM_DISK,
                    api.update_disk_payload(str(model_dir), weight_version="v3"), timeout_s=120)
    flush = t.call("POST", api.FLUSH_CACHE)
    t.call("POST", api.CONTINUE, {})
    worker.join(120)
    answer = done.get("retracted", Answer(None, error="no answer"))
    if answer.status != 200:
        return f"pause `retract`: {cell(pause)}; the request: {cell(answer)}"
    meta = answer.body["meta_info"]
    return (f"pause `retract`: {cell(pause)}; update: {cell(update)}; flush with it retracted: "
            f"{cell(flush)}; after continue the request ends `{meta['finish_reason']['type']}` "
            f"with {'all 500' if meta['completion_tokens'] == 500 else meta['completion_tokens']} "
            f"tokens, {_spans(answer)}, `num_retractions` {meta.get('num_retractions')}")


def _seconds_for(t: Target, ids: List[int], tokens: int) -> float:
    """How long ``t`` takes now for ``tokens`` greedy tokens of ``ids``: its pace on a machine
    that may be busy (a fixed wait let a loaded server stream none of a request's tokens)."""
    start = time.monotonic()
    t.call("POST", api.GENERATE, generate_body("pace", ids, temperature=0, max_new_tokens=tokens),
           timeout_s=120)
    return time.monotonic() - start


def _retract_then_abort(ctx: Context, t: Target) -> str:
    pace = _seconds_for(t, ctx.prompts[2], 60)
    worker, done = _long_request(t, "retracted2", ctx.prompts[2])
    time.sleep(max(RUN_BEFORE_S, 1.5 * pace))  # well over 50 tokens generated, at this pace
    pause = t.call("POST", api.PAUSE, api.pause_payload("retract"))
    if pause.status != 200:
        t.call("POST", api.ABORT, {"rid": "retracted2"})
        worker.join(120)
        return f"pause `retract`: {cell(pause)}"
    t.call("POST", api.ABORT, {"rid": "retracted2"})
    worker.join(120)
    t.call("POST", api.CONTINUE, {})
    answer = done.get("retracted2", Answer(None, error="no answer"))
    if answer.status != 200:
        return f"the request: {cell(answer)}"
    n = answer.body["meta_info"]["completion_tokens"]
    return (f"the request: 200, finish `{answer.body['meta_info']['finish_reason']['type']}` with "
            + (f"a multiple of 50 of its tokens ({'none' if n == 0 else 'some'}): what was "
               "streamed to the tokenizer" if n % 50 == 0 else f"{n} tokens"))


def probe_retract(ctx: Context, model_dir: Path) -> List[Observed]:
    updated, aborted = {}, {}
    for t in ctx.both:
        updated[t.name] = _retract_then_update(ctx, t, model_dir)
        aborted[t.name] = _retract_then_abort(ctx, t)
        _restore(t, model_dir)
    return [same_row("pause_retract", updated["real"], updated["stand-in"]),
            same_row("abort_retracted", aborted["real"], aborted["stand-in"])]


def _wait(seconds: float) -> str:
    """SGLang's pause sleeps a whole second before it looks again (``asyncio.sleep(1.0)``);
    what returns sooner did not wait for it. No finer buckets: on a loaded machine a pause that
    waits for nothing took 0.8 s (fresh clone 7), which a 0.5 s bucket called a difference."""
    return "1 s or more" if seconds >= 1.0 else "under 1 s"


def probe_pause_wait(ctx: Context) -> Observed:
    """How long ``/pause_generation {mode: abort}`` takes while a request runs, and after
    ``/abort_request {abort_all}`` with its answer already back (timed from the answer: fresh
    clone 26 timed the abort and its answer too, 1 s or more for the stand-in on the loaded
    machine, and the row differed)."""
    out, measured = {}, {}
    for t in ctx.both:
        worker, done = _long_request(t, "timed", ctx.prompts[2])
        t0 = time.monotonic()
        t.call("POST", api.PAUSE, api.pause_payload("abort"))
        direct = time.monotonic() - t0
        worker.join(120)
        t.call("POST", api.CONTINUE, {})
        worker, done = _long_request(t, "timed2", ctx.prompts[2])
        t.call("POST", api.ABORT, api.abort_payload(abort_all=True))
        worker.join(120)
        t0 = time.monotonic()  # the pause alone: the abort's round trip is not the row's question
        t.call("POST", api.PAUSE, api.pause_payload("abort"))
        first = time.monotonic() - t0
        t.call("POST", api.CONTINUE, {})
        measured[f"pause_s_{t.name}"], measured[f"abort_first_s_{t.name}"] = direct, first
        out[t.name] = (f"the pause: {_wait(direct)}; `abort_all`, its answer, then the pause: "
                       f"{_wait(first)}")
    return same_row("pause_wait", out["real"], out["stand-in"], **measured)
