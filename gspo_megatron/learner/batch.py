"""The typed batch the trainer hands the learner, and how it becomes packed micro-batches.

Rollouts are variable-length. Instead of padding every sequence to the longest one, the learner

1. splits the mini-batch across data-parallel ranks so each rank gets about the same number of
   *tokens* (longest-first greedy onto the lightest rank; every rank computes the same split from
   the same mini-batch, so no communication is needed; ``learner/packing.py``),
2. packs each rank's share into micro-batches of at most ``max_tokens_per_micro_batch`` tokens
   (dynamic batch size; first-fit-decreasing; ``learner/packing.py``), and
3. lays each micro-batch out in one of two layouts:

   - ``packed`` (Transformer Engine): *one* row ``[1, S]`` of concatenated sequences with
     ``cu_seqlens`` boundaries; TE attends per sequence through packed-sequence (THD) metadata.
   - ``rows`` (Megatron's local attention, i.e. CPU): ``[R, L]``, one sequence per row padded to
     the step's longest sequence ``L``, ``R = max_tokens // L`` rows per micro-batch, and a plain
     causal mask. The local attention has no THD support, and the block-diagonal ``[S, S]`` mask
     that would emulate it costs ``O(S^2)`` for sequences of ``O(L)`` tokens: measured 2-3x
     slower per step on the tiny CPU run. Row positions are the per-sequence positions, so RoPE
     is exact, and padding sits at the end of a row where causal queries never look.

Every micro-batch of a step has the same shape (``S``, or ``R x L``: the longest packed
micro-batch or sequence on any rank, rounded up to ``pad_multiple``), and every rank runs the
same number of micro-batches (short ranks get empty, fully masked ones). Pipeline schedules send fixed-shape activations and
the expert dispatcher gathers across ranks, so this uniformity is what lets one step run on every
layout; the cost is padding only at the tail of micro-batches.

Context parallelism (``cp_size > 1``): rows are padded to a multiple of ``2 * cp`` (packed: every
sequence is, ``cu_seqlens_padded``), the full micro-batch is built as above, and then
:func:`shard_micro_batch` keeps this CP rank's load-balanced chunks (which ones:
``distributed/context_parallel.py``). Labels are taken from the full row first, so the next token
of a chunk's last position is right; the share also carries the *full* response length of every
sequence and each local token's index inside its response, which the loss and the log-prob
gather need. ``StepPlan.padded_len`` stays the *full* length (Megatron divides by CP).

Only response tokens carry loss: the log-prob of token ``j`` comes from position ``j - 1``, so a
sequence with prompt length ``P`` and length ``L`` contributes positions ``P-1 .. L-2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Union

import torch

from gspo_megatron.distributed.context_parallel import (load_balanced_causal_mask,
                                                       load_balanced_indices, padded_boundaries,
                                                       response_token_index,
                                                       thd_partition_indices)
from gspo_megatron.learner.packing import pack_by_tokens, split_across_dp

TokenList = Union[Sequence[int], torch.Tensor]

_PER_TOKEN_FIELDS = ("old_logprobs", "rollout_logprobs", "ref_logprobs", "token_lags")
"""SequenceBatch fields with exactly one value per response token of every sequence."""


@dataclass
class SequenceBatch:
    """A batch of prompt+response sequences, in the trainer's order.

    Per-response-token fields are lists with one entry per sequence, each of length
    ``len(token_ids[i]) - prompt_lens[i]``; ``None`` where not available.
    """

    token_ids: List[TokenList]
    """Prompt followed by response, per sequence."""
    prompt_lens: List[int]
    advantages: Optional[List[Union[float, Sequence[float], torch.Tensor]]] = None
    """One float per sequence (sequence-level) or one per response token."""
    old_logprobs: Optional[List[torch.Tensor]] = None
    rollout_logprobs: Optional[List[torch.Tensor]] = None
    ref_logprobs: Optional[List[torch.Tensor]] = None
    routed_experts: Optional[List[torch.Tensor]] = None
    """R3: per sequence, int16 ``[length - 1, layers, top_k]``, the experts the rollout engine
    routed positions ``0 .. length - 2`` to (``rollout/routed_experts.py``); the micro-batches
    carry them in their own layout (``MicroBatch.routing``)."""
    token_lags: Optional[List[TokenList]] = None
    """Per sequence, int64 ``[response_len]``: the learner's weight version at this update minus
    the version that generated each response token (asynchronous rollouts; metrics only:
    ``PolicyLossInputs.token_lag``)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.prompt_lens) != n:
            raise ValueError(f"SequenceBatch: {n} sequences but {len(self.prompt_lens)} prompt_lens")
        for name in ("advantages", *_PER_TOKEN_FIELDS):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"SequenceBatch.{name}: {len(values)} entries for {n} sequences")
        for i in range(n):
            length, prompt = len(self.token_ids[i]), self.prompt_lens[i]
            if not 1 <= prompt < length:
                raise ValueError(f"SequenceBatch: sequence {i} has prompt_len {prompt} and "
                                 f"length {length}; need 1 <= prompt_len < length")
            for name in _PER_TOKEN_FIELDS:
                values = getattr(self, name)
                if values is not None and len(values[i]) != length - prompt:
                    raise ValueError(f"SequenceBatch.{name}[{i}]: {len(values[i])} values for "
                                     f"{length - prompt} response tokens")
        self._check_routed_experts()

    def _check_routed_experts(self) -> None:
        if self.routed_experts is None:
            return
        if len(self.routed_experts) != len(self):
            raise ValueError(f"SequenceBatch.routed_experts: {len(self.routed_experts)} entries "
                             f"for {len(self)} sequences")
        layout = None
        for i, routing in enumerate(self.routed_experts):
            if routing.dim() != 3 or routing.shape[0] != self.seq_len(i) - 1:
                raise ValueError(f"SequenceBatch.routed_experts[{i}]: shape {tuple(routing.shape)} "
                                 f"for a sequence of {self.seq_len(i)} tokens; expected "
                                 f"[{self.seq_len(i) - 1}, layers, top_k]")
            if layout is not None and tuple(routing.shape[1:]) != layout:
                raise ValueError(f"SequenceBatch.routed_experts[{i}]: {tuple(routing.shape[1:])} "
                                 f"(layers, top_k), the others have {layout}")
            layout = tuple(routing.shape[1:])

    def __len__(self) -> int:
        return len(self.token_ids)

    def seq_len(self, i: int) -> int:
        return len(self.token_ids[i])

    def response_len(self, i: int) -> int:
        return len(self.token_ids[i]) - self.prompt_lens[i]

    @property
    def num_response_tokens(self) -> int:
        return sum(self.response_len(i) for i in range(len(self)))


