"""Embedded rollout engine: generation in-process with transformers (the CPU default).

Holds the Hugging Face form of the current policy (loaded from a directory, or an in-memory
``PreTrainedModel`` + tokenizer), generates batches of prompts with a KV cache and left
padding, and reports per-token log-probs (semantics in :mod:`rollout.embedded.sampling`). Each sample
draws from its own generator seeded by (seed, prompt_id, sample_index), so the same seed gives
the same samples for any batch size. New weights arrive by HF name through
:meth:`load_weights` (the in-process transport) or :meth:`load_weights_from_disk` (the disk
transport); ``engine.update_weights`` needs one attached (weight_sync.build_transport).

    engine = EmbeddedEngine.from_pretrained("path/to/hf_dir")
    samples = engine.generate([GenerationRequest("p0", ids, n=4)], SamplingParams(seed=1))
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gspo_megatron.rollout.embedded.kv_decoder import make_decoder
from gspo_megatron.rollout.embedded.sampling import (LOGPROB_MODES, draw_tokens, make_generators,
                                            process_logits, select_logprobs)
from gspo_megatron.rollout.types import (GenerationRequest, NamedTensors, RolloutEngine, Sample,
                                         SamplingParams, WeightSyncStats, expand_requests,
                                         sample_seed)

log = logging.getLogger(__name__)


@dataclass
class GeneratedRow:
    """One generated response, before it becomes a :class:`Sample`."""

    tokens: List[int]
    logprobs: List[float]
    finish_reason: Optional[str] = None
    matched: object = None
    """The EOS / stop id or stop string that ended the response (SGLang's ``matched``)."""
    routing: Optional[torch.Tensor] = None
    """With ``record_routing``: int16 [prompt + response - 1, layers, top_k] (R3)."""


class EmbeddedEngine(RolloutEngine):
    """Rollouts with a transformers causal LM living in this process."""

    def __init__(self, model, tokenizer=None, max_batch_size: int = 256,
                 logprob_mode: str = "scaled", weight_version: Optional[str] = None,
                 lean_decode: bool = True, record_routing: bool = False) -> None:
        super().__init__()
        if logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {logprob_mode!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.logprob_mode = logprob_mode
        self.weight_version = weight_version
        self.lean_decode = lean_decode
        """Decode Qwen3 / Qwen3-MoE with :class:`Qwen3Decoder` (False: the model's HF forward)."""
        self.record_routing = record_routing
        """Return each sample's routed experts (R3; the lean decoder on a Qwen3-MoE model)."""
        if record_routing:
            make_decoder(self.model, lean=lean_decode, record_routing=True)  # refuses early
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()  # one forward pass / weight load at a time
        self._eos_ids = self._find_eos_ids()
        self._pad_id = self._find_pad_id()

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", **kwargs) -> "EmbeddedEngine":
        """Load model and tokenizer from an HF directory (``config.json`` + safetensors)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, **kwargs)

    # --- generation -------------------------------------------------------------------------
    def _find_eos_ids(self) -> Tuple[int, ...]:
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)

    def _find_pad_id(self) -> int:
        for source in (self.tokenizer, self.model.generation_config):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return self._eos_ids[0] if self._eos_ids else 0

    def _generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> List[Sample]:
        work = expand_requests(requests)
        samples: List[Sample] = []
        for start in range(0, len(work), self.max_batch_size):
            chunk = work[start:start + self.max_batch_size]
            t0 = time.perf_counter()
            rows = self.generate_token_ids(
                [list(req.prompt_token_ids) for req, _ in chunk],
                [sample_seed(params.seed, req.prompt_id, idx) for req, idx in chunk], params)
            latency = time.perf_counter() - t0
            samples.extend(Sample(prompt_id=req.prompt_id, sample_index=idx,
                                  prompt_token_ids=list(req.prompt_token_ids),
                                  response_token_ids=r.tokens, response_logprobs=r.logprobs,
                                  finish_reason=r.finish_reason or "length", latency_s=latency,
                                  weight_version=self.weight_version, routed_experts=r.routing)
                           for (req, idx), r in zip(chunk, rows))
        return samples

    def generate_token_ids(self, prompts: List[List[int]], seeds: List[Optional[int]],
                           params: SamplingParams,
                           should_stop: Optional[Callable[[], Sequence[bool]]] = None,
                           abort_takes_a_step: bool = False) -> List[GeneratedRow]:
        """Generate one response per prompt, row i drawing from a generator seeded ``seeds[i]``.

        ``should_stop`` (one batch at a time): called before every decoding step, returns one flag
        per row; a flagged row ends with finish reason ``abort`` (cancellation, as SGLang's
        abort_request), keeping the tokens it has. ``abort_takes_a_step``: as SGLang ends a
        running request it aborts, the flagged row first takes this step's token, appended
        without the EOS / stop / length checks (SGLang 0.5.23: ``Req.update_finish_state``
        returns at ``to_finish`` before them).
        """
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass one to EmbeddedEngine")
        if should_stop is not None and len(prompts) > self.max_batch_size:
            raise ValueError("should_stop needs the prompts in one batch (max_batch_size)")
        out: List[GeneratedRow] = []
        for start in range(0, len(prompts), self.max_batch_size):
            end = start + self.max_batch_size
            with self._lock:
                out.extend(self._generate_rows(prompts[start:end], seeds[start:end], params,
                                               should_stop, abort_takes_a_step))
        return out

    @torch.no_grad()
    def _generate_rows(self, prompts: List[List[int]], seeds: List[Optional[int]],
                       params: SamplingParams,
                       should_stop: Optional[Callable[[], Sequence[bool]]] = None,
                       abort_takes_a_step: bool = False) -> List[GeneratedRow]:
        rows = [GeneratedRow([], []) for _ in prompts]
        gens = make_generators(seeds)
        input_ids, attention = self._left_pad(prompts)
        stop_ids = set(self._eos_ids) | set(params.stop_token_ids)
        decoder = make_decoder(self.model, lean=self.lean_decode,
                               record_routing=self.record_routing)
        logits = decoder.prefill(input_ids, attention, params.max_new_tokens)
        for _ in range(params.max_new_tokens):
            cut = [False] * len(rows)
            if should_stop is not None:
                for i, (row, stop) in enumerate(zip(rows, should_stop())):
                    if stop and row.finish_reason is None and abort_takes_a_step:
                        cut[i] = True
                    elif stop and row.finish_reason is None:
                        row.finish_reason = "abort"
                if all(r.finish_reason is not None for r in rows):
                    break
            scaled, sampling = process_logits(logits, params.temperature, params.top_p)
            tokens = draw_tokens(sampling, gens)
            lps = select_logprobs(scaled, sampling, tokens, self.logprob_mode)
            for row, tok, lp, last in zip(rows, tokens.tolist(), lps.tolist(), cut):
                if row.finish_reason is None and last:  # unchecked, as SGLang's abort step
                    row.tokens.append(tok)
                    row.logprobs.append(lp)
                    row.finish_reason = "abort"
                elif row.finish_reason is None:
                    self._append(row, tok, lp, stop_ids, params)
            alive = [r.finish_reason is None for r in rows]
            if not any(alive):
                break
            alive_t = torch.tensor(alive, device=self.device)
            logits = decoder.step(torch.where(alive_t, tokens, self._pad_id), alive_t)
        if self.record_routing:  # an aborted row's last token was fed too: keep P + R - 1
            for row, prompt, routing in zip(rows, prompts, decoder.routed_experts()):
                row.routing = routing[:len(prompt) + len(row.tokens) - 1].clone()
        return rows

    def _append(self, row: GeneratedRow, tok: int, lp: float, stop_ids: set,
                params: SamplingParams) -> None:
        row.tokens.append(tok)
        row.logprobs.append(lp)
        if tok in stop_ids:
            row.finish_reason, row.matched = "stop", tok
            return
        if params.stop:
            # a stop string of L characters ends within the last L tokens (each token decodes to
            # at least one character); a few extra tokens cover multi-token characters
            window = max(len(s) for s in params.stop) + 8
            text = self.tokenizer.decode(row.tokens[-window:])
            hit = next((s for s in params.stop if s in text), None)
            if hit is not None:
                row.finish_reason, row.matched = "stop", hit
                return
        if len(row.tokens) >= params.max_new_tokens:
            row.finish_reason = "length"

    def _left_pad(self, prompts: List[List[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    # --- weights ----------------------------------------------------------------------------
    def load_weights(self, named_tensors: NamedTensors) -> WeightSyncStats:
        """Copy tensors into the parameters of the same HF name (dtype cast, shape checked)."""
        targets: Dict[str, torch.Tensor] = self.model.state_dict(keep_vars=True)
        stats = WeightSyncStats()
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise KeyError(f"weight {name!r} is not a parameter of the rollout model "
                                   f"({type(self.model).__name__})")
                target = targets[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match "
                                     f"the rollout model's {tuple(target.shape)}")
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
                stats.num_tensors += 1
                stats.num_bytes += tensor.numel() * tensor.element_size()
        stats.seconds = time.perf_counter() - t0
        return stats

    def load_weights_from_disk(self, path: str) -> WeightSyncStats:
        """Load every ``*.safetensors`` file under ``path`` (a directory or one file)."""
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
        if not files or not all(os.path.isfile(f) for f in files):
            raise FileNotFoundError(f"{path}: no .safetensors files to load")
        total = WeightSyncStats(num_buckets=len(files))  # one file, one bucket
        t0 = time.perf_counter()
        for f in files:
            part = self.load_weights(load_file(f).items())
            total.num_tensors += part.num_tensors
            total.num_bytes += part.num_bytes
        total.seconds = time.perf_counter() - t0
        return total

    # --- memory and lifecycle ---------------------------------------------------------------
    def release_memory(self) -> None:
        """On GPU, move the model to host memory; a no-op on CPU (the KV cache lives only
        during a generate call)."""
        if self.device.type == "cuda":
            with self._lock:
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            with self._lock:
                self.model.to(self.device)

    def health(self) -> bool:
        return self.model is not None


@torch.no_grad()
def teacher_forced_logprobs(model, prompt_ids: Sequence[int], response_ids: Sequence[int],
                            temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` of each response token, one forward pass -> float32 [R]."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long,
                       device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1)
