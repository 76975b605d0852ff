"""The probes: one request sequence per row, sent alike to the real server and to the stand-in.

Each probe returns :class:`Observed` rows: one table cell per server, written from what the
server answered (status, the body's fields, a message, whether the process died and the last
exception its log gained), whether the two behave the same, and the numbers measured on the way
(the JSON artifact keeps them; cells hold only what repeats from run to run).

Log-probs (fp32 checkpoint, CPU, both servers): ``LOGPROB_TOL``.

* greedy (``temperature: 0``, SGLang's greedy: the argmax token, ``log_softmax(logits)`` as its
  log-prob): the same request to both, token ids must be equal and log-probs within the bound;
* sampled: the real server on CPU does not honour ``sampling_seed`` (deterministic inference is
  refused with its ``torch_native`` attention, row ``deterministic``), so its tokens cannot be
  reproduced by the stand-in. What is compared instead: the stand-in's model (the same
  checkpoint loaded as the stand-in loads it, ``EmbeddedEngine.from_pretrained``) scores the
  real server's sampled tokens teacher-forced, ``log_softmax(logits / T)``, and those log-probs
  must equal the ones the real server returned within the bound (SGLang scales by the
  temperature before its log-softmax, as the stand-in and the learner do). The stand-in gets the
  same requests too and must answer them (200).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs
from gspo_megatron.rollout.sglang import api
from tools.server_behaviour.servers import Answer, Target

LOGPROB_TOL = 1e-5
"""Bound on |log-prob difference| between the servers (fp32). Both run the same float32
weights through pure-torch CPU kernels; what differs is the order of a few reductions
(attention, the MoE sum, the log-softmax), each ~1e-7 relative at fp32, on log-probs of
magnitude ~4: a few 1e-7 at worst. The bound leaves an order of magnitude over that, and stays
an order of magnitude under what a real discrepancy gives (float16 serving: ~1e-4)."""
PROMPTS = ("1+2=", "hello", "abc")
HEALTH_WAIT_S = 3.0
"""How long ``/health_generate`` is given while generation is paused (it waits at the gate)."""


@dataclass
class Observed:
    """One row of the table, as observed."""

    row: str
    real: str
    stand_in: str
    same: bool
    measured: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    """What every probe needs: both servers, the checkpoint's model and the prompts' ids."""

    real: Target
    stand_in: Target
    model: Any
    prompts: List[List[int]]
    greedy: Dict[str, List[List[int]]] = field(default_factory=dict)
    """Each server's greedy tokens per prompt (the ``unknown_name`` probe checks them again)."""

    @property
    def both(self) -> Tuple[Target, Target]:
        return self.real, self.stand_in


def generate_body(rid: str, ids: Sequence[int], **sampling) -> Dict[str, Any]:
    params = {"max_new_tokens": 8, "no_stop_trim": True, "skip_special_tokens": False, **sampling}
    return {"rid": rid, "input_ids": list(ids), "sampling_params": params, "return_logprob": True,
            "stream": False}


def shorten(text: str, limit: int = 90) -> str:
    text = text.replace("\n", " ").strip()
    return text if len(text) <= limit else text[:limit - 1] + "…"


def cell(answer: Answer, with_message: bool = True) -> str:
    """An answer as a table cell: status, body fields, and (short) message."""
    if answer.status is None:
        return answer.error
    text = f"{answer.status} `{answer.shape}`"
    if with_message and answer.message and answer.status >= 400:
        text += ": " + shorten(answer.message)
    return text


def same_row(row: str, real: str, stand_in: str, **measured) -> Observed:
    return Observed(row, real, stand_in, real == stand_in, dict(measured))


def died(target: Target) -> str:
    """``**dies**`` and the exception that its log gained (or that it lives on)."""
    if not target.wait_dead(30.0):
        return "lives on"
    exc = target.log_exception()
    return f"**dies**: {shorten(exc, 120)}" if exc else "**dies**"


def tokens_and_logprobs(answer: Answer) -> Tuple[List[int], List[float]]:
    result = api.parse_generate_response(answer.body)
    return result.token_ids, result.logprobs


# --- generation --------------------------------------------------------------------------

