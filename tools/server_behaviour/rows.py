"""The hand-written half of docs/rollout.md's real-server table, and its rendering.

Each :class:`Row` says what is sent (``request``) and what we do about the answer
(``our_side``); ``differs`` gives the reason when the stand-in is known to behave otherwise (the
differential test asserts that those rows differ and every other row matches). The two middle
columns, the real server's and the stand-in's behaviour, are only ever written from a run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

BEGIN, END = "<!-- real server behaviour: begin -->", "<!-- real server behaviour: end -->"
HEADER = ("| request (the same to both) | real server, observed | stand-in, observed | our side |\n"
          "|---|---|---|---|")


@dataclass(frozen=True)
class Row:
    id: str
    request: str
    our_side: str = "-"
    differs: Optional[str] = None
    """Why the stand-in is allowed to behave otherwise; None: it must match."""


ROWS: List[Row] = [
    Row("dtype_auto", "`--dtype auto` on the float32 checkpoint (SGLang picks float16 for it, "
        "`srt/configs/model_config.py`); 16 greedy tokens from three prompts, scored by the float32 "
        "model",
        "launched servers get `--dtype` = the checkpoint's `config.json` dtype "
        "(`rollout.sglang.dtype`, null by default; `auto` to let SGLang choose)",
        "the stand-in has no `--dtype`: it serves float32"),
    Row("wrong_shape", "`lm_head.weight` one column short in `/update_weights_from_tensor` (paused, "
        "in a session); `_from_distributed` takes the same load path",
        "every bucket checked against the server's checkpoint (safetensors headers of "
        "`/server_info`'s `model_path`) before it is sent: `PayloadMismatch` naming the weight "
        "(`weight_sync/server_model.py`)",
        "stricter on purpose: it refuses where SGLang dies"),
    Row("unknown_name", "a weight the checkpoint lacks (`model.layers.9.mlp.gate.weight`) in "
        "`/update_weights_from_tensor`, then the first prompt's greedy answer again",
        "the same check", "stricter on purpose: it refuses what SGLang drops silently"),
    Row("release_memory", "`/release_memory_occupation` (all tags; SGLang synchronises CUDA there)",
        "colocated mode refused for `rollout.sglang.device=cpu` by config validation",
        "the stand-in refuses without `--enable-memory-saver` and releases with it (the colocated "
        "CPU tests)"),
    Row("killed_trainer", "what a trainer killed inside an update leaves: paused (`abort`), a "
        "session open, a gloo broadcast group joined; then the same group name again, and "
        "`/health_generate` (3 s)",
        "an engine attached to servers it did not start first ends a stale session and continues "
        "generation (`SGLangEngine.recover_servers`); broadcast groups carry a random per-process "
        "incarnation (`weight_update_group_<hex>[_pp<k>]`); the rendezvous fails at once with the "
        "server's message when a server refuses to join"),
    Row("get_weights_by_name", "`/get_weights_by_name` for `model.norm.weight` (SGLang's "
        "`Qwen3MoeForCausalLM` has no `get_weights_by_name`, its log says)",
        "weights are checked by log-probs, not read back (`rollout.weight_sync.verify`)",
        "the stand-in answers: the weight-sync tests read weights back through it"),
    Row("deterministic", "the same `sampling_seed` three times (temperature 1, 16 tokens); a server "
        "started with `--enable-deterministic-inference` (with the CPU engine's `torch_native` "
        "attention)",
        "refused by config validation for `device=cpu`; a run resumed against the real server is "
        "therefore checked to finish with every sync arriving, not to repeat an uninterrupted run "
        "token for token (the embedded engine's resume test does that)",
        "the stand-in honours seeds"),
    Row("flush_in_place", "while a long greedy request runs: `/flush_cache`, `/pause_generation "
        "{mode: in_place}`, `/flush_cache`; then continue and abort the request",
        "we pause with `abort`", "the stand-in emulates pause mode `abort` only"),
    Row("pause_abort_cut", "a long greedy request (500 tokens from `abc`) cut after 0.3 s by "
        "`/pause_generation {mode: abort}`",
        "with partial rollouts (`SGLangEngine.keep_partial_rollouts`) the engine keeps the "
        "tokens but the last, their log-probs and versions: SGLang samples the last one in the "
        "step that takes the abort and never checks it for EOS, a stop or the length "
        "(`Req.update_finish_state` returns at `to_finish`). Before pausing, the engine aborts "
        "its running requests itself (`/abort_request {abort_all}`) until they answered: the "
        "pause looks again only a second after aborting (`tokenizer_manager.pause_generation`)"),
    Row("pause_wait", "`/pause_generation {mode: abort}` 0.3 s into a long request; then "
        "`/abort_request {abort_all}`, the request's answer, and the pause",
        "the sync aborts its running requests first and waits for their answers "
        "(`FleetControl._cut_running`): SGLang's pause aborts, then looks again only a second "
        "later (`tokenizer_manager.pause_generation`: `asyncio.sleep(1.0)`). Measured on the "
        "real server with 16 samples in flight: 1.05 s per sync before, 0.06 s after",
        "the stand-in's pause returns as soon as nothing runs"),
    Row("resume_after_update", "then `/update_weights_from_disk` (other weights, "
        "`weight_version: v2`), `/flush_cache`, `/continue_generation`, and prompt + the partial "
        "less its last token sent again (16 new tokens, temperature 1)",
        "a partial rollout's next segment: the new weights recompute the KV of prompt + partial; "
        "`max_new_tokens` is what is left; each segment's spans are checked against the "
        "versions the engine served while it ran (`rollout/sglang/partial_rollout.py`)"),
    Row("pause_retract", "the same long request paused with `{mode: retract}`, the checkpoint "
        "loaded again as `v3`, `/flush_cache`, `/continue_generation`",
        "not used: a retracted request's partial response stays on its server (lost with it, "
        "bound to it, not saved by a trainer's checkpoint; next row); we pause with `abort` and "
        "resume from the client", "the stand-in emulates pause mode `abort` only"),
    Row("abort_retracted", "pause `retract` once ~90 tokens ran (0.3 s + 1.5x the server's time "
        "for 60 just before, at least 0.6 s), then `/abort_request` of the retracted "
        "request, `/continue_generation`",
        "why a trainer could not take a retracted partial response with it: the abort returns "
        "only what was streamed to the tokenizer (a non-streamed request every "
        "`SGLANG_FORCE_STREAM_INTERVAL` = 50 tokens, `scheduler_components/output_streamer.py`)",
        "the stand-in emulates pause mode `abort` only"),
    Row("r3_start", "a server started with `--enable-return-routed-experts` (R3), then a "
        "`return_routed_experts` request: SGLang pins its host buffer with `cudaHostRegister` "
        "(`srt/state_capturer/base.py`, `srt/mem_cache/pool_host/common.py`), which needs a CUDA "
        "driver",
        "R3 cannot be tested against the real server on CPU "
        "(`test_routed_experts_capture_needs_cuda_on_the_cpu_engine` keeps the evidence). With "
        "`algo.routing_replay=rollout` the launcher adds the flag, every `/generate` sets "
        "`return_routed_experts`, and `meta_info.routed_experts` (base64 of int32 `[prompt + "
        "output - 1, layers, top_k]`, `srt/managers/detokenizer_manager.py`) is decoded and "
        "checked per sample (`rollout/routed_experts.py`)",
        "the stand-in captures on CPU, in SGLang's format: the R3 tests run against it"),
    Row("r3_without_capture", "`return_routed_experts: true` to a server started without the "
        "capture (the field is `GenerateReqInput`'s, outside the `/generate` JSON contract)",
        "`MalformedRouting` naming the server, the request and the missing flag; not retried "
        "(`test_a_server_without_the_capture_takes_the_r3_request_and_our_client_refuses_its_answer`)"),
    Row("bucket_refused", "`/update_weights_from_distributed` outside a session: how a server "
        "whose session closed refuses bucket N of a broadcast update",
        "`BucketFailed` naming the update, the bucket and the server's message; over gloo the "
        "other servers receive the bucket and answer (measured with the real server and the "
        "stand-in in one group, `test_a_bucket_refused_by_one_server_ends_the_update_cleanly`), "
        "then each gets end session, `/flush_cache`, continue, each bounded by 30 s; `gspo-train` "
        "exits 5. Over NCCL the servers that took the bucket stay inside the collective until "
        "their group times out; the error names them (needs a GPU to observe)"),
    Row("shm_idle", "a launch; then 3 s idle, CPU seconds per second of the server's processes "
        "(above 0.1: spins, below 0.05: sleeps)",
        "`device=cpu` passes `--sleep-on-idle`; the test fixture removes the files its servers "
        "left", "the stand-in keeps nothing in `/dev/shm`"),
    Row("oov_token", "a token id outside the vocabulary (`1000000`) in `input_ids`",
        "not checked by the client: prompt ids come from the checkpoint's own tokenizer",
        "stricter on purpose: it refuses where SGLang dies"),
    Row("greedy", "`temperature: 0`, 16 tokens, three prompts (SGLang: the argmax, "
        "`log_softmax(logits)` as its log-prob)"),
    Row("fields", "the fields of the greedy answers, top level and `meta_info`",
        "`api.parse_generate_response` reads `output_ids`, `meta_info.output_token_logprobs`, "
        "`completion_tokens`, `finish_reason`, `weight_version`, `e2e_latency`, `id`"),
    Row("sampled_t1", "temperature 1, 12 tokens, three prompts x 2 seeds (not honoured by the "
        "real server); the stand-in's model scores the real server's tokens teacher-forced"),
    Row("sampled_t07", "the same at temperature 0.7 (log-probs of the temperature-scaled "
        "distribution on both)"),
    Row("session_rules", "`/end_weight_update` without a session, `/begin_weight_update` twice, "
        "`/end_weight_update`"),
    Row("tensor_outside_session", "`/update_weights_from_tensor` outside a session"),
    Row("destroy_unknown_group", "`/destroy_weights_update_group` for a group never made"),
    Row("unknown_route", "`GET /no_such_route`"),
    Row("wrong_method", "`GET /generate`"),
    Row("malformed_json", "`POST /generate` with `{not json`"),
    Row("wrong_type", "`sampling_params: {temperature: \"hot\"}`"),
    Row("unknown_sampling_key", "`sampling_params: {not_a_key: 1}`"),
    Row("unknown_field", "`return_logprobs: true` (a typo of `return_logprob`) at the top level",
        "the client sends only `api.GENERATE_FIELDS`",
        "stricter on purpose: a typo that loses the log-probs is refused"),
    Row("prompt_too_long", "a prompt as long as the context (512 tokens)"),
    Row("info", "`/model_info`, `/server_info`, `/health`, `/health_generate`",
        "the client reads `weight_version` and `model_path`"),
]
ROW_IDS = [r.id for r in ROWS]


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def render(cells: Dict[str, Tuple[str, str]]) -> str:
    """The table between the markers; ``cells``: row id -> (real, stand-in) as observed."""
    missing = [r.id for r in ROWS if r.id not in cells]
    if missing:
        raise KeyError(f"no observation for rows {missing}")
    lines = [BEGIN, HEADER]
    for row in ROWS:
        real, stand_in = cells[row.id]
        ours = row.our_side + (f". *Stand-in differs: {row.differs}.*" if row.differs else "")
        lines.append("| " + " | ".join(_escape(c) for c in (row.request, real, stand_in, ours)) + " |")
    lines.append(END)
    return "\n".join(lines)


def doc_cells(doc: str) -> Dict[str, Tuple[str, str]]:
    """The observed cells of the table in ``doc``, by row id (rows are in :data:`ROWS` order)."""
    start, end = doc.index(BEGIN), doc.index(END)
    lines = [ln for ln in doc[start:end].splitlines()[3:] if ln.startswith("|")]
    if len(lines) != len(ROWS):
        raise ValueError(f"the doc's table has {len(lines)} rows, ROWS has {len(ROWS)}: "
                         "rerun tools/real_server_behaviour.py")
    out = {}
    for row, line in zip(ROWS, lines):
        parts = [p.strip().replace("\\|", "|") for p in re.split(r"(?<!\\)\|", line)[1:-1]]
        out[row.id] = (parts[1], parts[2])
    return out


def replace_table(doc: str, table: str) -> str:
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + table + doc[end:]


def unexpected(observed) -> List[str]:
    """Observed rows whose sameness is not what :data:`ROWS` says: a difference not listed, or a
    listed one that is gone (then its ``differs`` goes too)."""
    differs = {r.id: r.differs for r in ROWS}
    return [f"{o.row}: real {o.real!r}, stand-in {o.stand_in!r}"
            + (" (listed as a known difference, but they match)" if differs[o.row] else "")
            for o in observed if o.same == bool(differs[o.row])]
