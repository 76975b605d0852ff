"""Batched KV-cached decoding for the embedded engine: a lean Qwen3 / Qwen3-MoE path and HF's.

The embedded engine generates a few tokens at a time for a small model, so the cost of one decode
step is transformers' per-call machinery, not arithmetic: on the 4-layer tiny MoE (transformers
4.57) building the attention mask through ``vmap`` each step, the ``DynamicCache`` and the MoE
block's one-hot expert loop took most of a step (profile in docs/performance.md).
:class:`Qwen3Decoder` runs the same computation straight on the HF model's own parameters (so
weight loads into the HF model are seen at once), with a preallocated KV cache, a boolean mask
grown by one column per step, one argsort to group tokens by expert, and SDPA.

The math follows ``transformers/models/qwen3_moe/modeling_qwen3_moe.py`` (and ``qwen3``): RMSNorm
in fp32 cast back before the weight, per-head q/k RMSNorm before RoPE (cos/sin from the model's
own ``rotary_emb``, so every RoPE type it supports works), softmax routing in fp32, top-k
renormalised when ``norm_topk_prob``, experts summed in expert order. Log-probs match the HF
forward to float rounding (tests/test_rollout_embedded_kv_decoder.py).

Padding rows: prompts are left-padded; a padded query position may attend to itself so that no
softmax row is empty (its output is never used, and padded keys are masked for everyone else).

    decoder = make_decoder(hf_model)               # Qwen3Decoder, or HFDecoder for other models
    logits = decoder.prefill(input_ids, attention_mask, max_new_tokens)   # [B, V] last position
    logits = decoder.step(next_tokens, alive)                             # [B, V]
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


def lean_path_unsupported(model) -> Optional[str]:
    """Why :class:`Qwen3Decoder` cannot run ``model`` (None when it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no model.rotary_emb"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3MoeRMSNorm.forward: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """References to one decoder layer's parameters (never copies: weight loads stay visible)."""

    def __init__(self, layer, cfg) -> None:
        attn = layer.self_attn
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm, self.k_norm = attn.q_norm.weight, attn.k_norm.weight
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        mlp = layer.mlp
        self.moe = hasattr(mlp, "experts")
        if self.moe:
            self.gate = mlp.gate.weight
            self.top_k, self.norm_topk = mlp.top_k, mlp.norm_topk_prob
            self.experts = [(e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)
                            for e in mlp.experts]
        else:
            self.dense = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _mlp(x: torch.Tensor, weights) -> torch.Tensor:
    gate, up, down = weights
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _moe(layer: _Layer, x: torch.Tensor, routed: Optional[list] = None) -> torch.Tensor:
    """Top-k MoE over flat tokens ``x`` [T, H]: one sort groups the (token, slot) pairs by expert.
    ``routed``: a list that gets this layer's top-k expert ids [T, k] appended."""
    probs = F.softmax(F.linear(x, layer.gate), dim=1, dtype=torch.float)
    weights, experts = torch.topk(probs, layer.top_k, dim=-1)
    if routed is not None:
        routed.append(experts)
    if layer.norm_topk:
        weights /= weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype).flatten()
    flat_experts = experts.flatten()
    order = torch.argsort(flat_experts, stable=True)  # (token, slot) pairs, expert-major
    counts = torch.bincount(flat_experts, minlength=len(layer.experts)).tolist()
    token_of = order // layer.top_k
    routed = x.index_select(0, token_of)
    routed_w = weights.index_select(0, order).unsqueeze(-1)
    outputs: List[torch.Tensor] = []
    start = 0
    for e, count in enumerate(counts):
        if count:
            part = slice(start, start + count)
            outputs.append(_mlp(routed[part], layer.experts[e]) * routed_w[part])
            start += count
    out = torch.zeros_like(x)
    # index_add_ in expert order, as the HF block's per-expert loop accumulates.
    return out.index_add_(0, token_of, torch.cat(outputs))


