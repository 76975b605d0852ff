"""Activation memory of one micro-batch: per transformer layer, per recompute mode, and the
logits / log-prob pass on the last stage.

Counts, tensor by tensor, what autograd keeps for the backward pass in the two layer
implementations the learner builds (``model/provider.py``):

* ``local`` -- Megatron-Core's local spec with our RMSNorm (the CPU path). Checked tensor by
  tensor with ``torch.autograd.graph.saved_tensors_hooks`` on Megatron 0.16.1 and by measured
  peak memory (``docs/planner.md``): the attention is unfused (``DotProductAttention``: GQA keys
  and values expanded with ``repeat_interleave``, fp32 softmax probabilities ``[rows, heads,
  L, L]`` kept), SwiGLU keeps the fc1 output and two ``f``-wide tensors, every RMSNorm keeps its
  input, normalised output and ``rstd``; with SP each linear keeps its *local* input and
  all-gathers into a persistent global buffer (``tensor_parallel/layers.py``).
* ``te`` -- Transformer Engine (GPU): fused norm + linear, flash attention that keeps only
  q, k, v, the output and the softmax statistics (no ``L x L`` term), fused SwiGLU that keeps only
  its input; not measurable here, so derived from the same sources and compared with Megatron's
  own formula (``theoretical_memory_usage.py``: ``s*b*h*(18 + 4*f/h) / tp`` bytes per layer with
  selective recompute + SP) in ``docs/planner.md``.

Recompute (``model.recompute``): ``selective`` re-runs core attention in the backward
(Megatron's default ``recompute_modules=["core_attn"]``), so its probabilities / expanded K,V
are not kept; ``full`` (uniform, one layer per checkpoint) keeps only each layer's input and
rebuilds one layer at a time in the backward.

Units: *elements per token* unless named ``_bytes``. ``T`` is this rank's tokens of one
micro-batch after the CP split; tensors outside the TP regions are split over TP under SP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gspo_megatron.planner.model_shape import Layout, ModelShape

LOGPROB_CHUNK_TOKENS = 512
"""``algorithms/logprobs.py: DEFAULT_CHUNK_SIZE``: rows of the two fp32 work buffers."""
ROUTER_ELEMENTS_PER_EXPERT = 2.25
"""Router tensors kept per token and expert: fp32 logits and probabilities, a bool routing map."""


@dataclass(frozen=True)
class MicroBatchShape:
    """One micro-batch on one data-parallel rank (before the CP split)."""

    tokens: int
    """Tokens of the micro-batch, padding included (``batch.max_tokens_per_micro_batch``)."""
    seq_len: int
    """Longest sequence: the row length of the ``rows`` layout and the attention span."""
    response_tokens: int
    """Tokens whose log-prob is taken (prompt tokens are not)."""

    @property
    def rows(self) -> int:
        """Rows of the ``rows`` layout (local attention): ``tokens // seq_len``."""
        return max(1, self.tokens // self.seq_len)


@dataclass(frozen=True)
class LayerActivations:
    """Activation bytes of one transformer layer for one micro-batch."""

    saved_bytes: float
    """Kept from the forward until this layer's backward, per micro-batch in flight."""
    working_bytes: float
    """Extra while this layer runs its backward (full recompute rebuilds the layer here)."""


def _tokens(mb: MicroBatchShape, layout: Layout) -> float:
    return mb.tokens / layout.cp


def _attention_saved(shape: ModelShape, layout: Layout, mb: MicroBatchShape, kernel: str,
                     recompute: str) -> float:
    """Elements per token kept by the attention block (input norm to output projection)."""
    h, d, t = shape.hidden_size, shape.head_dim, layout.tp
    a, g = shape.num_attention_heads / t, shape.num_query_groups / t
    sp = t if layout.sp else 1
    if kernel == "te":
        # Fused norm+QKV keeps input, normalised input, rstd; q/k norms keep their inputs;
        # flash attention keeps q, k, v, output (= proj input) and fp32 softmax stats.
        norm_qkv = (2 * h + 1) / sp
        qk_norm = (a + g) * d + (a + g) if shape.qk_layernorm else 0
        core = (a + 2 * g) * d + a * d + 2 * a  # q, k, v after RoPE; output; LSE (fp32)
        return norm_qkv + (a + 2 * g) * d + qk_norm + core
    seq = mb.seq_len  # keys per query: local attention sees the whole row (CP all-gathers keys)
    norm = (2 * h + 1) / sp + h / sp  # RMSNorm (input, output, rstd) + QKV's local input
    qkv_out = (a + 2 * g) * d
    qk_norm = (2 * a * d + a) + (g * d + g) if shape.qk_layernorm else 0  # q copy+out, k out
    expanded = a != g
    if recompute == "selective":  # core attention re-run: only its inputs q', k' (v is a view)
        core = a * d + g * d
    else:
        core = a * d + (a * d if expanded else g * d) + (a * d if expanded else 0) + a * seq
    return norm + qkv_out + qk_norm + core + a * d  # + output projection's input


def _mlp_saved(shape: ModelShape, layout: Layout, kernel: str) -> float:
    """Elements per token kept by the MLP / MoE block (pre-MLP norm to fc2)."""
    h, t = shape.hidden_size, layout.tp
    sp = t if layout.sp else 1
    norm = (2 * h + 1) / sp + h / sp  # RMSNorm + fc1 / router local input
    # SwiGLU: local keeps fc1's output (2f), silu(gate), up + offset and the fc2 input (5f);
    # TE's fused swiglu keeps its input (2f) and the fc2 input (f).
    glu = 5 if kernel == "local" else 3
    if not shape.is_moe:
        return norm + glu * shape.ffn_hidden_size / t
    # Routed slots per rank, balanced routing: each rank's (SP-sharded) tokens * topk leave for
    # the experts' ranks and as many arrive; expert-TP ranks all see their group's tokens
    # (etp x), each holding f / etp of an expert. Per slot: the expert input (h) and the GLU.
    k, etp = shape.moe_router_topk, layout.etp
    f = shape.moe_ffn_hidden_size / etp
    router = ROUTER_ELEMENTS_PER_EXPERT * shape.num_experts / sp + 3 * k / sp
    return norm + router + k * etp * (h + glu * f) / sp


def _backward_transient(shape: ModelShape, layout: Layout, mb: MicroBatchShape,
                        kernel: str) -> float:
    """Elements per token a layer's backward allocates beyond what it frees: the incoming and
    residual gradients plus the larger of attention's (local: the probabilities' gradient and
    the softmax backward, both ``heads x L``) and the MLP's (the GLU's four ``f``-wide
    gradients, per routed slot for experts)."""
    h, d, t = shape.hidden_size, shape.head_dim, layout.tp
    sp = t if layout.sp else 1
    a, g = shape.num_attention_heads / t, shape.num_query_groups / t
    if kernel == "local":
        attention = 2 * a * mb.seq_len + 3 * a * d
    else:
        attention = 2 * (a + 2 * g) * d
    if shape.is_moe:
        mlp = shape.moe_router_topk * layout.etp * 4 * shape.moe_ffn_hidden_size / layout.etp / sp
    else:
        mlp = 4 * shape.ffn_hidden_size / t
    return 2 * h / sp + max(attention, mlp)


def layer_activations(shape: ModelShape, layout: Layout, mb: MicroBatchShape, kernel: str,
                      recompute: str, act_bytes: int) -> LayerActivations:
    """Bytes one transformer layer keeps per micro-batch, and its backward working set."""
    tokens = _tokens(mb, layout)
    attn_mode = "selective" if recompute == "selective" else "none"
    per_token = _attention_saved(shape, layout, mb, kernel, attn_mode) + \
        _mlp_saved(shape, layout, kernel)
    transient = _backward_transient(shape, layout, mb, kernel) * tokens * act_bytes
    if recompute == "full":  # the layer is rebuilt, then backpropagated
        sp = layout.tp if layout.sp else 1
        return LayerActivations(saved_bytes=shape.hidden_size / sp * tokens * act_bytes,
                                working_bytes=per_token * tokens * act_bytes + transient)
    return LayerActivations(saved_bytes=per_token * tokens * act_bytes, working_bytes=transient)


def rope_bytes(shape: ModelShape, mb: MicroBatchShape) -> float:
    """Per layer, local path: cos/sin of the row positions kept by the q and k RoPE products."""
    return 4 * mb.seq_len * shape.head_dim * 4


def attention_buffer_bytes(shape: ModelShape, layout: Layout, mb: MicroBatchShape, kernel: str,
                           act_bytes: int) -> float:
    """Megatron's persistent ``GlobalMemoryBuffer`` (local path): the baddbmm input of the
    attention scores and, under SP, the all-gathered linear input; sized by the largest use."""
    if kernel != "local":
        return 0.0
    tokens = _tokens(mb, layout)
    scores = mb.rows * shape.num_attention_heads / layout.tp * mb.seq_len * mb.seq_len / layout.cp
    gathered = tokens * shape.hidden_size if layout.sp else 0
    return max(scores, gathered) * act_bytes


def logits_bytes(shape: ModelShape, layout: Layout, mb: MicroBatchShape, act_bytes: int) -> float:
    """Last stage, the larger of the log-prob pass's two moments on ``V/tp``-wide rows
    (``learner/forward.py: response_logprobs``, ``algorithms/logprobs.py``):

    * forward: the ``[T, V]`` logits, the ``N`` response rows picked from them, their
      padded-vocabulary-masked copy, and two fp32 ``[chunk, V]`` work buffers;
    * backward of the row pick (``index_select``): the ``[N, V]`` gradient plus
      ``zeros([T, V]).index_add(...)``, which is out of place: two ``[T, V]`` tensors.
    """
    tokens = _tokens(mb, layout)
    n = mb.response_tokens / layout.cp
    v_local = shape.padded_vocab(layout.tp) / layout.tp
    masked_copy = n if shape.padded_vocab(layout.tp) > shape.vocab_size else 0
    chunk = min(LOGPROB_CHUNK_TOKENS, math.ceil(n / 4))
    forward = (tokens + n + masked_copy) * v_local * act_bytes + 2 * chunk * v_local * 4
    backward = (2 * tokens + n) * v_local * act_bytes
    return max(forward, backward)


def final_norm_bytes(shape: ModelShape, layout: Layout, mb: MicroBatchShape,
                     act_bytes: int) -> float:
    """Last stage: final RMSNorm (input, output, rstd) and the output layer's local input."""
    sp = layout.tp if layout.sp else 1
    return ((2 * shape.hidden_size + 1) + shape.hidden_size) / sp * _tokens(mb, layout) * act_bytes


def in_flight_micro_batches(layout: Layout, stage: int, num_micro_batches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B (``pp - stage``,
    capped by the micro-batch count); interleaving multiplies by Megatron's penalty
    ``1 + (pp - 1) / (pp * vpp)`` (``theoretical_memory_usage.py``)."""
    if layout.pp == 1:
        return 1.0
    n = float(min(layout.pp - stage, num_micro_batches))
    if layout.vpp:
        n *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return n