def probe_greedy(ctx: Context) -> List[Observed]:
    answers = {t.name: [t.call("POST", api.GENERATE, generate_body(f"greedy{i}", ids, temperature=0,
                                                                   max_new_tokens=16))
                        for i, ids in enumerate(ctx.prompts)] for t in ctx.both}
    real, stand_in = answers["real"], answers["stand-in"]
    statuses = {a.status for a in real + stand_in}
    if statuses != {200}:
        return [Observed("greedy", cell(real[0]), cell(stand_in[0]), False)]
    got = {name: [tokens_and_logprobs(a) for a in ans] for name, ans in answers.items()}
    ctx.greedy = {name: [t for t, _ in pairs] for name, pairs in got.items()}
    equal = ctx.greedy["real"] == ctx.greedy["stand-in"]
    gap = max((abs(x - y) for (_, a), (_, b) in zip(got["real"], got["stand-in"])
               for x, y in zip(a, b)), default=float("inf"))
    ok = equal and gap <= LOGPROB_TOL
    si = (f"200: the same tokens, log-probs within {LOGPROB_TOL:g}" if ok else
          f"200: {'the same tokens' if equal else 'other tokens'}, log-probs off by {gap:.1e}")
    return [Observed("greedy", "200: the argmax tokens and their log-probs", si, ok,
                     {"greedy_max_abs_logprob_diff": gap, "tokens_equal": equal}),
            fields_row(real[0], stand_in[0])]


def fields_row(real: Answer, stand_in: Answer) -> Observed:
    """The fields of a ``/generate`` answer (top level and ``meta_info``) on both servers."""
    def fields(answer: Answer) -> set:
        body = answer.body
        return set(body) | {f"meta_info.{k}" for k in body.get("meta_info", {})}

    r, s = fields(real), fields(stand_in)

    def text(own: set, other: set) -> str:
        out = f"{len(own)} fields"
        if other - own:
            out += ", lacks " + ", ".join(f"`{k}`" for k in sorted(other - own))
        return out

    return Observed("fields", text(r, s), text(s, r), r == s, {"fields": sorted(r)})


def probe_sampled(ctx: Context, temperature: float, row: str) -> Observed:
    gaps, answers = [], {}
    for t in ctx.both:
        answers[t.name] = [t.call("POST", api.GENERATE, generate_body(
            f"{row}-{i}-{j}", ids, temperature=temperature, max_new_tokens=12, sampling_seed=j))
            for i, ids in enumerate(ctx.prompts) for j in range(2)]
    if {a.status for ans in answers.values() for a in ans} != {200}:
        return Observed(row, cell(answers["real"][0]), cell(answers["stand-in"][0]), False)
    prompts = [ids for ids in ctx.prompts for _ in range(2)]
    with torch.no_grad():
        for ids, answer in zip(prompts, answers["real"]):
            tokens, logprobs = tokens_and_logprobs(answer)
            ref = teacher_forced_logprobs(ctx.model, ids, tokens, temperature)
            gaps.append(float((torch.tensor(logprobs) - ref).abs().max()))
    gap = max(gaps)
    ok = gap <= LOGPROB_TOL
    si = (f"200; on the real server's tokens, teacher-forced: log-probs within {LOGPROB_TOL:g}"
          if ok else f"200; on the real server's tokens: log-probs off by {gap:.1e}")
    return Observed(row, "200: sampled tokens and their log-probs", si, ok,
                    {f"{row}_max_abs_logprob_diff": gap})


def probe_seed(ctx: Context) -> Observed:
    """The same ``sampling_seed`` three times: the same tokens only where the seed is honoured
    (unseeded, three draws agree only if all stop at the same EOS: ~1e-5 on the tiny model)."""
    out = {}
    for t in ctx.both:
        runs = [t.call("POST", api.GENERATE, generate_body(f"seed{k}", ctx.prompts[0],
                                                            temperature=1.0, max_new_tokens=16,
                                                            sampling_seed=7)) for k in range(3)]
        tokens = [tokens_and_logprobs(a)[0] for a in runs]
        out[t.name] = ("same `sampling_seed` three times: " +
                       ("the same tokens" if tokens[0] == tokens[1] == tokens[2]
                        else "different tokens"))
    return same_row("deterministic", out["real"], out["stand-in"])


def probe_routed_experts_without_capture(ctx: Context) -> Observed:
    out = {}
    for t in ctx.both:
        a = t.call("POST", api.GENERATE, dict(generate_body("r3", ctx.prompts[0]),
                                              return_routed_experts=True))
        out[t.name] = cell(a) if a.status != 200 else (
            "200 " + ("with" if "routed_experts" in a.body["meta_info"] else "without") +
            " `meta_info.routed_experts`")
    return same_row("r3_without_capture", out["real"], out["stand-in"])


# --- refusals and plain requests -------------------------------------------------------------