LAYOUTS = ("packed", "rows")


@dataclass
class MicroBatch:
    """One micro-batch. Shapes: tokens/labels/position_ids [1, S] (packed) or [R, L] (rows);
    response tensors [N], indexing the flattened row-major ``[R * L]`` positions. Under context
    parallelism they are this CP rank's share (``S / cp`` or ``L / cp`` columns per row)."""

    seq_ids: List[int]
    """Indices into the SequenceBatch, in packing order."""
    tokens: torch.Tensor
    labels: torch.Tensor
    """Next token at every position (garbage at sequence ends and padding; never selected)."""
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    """int32 [num_seqs + 2]: boundaries of each sequence and of the trailing padding block
    (packed); the row boundaries of the flattened micro-batch (rows)."""
    response_positions: torch.Tensor
    """int64 [N]: positions in the row whose logits predict a response token, by sequence."""
    seq_index: torch.Tensor
    """int64 [N]: local sequence index (0..num_seqs-1) of each response token."""
    num_real_tokens: int
    extras: dict = field(default_factory=dict)
    """Per-response-token tensors [N] gathered from the batch (:data:`EXTRA_KEYS`): advantages,
    old_logprobs, ... (fp32), token_lags (int64)."""
    layout: str = "packed"
    cu_seqlens_padded: Optional[torch.Tensor] = None
    """int32 [num_seqs + 2]: packed boundaries with every sequence padded to a multiple of
    ``2 * cp`` (then ``cu_seqlens`` holds the real lengths' cumulative sums); None: no padding."""
    full_seq_token_counts: Optional[torch.Tensor] = None
    """int64 [num_seqs]: full response length per sequence, when this is a CP rank's share."""
    token_index: Optional[torch.Tensor] = None
    """int64 [N]: each response token's index inside its response, when this is a CP share."""
    cp_size: int = 1
    cp_rank: int = 0
    routing: Optional[torch.Tensor] = None
    """R3: int16 ``[R, S, layers, top_k]``, the rollout engine's experts at every position of
    ``tokens`` (this CP rank's columns of a share); positions nothing routed (padding, each
    sequence's last token, whose output no loss reads) name experts ``0 .. top_k - 1``."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def seq_token_counts(self) -> torch.Tensor:
        """int64 [num_seqs]: response tokens per sequence, all CP ranks together."""
        if self.full_seq_token_counts is not None:
            return self.full_seq_token_counts
        return torch.bincount(self.seq_index, minlength=self.num_seqs)

    def response_token_index(self) -> torch.Tensor:
        """int64 [N]: index of each (local) response token inside its sequence's response."""
        if self.token_index is not None:
            return self.token_index
        return response_token_index(self.seq_index, self.num_seqs)

    def causal_block_mask(self) -> torch.Tensor:
        """[1, 1, S, S] bool, True where attention is *not* allowed (Megatron's convention).

        Rows: plain causal, shared by every row. Packed: causal inside each sequence only.
        Rows under CP: ``[1, 1, S_local, S]``, this rank's queries against the all-gathered keys
        (``distributed.context_parallel.load_balanced_causal_mask``)."""
        length = self.tokens.shape[1]
        if self.cp_size > 1:
            if self.layout != "rows":
                raise ValueError("packed micro-batches under context parallelism need Transformer "
                                 "Engine's THD attention (no dense mask)")
            return load_balanced_causal_mask(length * self.cp_size, self.cp_size, self.cp_rank)
        if self.layout == "rows":
            return torch.ones(length, length, dtype=torch.bool).triu(1).view(1, 1, length, length)
        seg = torch.zeros(length, dtype=torch.int64)
        padded = self.cu_seqlens_padded
        bounds = (self.cu_seqlens if padded is None else padded).tolist()
        for k in range(len(bounds) - 1):
            seg[bounds[k]:bounds[k + 1]] = k
        pos = torch.arange(length)
        allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        return (~allowed).view(1, 1, length, length)