class Qwen3Decoder:
    """Prefill + one-token steps of a HF Qwen3 / Qwen3-MoE causal LM, with a static KV cache."""

    def __init__(self, model, record_routing: bool = False) -> None:
        reason = lean_path_unsupported(model)
        if reason is not None:
            raise ValueError(f"Qwen3Decoder cannot run this model: {reason}")
        cfg = model.config
        self.model = model
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.layers = [_Layer(layer, cfg) for layer in model.model.layers]
        if record_routing and not all(layer.moe for layer in self.layers):
            raise ValueError("recording routed experts needs every layer to be MoE (as SGLang's "
                             "capture and the learner's replay assume)")
        self.record_routing = record_routing
        self._routing: List[torch.Tensor] = []
        """int16 [B, S, layers, top_k] of every forward (prefill, then one per step)."""
        self._k: List[torch.Tensor] = []
        self._v: List[torch.Tensor] = []

    # ---- one forward over S new positions ---------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 start: int) -> torch.Tensor:
        """Hidden states of the last position [B, H] after writing the cache at ``start``."""
        m = self.model.model
        x = m.embed_tokens(ids)  # [B, S, H]
        cos, sin = m.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, s, _ = x.shape
        end = start + s
        routed: Optional[list] = [] if self.record_routing else None
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln1, self.eps)
            q = _rms_norm(_linear(layer.q, h).view(b, s, self.num_heads, self.head_dim),
                          layer.q_norm, self.eps).transpose(1, 2)
            k = _rms_norm(_linear(layer.k, h).view(b, s, self.num_kv_heads, self.head_dim),
                          layer.k_norm, self.eps).transpose(1, 2)
            v = _linear(layer.v, h).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self._k[i][:, :, start:end] = k
            self._v[i][:, :, start:end] = v
            attn = F.scaled_dot_product_attention(q, self._k[i][:, :, :end], self._v[i][:, :, :end],
                                                  attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=self.num_kv_heads != self.num_heads)
            x = x + _linear(layer.o, attn.transpose(1, 2).reshape(b, s, -1))
            h = _rms_norm(x, layer.ln2, self.eps)
            if layer.moe:
                x = x + _moe(layer, h.reshape(b * s, -1), routed).view(b, s, -1)
            else:
                x = x + _mlp(h, layer.dense)
        if routed is not None:
            self._routing.append(torch.stack(routed, 1).view(b, s, len(routed), -1).to(torch.int16))
        return _rms_norm(x[:, -1], m.norm.weight, self.eps)

    def routed_experts(self) -> List[torch.Tensor]:
        """Per row, int16 ``[tokens fed, layers, top_k]``: the experts of every real position fed
        so far (prompt, then each appended token; padding and finished rows' filler left out),
        the order SGLang's ``routed_experts`` uses."""
        if not self.record_routing:
            raise RuntimeError("Qwen3Decoder was built without record_routing")
        every = torch.cat(self._routing, dim=1).cpu()  # [B, fed positions, layers, top_k]
        valid = self._valid[:, :every.shape[1]].cpu()
        return [every[i][valid[i]] for i in range(every.shape[0])]

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return _linear(self.model.lm_head, last_hidden)

    # ---- the decoding API ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        """Run left-padded prompts [B, P] (mask 1 = token); logits of the last position [B, V]."""
        b, p = input_ids.shape
        total = p + max_new_tokens
        dev, dtype = input_ids.device, self.model.model.embed_tokens.weight.dtype
        shape = (b, self.num_kv_heads, total, self.head_dim)
        self._k = [torch.empty(shape, dtype=dtype, device=dev) for _ in self.layers]
        self._v = [torch.empty(shape, dtype=dtype, device=dev) for _ in self.layers]
        self._valid = torch.zeros((b, total), dtype=torch.bool, device=dev)
        self._valid[:, :p] = attention_mask.bool()
        self._next_pos = attention_mask.sum(-1)  # position id of each row's next token
        self._len = p
        self._routing = []
        positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        causal = torch.ones((p, p), dtype=torch.bool, device=dev).tril_()
        mask = causal & self._valid[:, None, None, :p]
        mask |= torch.eye(p, dtype=torch.bool, device=dev)  # padded queries see themselves
        return self._logits(self._forward(input_ids, positions, mask, 0))

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Append one token per row [B] (``alive`` False: a finished row's padding); logits [B, V]."""
        cur = self._len
        if cur >= self._valid.shape[1]:
            raise RuntimeError("Qwen3Decoder.step: more steps than max_new_tokens given to prefill")
        self._valid[:, cur] = alive
        mask = self._valid[:, None, None, :cur + 1]
        positions = self._next_pos.unsqueeze(-1)
        self._next_pos = self._next_pos + alive.long()
        self._len = cur + 1
        return self._logits(self._forward(tokens.unsqueeze(-1), positions, mask, cur))


class HFDecoder:
    """The same API through the model's own forward and ``past_key_values`` (any HF causal LM)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        self._attention = attention_mask
        self._past = None
        return self._run(input_ids)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        self._attention = torch.cat([self._attention, alive.long().unsqueeze(-1)], dim=-1)
        return self._run(tokens.unsqueeze(-1))

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        positions = (self._attention.cumsum(-1) - 1).clamp_(min=0)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=self._attention, position_ids=positions,
                         past_key_values=self._past, use_cache=True)
        self._past = out.past_key_values
        return out.logits[:, -1, :]


def make_decoder(model, lean: bool = True, record_routing: bool = False):
    """:class:`Qwen3Decoder` when ``lean`` and the model is supported, else :class:`HFDecoder`.
    ``record_routing`` (R3) needs the lean path on a Qwen3-MoE model."""
    if record_routing:
        reason = lean_path_unsupported(model) or (None if lean else "lean_decode is off")
        if reason is not None:
            raise ValueError(f"recording routed experts needs the lean Qwen3-MoE decoder: {reason}")
        return Qwen3Decoder(model, record_routing=True)
    if lean:
        reason = lean_path_unsupported(model)
        if reason is None:
            return Qwen3Decoder(model)
        log.debug("embedded engine: HF forward path (%s)", reason)
    return HFDecoder(model)