def simple_rows(ctx: Context) -> List[Observed]:
    """One request each, the same to both: the answer's status, fields and message."""
    ok = generate_body("simple", ctx.prompts[0])
    cases: List[Tuple[str, str, str, Any, Optional[bytes], bool]] = [
        ("unknown_route", "GET", "/no_such_route", None, None, True),
        ("wrong_method", "GET", api.GENERATE, None, None, True),
        ("malformed_json", "POST", api.GENERATE, None, b"{not json", False),
        ("wrong_type", "POST", api.GENERATE,
         dict(ok, sampling_params={"temperature": "hot"}), None, True),
        ("unknown_sampling_key", "POST", api.GENERATE,
         dict(ok, sampling_params={"not_a_key": 1}), None, True),
        ("prompt_too_long", "POST", api.GENERATE, dict(ok, input_ids=[5] * 512), None, True),
        ("tensor_outside_session", "POST", api.UPDATE_FROM_TENSOR,
         api.update_tensor_payload([""]), None, True),
        ("bucket_refused", "POST", api.UPDATE_FROM_DISTRIBUTED,
         api.update_distributed_payload(["model.norm.weight"], ["float32"], [[64]]), None, True),
        ("destroy_unknown_group", "POST", api.DESTROY_GROUP, {"group_name": "no_such_group"},
         None, True),
        ("get_weights_by_name", "POST", api.GET_WEIGHTS_BY_NAME,
         {"name": "model.norm.weight", "truncate_size": 3}, None, True),
    ]
    rows = []
    for row, method, path, body, raw, with_message in cases:
        real, stand_in = (cell(t.call(method, path, body, raw), with_message) for t in ctx.both)
        rows.append(same_row(row, real, stand_in))
    rows.append(_typo_row(ctx, ok))
    rows.append(_info_row(ctx))
    return rows


def _typo_row(ctx: Context, ok: Dict[str, Any]) -> Observed:
    """A top-level field SGLang does not know (``return_logprobs``, a typo of ``return_logprob``)."""
    body = {k: v for k, v in ok.items() if k != "return_logprob"}
    out = {}
    for t in ctx.both:
        a = t.call("POST", api.GENERATE, dict(body, return_logprobs=True))
        out[t.name] = cell(a) if a.status != 200 else (
            "200, " + ("with" if "output_token_logprobs" in a.body["meta_info"] else "without") +
            " log-probs: the field is ignored")
    return same_row("unknown_field", out["real"], out["stand-in"])


def _info_row(ctx: Context) -> Observed:
    """The fields the client reads from ``/model_info`` and ``/server_info``, and health."""
    def with_fields(answer: Answer, keys: Tuple[str, ...]) -> str:
        present = isinstance(answer.body, dict) and all(k in answer.body for k in keys)
        return f"{answer.status}" + (" with " + ", ".join(f"`{k}`" for k in keys) if present else "")

    out = {}
    for t in ctx.both:
        model, server = t.call("GET", api.MODEL_INFO), t.call("GET", api.SERVER_INFO)
        health = [str(t.call("GET", p).status) for p in (api.HEALTH, api.HEALTH_GENERATE)]
        out[t.name] = (f"`/model_info` {with_fields(model, ('weight_version', 'model_path'))}; "
                       f"`/server_info` {with_fields(server, ('model_path',))}; "
                       f"`/health`, `/health_generate` {', '.join(health)}")
    return same_row("info", out["real"], out["stand-in"])


def probe_session_rules(ctx: Context) -> Observed:
    out = {}
    for t in ctx.both:
        steps = [("end", api.END_UPDATE), ("begin", api.BEGIN_UPDATE),
                 ("begin again", api.BEGIN_UPDATE), ("end", api.END_UPDATE)]
        out[t.name] = "; ".join(f"{what}: {cell(t.call('POST', path, {}))}" for what, path in steps)
    return same_row("session_rules", out["real"], out["stand-in"])


def probe_flush_while_running(ctx: Context) -> Observed:
    """A long greedy request runs; flush, pause ``in_place``, flush again, continue, abort it."""
    out = {}
    for t in ctx.both:
        done: Dict[str, Answer] = {}
        # greedy from "abc" runs its whole length (~2 s on either server): the argmax never is EOS
        long = generate_body("long", ctx.prompts[2], temperature=0, max_new_tokens=500)
        worker = threading.Thread(target=lambda: done.setdefault(
            "long", t.call("POST", api.GENERATE, long, timeout_s=120)), name="probe-long-request")
        worker.start()
        time.sleep(0.3)
        if not worker.is_alive():
            out[t.name] = "the long request ended before the flush: the probe is void"
            continue
        steps = [("flush", t.call("POST", api.FLUSH_CACHE)),
                 ("pause `in_place`", t.call("POST", api.PAUSE, {"mode": "in_place"})),
                 ("flush", t.call("POST", api.FLUSH_CACHE))]
        t.call("POST", api.CONTINUE, {})
        t.call("POST", api.ABORT, {"rid": "long"})
        worker.join(timeout=120)
        finish = done["long"].body["meta_info"]["finish_reason"]["type"] if "long" in done else "?"
        out[t.name] = "; ".join(f"{w}: {cell(a)}" for w, a in steps) + f"; the request: {finish}"
    return same_row("flush_in_place", out["real"], out["stand-in"])