def _as_tensor(values, dtype) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to(dtype=dtype, device="cpu").reshape(-1)
    return torch.tensor(list(values), dtype=dtype)


EXTRA_KEYS = ("advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs", "token_lags")
"""Per-response-token fields of a SequenceBatch that travel into ``MicroBatch.extras``."""

_EXTRA_DTYPES = {"token_lags": torch.int64}
"""Extras that are not fp32."""


def _extra_values(batch: SequenceBatch, key: str, i: int) -> torch.Tensor:
    """``[response_len(i)]`` values of ``key`` for sequence ``i`` (fp32 but for
    :data:`_EXTRA_DTYPES`)."""
    if key == "advantages":
        return _per_token_advantage(batch, i)
    return _as_tensor(getattr(batch, key)[i], _EXTRA_DTYPES.get(key, torch.float32))


def _cat_extras(extras: dict) -> dict:
    return {k: _cat(v, _EXTRA_DTYPES.get(k, torch.float32)) for k, v in extras.items()}


def _cat(parts: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _per_token_advantage(batch: SequenceBatch, i: int) -> torch.Tensor:
    adv = batch.advantages[i]
    n = batch.response_len(i)
    if isinstance(adv, (int, float)):
        return torch.full((n,), float(adv), dtype=torch.float32)
    t = _as_tensor(adv, torch.float32)
    if t.numel() == 1:
        return t.expand(n).clone()
    if t.numel() != n:
        raise ValueError(f"SequenceBatch.advantages[{i}]: {t.numel()} values for {n} response tokens")
    return t


def _routing_grid(batch: SequenceBatch, placed: List[tuple], rows: int,
                  length: int) -> Optional[torch.Tensor]:
    """The batch's routed experts laid out like the tokens: ``placed`` holds (sequence, row,
    first column) of every sequence; None when the batch carries no routing."""
    if not batch.routed_experts:
        return None
    layers, top_k = batch.routed_experts[0].shape[1:]
    filler = torch.arange(top_k, dtype=torch.int16)
    grid = filler.expand(rows, length, layers, top_k).clone()
    for i, row, start in placed:
        routing = batch.routed_experts[i]
        grid[row, start:start + routing.shape[0]] = routing
    return grid


def build_micro_batch(batch: SequenceBatch, seq_ids: List[int], padded_len: int,
                      pad_token_id: int = 0, seq_multiple: int = 1) -> MicroBatch:
    """Concatenate ``seq_ids`` into one row of ``padded_len`` tokens.

    ``seq_multiple > 1`` (context parallelism on TE): every sequence starts at a multiple of it,
    ``cu_seqlens_padded`` holds those offsets and ``cu_seqlens`` the real lengths' sums."""
    tokens = torch.full((padded_len,), pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros(padded_len, dtype=torch.int64)
    positions, seq_index = [], []
    extras: dict = {k: [] for k in EXTRA_KEYS if getattr(batch, k) is not None}
    seq_lengths = [batch.seq_len(i) for i in seq_ids]
    real, bounds = padded_boundaries(seq_lengths, seq_multiple)
    for local, i in enumerate(seq_ids):
        ids = _as_tensor(batch.token_ids[i], torch.int64)
        length, prompt, offset = ids.numel(), batch.prompt_lens[i], bounds[local]
        tokens[offset:offset + length] = ids
        position_ids[offset:bounds[local + 1]] = torch.arange(bounds[local + 1] - offset)
        positions.append(torch.arange(offset + prompt - 1, offset + length - 1))
        seq_index.append(torch.full((length - prompt,), local, dtype=torch.int64))
        for key in extras:
            extras[key].append(_extra_values(batch, key, i))
    used = bounds[-1]
    if used > padded_len:
        raise ValueError(f"micro-batch of {used} tokens does not fit padded length {padded_len}")
    if used < padded_len:  # the trailing padding block is one more (masked-off) "sequence"
        real.append(real[-1] + padded_len - used)
        bounds.append(padded_len)
        position_ids[used:] = torch.arange(padded_len - used)
    labels = torch.roll(tokens, -1)
    return MicroBatch(
        seq_ids=list(seq_ids), tokens=tokens.view(1, -1), labels=labels.view(1, -1),
        position_ids=position_ids.view(1, -1),
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        response_positions=_cat(positions, torch.int64), seq_index=_cat(seq_index, torch.int64),
        num_real_tokens=sum(seq_lengths),
        extras=_cat_extras(extras),
        cu_seqlens_padded=torch.tensor(bounds, dtype=torch.int32) if seq_multiple > 1 else None,
        routing=_routing_grid(batch, [(i, 0, bounds[k]) for k, i in enumerate(seq_ids)], 1,
                              padded_len))


def build_row_micro_batch(batch: SequenceBatch, seq_ids: List[int], num_rows: int, row_len: int,
                          pad_token_id: int = 0) -> MicroBatch:
    """Lay ``seq_ids`` out one per row of ``row_len`` tokens, ``num_rows`` rows (empty rows pad)."""
    if len(seq_ids) > num_rows:
        raise ValueError(f"{len(seq_ids)} sequences do not fit {num_rows} rows")
    tokens = torch.full((num_rows, row_len), pad_token_id, dtype=torch.int64)
    positions, seq_index, real = [], [], 0
    extras: dict = {k: [] for k in EXTRA_KEYS if getattr(batch, k) is not None}
    for row, i in enumerate(seq_ids):
        ids = _as_tensor(batch.token_ids[i], torch.int64)
        length, prompt = ids.numel(), batch.prompt_lens[i]
        if length > row_len:
            raise ValueError(f"sequence {i} has {length} tokens, more than the row length {row_len}")
        tokens[row, :length] = ids
        positions.append(torch.arange(prompt - 1, length - 1) + row * row_len)
        seq_index.append(torch.full((length - prompt,), row, dtype=torch.int64))
        for key in extras:
            extras[key].append(_extra_values(batch, key, i))
        real += length
    return MicroBatch(
        seq_ids=list(seq_ids), tokens=tokens, labels=torch.roll(tokens, -1, dims=1),
        position_ids=torch.arange(row_len).expand(num_rows, row_len).clone(),
        cu_seqlens=torch.arange(0, (num_rows + 1) * row_len, row_len, dtype=torch.int32),
        response_positions=_cat(positions, torch.int64), seq_index=_cat(seq_index, torch.int64),
        num_real_tokens=real, extras=_cat_extras(extras),
        layout="rows",
        routing=_routing_grid(batch, [(i, row, 0) for row, i in enumerate(seq_ids)], num_rows,
                              row_len))


@dataclass
class StepPlan:
    """What one rank runs in one step, and the global normalisers of the mini-batch."""

    micro_batches: List[MicroBatch]
    padded_len: int
    global_num_seqs: int
    global_num_tokens: int
    """Response tokens in the whole mini-batch (all ranks)."""
    rank_seq_ids: List[List[int]]
    """Sequence indices assigned to every DP rank (for gathering results back)."""
    rows_per_micro_batch: int = 1
    """Megatron's ``micro_batch_size``: 1 when packed, ``R`` in the rows layout."""


def plan_step(batch: SequenceBatch, dp_rank: int, dp_size: int, max_tokens: int,
              pad_multiple: int = 1, pad_token_id: int = 0,
              num_micro_multiple: int = 1, layout: str = "packed",
              cp_size: int = 1, cp_rank: int = 0) -> StepPlan:
    """Split, pack and lay out this rank's micro-batches so that all ranks agree on shapes.

    Under context parallelism (``cp_size > 1``) every CP rank of a DP rank plans the same full
    micro-batches and keeps its share of each; ``pad_multiple`` must then be a multiple of
    ``2 * cp_size`` (the learner passes ``2 * cp * tp`` with SP)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown micro-batch layout {layout!r}; expected one of {LAYOUTS}")
    if len(batch) < dp_size:
        raise ValueError(f"a batch of {len(batch)} sequences cannot feed {dp_size} "
                         "data-parallel ranks")
    if cp_size > 1 and pad_multiple % (2 * cp_size):
        raise ValueError(f"pad_multiple={pad_multiple} must be a multiple of 2*cp = {2 * cp_size}")
    lengths = [batch.seq_len(i) for i in range(len(batch))]
    shares = split_across_dp(lengths, dp_size)
    if layout == "rows":
        plan = _plan_rows(batch, shares, lengths, dp_rank, max_tokens, pad_multiple,
                          pad_token_id, num_micro_multiple)
    else:
        plan = _plan_packed(batch, shares, lengths, dp_rank, max_tokens, pad_multiple,
                            pad_token_id, num_micro_multiple, seq_multiple=2 * cp_size
                            if cp_size > 1 else 1)
    if cp_size > 1:
        plan.micro_batches = [_cp_share(mb, cp_size, cp_rank) for mb in plan.micro_batches]
    return plan


def _cp_share(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    if mb.layout == "rows":
        columns = load_balanced_indices(mb.tokens.shape[1], cp_size, cp_rank)
    else:
        columns = thd_partition_indices(mb.cu_seqlens_padded.tolist(), cp_size, cp_rank)
    return shard_micro_batch(mb, columns, cp_size, cp_rank)


def shard_micro_batch(mb: MicroBatch, columns: torch.Tensor, cp_size: int,
                      cp_rank: int) -> MicroBatch:
    """This CP rank's view of ``mb``, keeping ``columns`` (int64 ``[S_local]``) of every row.

    ``response_positions`` index the flattened local ``[R * S_local]`` logits; ``seq_index``,
    ``extras`` keep only the response tokens predicted on this rank, in the same order.
    """
    rows, length = mb.tokens.shape
    local_len = columns.numel()
    where = torch.full((length,), -1, dtype=torch.int64)
    where[columns] = torch.arange(local_len)
    row, col = mb.response_positions // length, mb.response_positions % length
    keep = where[col] >= 0
    counts = torch.bincount(mb.seq_index, minlength=mb.num_seqs)
    token_index = response_token_index(mb.seq_index, mb.num_seqs)
    return replace(
        mb, tokens=mb.tokens[:, columns], labels=mb.labels[:, columns],
        position_ids=mb.position_ids[:, columns],
        response_positions=row[keep] * local_len + where[col[keep]],
        seq_index=mb.seq_index[keep], extras={k: v[keep] for k, v in mb.extras.items()},
        full_seq_token_counts=counts, token_index=token_index[keep],
        cp_size=cp_size, cp_rank=cp_rank,
        routing=mb.routing[:, columns] if mb.routing is not None else None)


def _plan_packed(batch: SequenceBatch, shares: List[List[int]], lengths: List[int], dp_rank: int,
                 max_tokens: int, pad_multiple: int, pad_token_id: int, num_micro_multiple: int,
                 seq_multiple: int) -> StepPlan:
    """Packed layout: token-budget bins, one row each (sequences padded to ``seq_multiple``)."""
    sizes = [_round_up(n, seq_multiple) for n in lengths]
    bins_per_rank = [pack_by_tokens(s, sizes, max_tokens) for s in shares]
    longest = max(sum(sizes[i] for i in b) for bins in bins_per_rank for b in bins)
    padded_len = _round_up(longest, pad_multiple)
    num_micro = _round_up(max(len(bins) for bins in bins_per_rank), num_micro_multiple)
    mine = bins_per_rank[dp_rank] + [[]] * (num_micro - len(bins_per_rank[dp_rank]))
    micro = [build_micro_batch(batch, b, padded_len, pad_token_id, seq_multiple) for b in mine]
    return StepPlan(micro_batches=micro, padded_len=padded_len, global_num_seqs=len(batch),
                    global_num_tokens=batch.num_response_tokens, rank_seq_ids=shares)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _plan_rows(batch: SequenceBatch, shares: List[List[int]], lengths: List[int], dp_rank: int,
               max_tokens: int, pad_multiple: int, pad_token_id: int,
               num_micro_multiple: int) -> StepPlan:
    """Rows layout: ``R = max_tokens // L`` sequences per micro-batch, longest first."""
    longest = max(lengths)
    if longest > max_tokens:
        worst = lengths.index(longest)
        raise ValueError(f"sequence {worst} has {longest} tokens, more than "
                         f"batch.max_tokens_per_micro_batch={max_tokens}")
    row_len = _round_up(longest, pad_multiple)
    rows = max(1, max_tokens // row_len)
    bins_per_rank = []
    for share in shares:  # similar lengths share a micro-batch; order does not change results
        ordered = sorted(share, key=lambda i: (-lengths[i], i))
        bins_per_rank.append([sorted(ordered[k:k + rows]) for k in range(0, len(ordered), rows)])
    num_micro = _round_up(max(len(bins) for bins in bins_per_rank), num_micro_multiple)
    mine = bins_per_rank[dp_rank] + [[]] * (num_micro - len(bins_per_rank[dp_rank]))
    rows = min(rows, max(len(b) for bins in bins_per_rank for b in bins))  # no all-pad rows
    micro = [build_row_micro_batch(batch, b, rows, row_len, pad_token_id) for b in mine]
    return StepPlan(micro_batches=micro, padded_len=row_len, global_num_seqs=len(batch),
                    global_num_tokens=batch.num_response_tokens, rank_seq_ids=shares,
                    rows_per_micro_batch=rows)
