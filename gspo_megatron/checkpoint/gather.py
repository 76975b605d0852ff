"""Gather a distributed Megatron model into full Hugging Face tensors, bucket by bucket, per stage.

``iter_hf_buckets(model_chunks, model_cfg, bucket_bytes, dst)`` is a generator every rank must
run to the end (it issues collectives). Each pipeline stage is gathered by its own ranks, in
size-bounded buckets (one collective per bucket, not per tensor):

- dense parameters (attention, norms, router, embeddings, output layer): the stage's first
  data-parallel replica gathers each bucket's TP slices (one flat tensor per rank) on its first
  rank (TP rank 0), which unshards them;
- expert parameters: the first expert-data-parallel replica gathers each bucket over the
  expert-TP group on expert-TP rank 0, then the expert-TP rank 0 of every EP rank sends the full
  local experts over the EP group to EP rank 0, so the stage's first rank holds every expert of
  the bucket.

The stage's first rank (TP = DP = EP = ETP rank 0; its *leader*) converts the bucket to HF
``(name, tensor)`` pairs (QKV and gate/up un-fused, vocabulary padding cut). With
``dst="stage"`` every stage leader yields its own stage's buckets, stage after stage (a world
barrier between stages: servers receive from one stage at a time, which keeps two stages'
broadcast groups from waiting on each other); each leader sends them to the rollout servers
itself (weight_sync/distributed_broadcast.py). With ``dst="rank0"`` the leaders of later stages
send their buckets to global rank 0 (flat bytes plus a small header), which yields everything
(export, and transports that live in rank 0's process).

Memory: a leader holds one gathered bucket (plus its HF views) at a time, the other ranks the
bytes they send (none beyond their parameters when a bucket is one contiguous tensor); only
the receiving rank of a gather allocates its buffer. Yielded tensors are views into that
bucket: consume or copy them before asking for the next one. ``alloc`` chooses the receive
buffers: a new one per bucket by default, or :class:`ReusedBuffers` (weight sync), which keeps
one per role for the whole gather: on CPU a fresh buffer's page faults cost several times the
copy into it (docs/real_geometry.md), and a bucket's bytes lie in its buffer back to back, so a
broadcast can send them without packing them first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint import mapping
from gspo_megatron.checkpoint.local_params import LocalUnit, iter_local_units
from gspo_megatron.config.schema import ModelConfig

HFBucket = List[Tuple[str, torch.Tensor]]
Alloc = Callable[[str, int, torch.device], torch.Tensor]
"""``alloc(role, num_bytes, device)`` -> a uint8 tensor of ``num_bytes`` to receive into. Roles:
``received`` (what a yielded bucket's tensors view), ``staging`` (expert-TP slices before the
EP gather, alive at the same time as ``received``)."""


def new_buffer(role: str, num_bytes: int, device: torch.device) -> torch.Tensor:
    """The default :data:`Alloc`: a new buffer every time."""
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


class ReusedBuffers:
    """An :data:`Alloc` that keeps one buffer per role (grown when a bucket needs more) for as
    long as it lives: each page is touched once per gather instead of once per bucket. Only for
    a consumer that is done with a bucket before it asks for the next (the module docstring's
    rule; the weight-sync transports are), since the next bucket overwrites it. ``new`` makes
    the buffers (default :func:`new_buffer`; the tensor-handle transport's are shared memory)."""

    def __init__(self, new: Alloc = new_buffer) -> None:
        self._new = new
        self._buffers: Dict[str, torch.Tensor] = {}

    def __call__(self, role: str, num_bytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < num_bytes or buf.device != torch.device(device):
            self._buffers.pop(role, None)  # freed before the larger one is allocated
            buf = self._buffers[role] = self._new(role, num_bytes, device)
        return buf[:num_bytes]

    def release(self) -> None:
        self._buffers.clear()
_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


@dataclass(frozen=True)
class Layout:
    """This rank's place in the model-parallel layout (from Megatron's parallel state)."""

    stage: int
    num_stages: int
    tp_rank: int
    dp_rank: int
    """Data-parallel rank, context parallelism included (CP ranks hold the same weights)."""
    ep_rank: int
    ep_size: int
    etp_rank: int
    edp_rank: int

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0 and self.dp_rank == 0

    @staticmethod
    def current(cfg: ModelConfig) -> "Layout":
        from megatron.core import parallel_state as ps

        moe = bool(cfg.num_experts)
        layout = Layout(
            stage=ps.get_pipeline_model_parallel_rank(),
            num_stages=ps.get_pipeline_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            ep_rank=ps.get_expert_model_parallel_rank() if moe else 0,
            ep_size=ps.get_expert_model_parallel_world_size() if moe else 1,
            etp_rank=ps.get_expert_tensor_parallel_rank() if moe else 0,
            edp_rank=ps.get_expert_data_parallel_rank() if moe else 0)
        if layout.is_leader and (layout.ep_rank, layout.etp_rank, layout.edp_rank) != (0, 0, 0):
            raise RuntimeError(f"the first rank of pipeline stage {layout.stage} is not expert rank "
                               f"0 ({layout}); the gather needs Megatron's default rank order "
                               "(tp-cp-ep-dp-pp)")
        return layout


def _groups(expert: bool):
    from megatron.core import parallel_state as ps

    return (ps.get_expert_tensor_parallel_group() if expert
            else ps.get_tensor_model_parallel_group())


def _multi() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back; a view (no copy) of a lone contiguous tensor."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().reshape(-1).view(torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        n = _nbytes(t)
        out.append(flat[offset:offset + n].view(t.dtype).view(t.shape))
        offset += n
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _gather_flat(local: Sequence[torch.Tensor], group, size: int, alloc: Alloc = new_buffer,
                 role: str = "received") -> List[List[torch.Tensor]]:
    """Every rank's version of ``local`` (same shapes on every rank), by group rank, on the
    group's first rank (the only one that uses them); ``[]`` on the others.

    The parts are received into one buffer, rank after rank, so a tensor split along dim 0 is
    whole in it already (:func:`mapping.unshard` returns a view of it instead of a copy). On
    gloo each tensor comes by a point-to-point send straight into its place (gloo's ``gather``
    receives into a flat buffer of its own and copies it out: twice the bucket on the
    receiver, and the senders would pack their tensors first); NCCL's ``gather`` receives into
    the outputs directly (and point-to-point sends would each build a communicator there).
    """
    if size == 1:
        return [list(local)]
    ranks = dist.get_process_group_ranks(group)
    gloo = dist.get_backend(group) == "gloo"
    if dist.get_rank() != ranks[0]:
        if gloo:
            for t in local:
                dist.send(_bytes(t), dst=ranks[0], group=group)
        else:
            dist.gather(_flat(local), None, dst=ranks[0], group=group)
        return []
    nbytes = sum(_nbytes(t) for t in local)
    whole = alloc(role, size * nbytes, local[0].device)
    parts = list(whole.chunk(size))
    if gloo:
        like = [torch.empty(_nbytes(t), dtype=torch.uint8, device="meta") for t in local]
        for t, mine in zip(local, _split(parts[0], like)):
            mine.copy_(_bytes(t))
        for part, src in zip(parts[1:], ranks[1:]):
            for piece in _split(part, like):
                dist.recv(piece, src=src, group=group)
    else:
        dist.gather(_flat(local), parts, dst=ranks[0], group=group)
    return [_split(p, local) for p in parts]


def _buckets(units: List[LocalUnit], bucket_bytes: int, factor) -> List[List[LocalUnit]]:
    """Consecutive units, one dtype, at most ``bucket_bytes`` of gathered (full) bytes."""
    out: List[List[LocalUnit]] = []
    size = 0
    for u in units:
        n = _nbytes(u.tensor) * factor(u)
        if out and out[-1] and (size + n > bucket_bytes or out[-1][0].tensor.dtype != u.tensor.dtype):
            out.append([])
            size = 0
        if not out:
            out.append([])
        out[-1].append(u)
        size += n
    return [b for b in out if b]


def _to_hf(full: Dict[str, torch.Tensor], cfg: ModelConfig) -> HFBucket:
    return [pair for name, t in full.items() for pair in mapping.megatron_to_hf(name, t, cfg)]


def _dense_buckets(units: List[LocalUnit], cfg: ModelConfig, layout: Layout,
                   bucket_bytes: int, alloc: Alloc) -> Iterator[HFBucket]:
    if layout.dp_rank != 0:
        return  # data-parallel replicas hold the same dense weights
    tp_size = max(u.tp_size for u in units) if units else 1
    for bucket in _buckets(units, bucket_bytes, lambda u: u.tp_size):
        sharded = [u for u in bucket if u.tp_size > 1]
        parts = (_gather_flat([u.tensor for u in sharded], _groups(False), tp_size, alloc)
                 if sharded else [])
        if not layout.is_leader:
            continue
        position = {id(u): i for i, u in enumerate(sharded)}
        full = {u.name: (mapping.unshard([p[position[id(u)]] for p in parts], u.spec)
                         if id(u) in position else u.tensor) for u in bucket}
        hf = _to_hf(full, cfg)
        del parts, full  # only the HF views may keep this bucket alive (see iter_hf_tensors)
        yield hf


def _expert_key(u: LocalUnit, experts_per_rank: int) -> Tuple[int, int, str]:
    m = _EXPERT.match(u.name)
    layer, expert, fc = int(m.group(1)), int(m.group(2)), m.group(3)
    return layer, expert % experts_per_rank, fc


def _by_global_expert(by_ep: List[List[torch.Tensor]], bucket: List[LocalUnit],
                      per_rank: int) -> Dict[str, torch.Tensor]:
    """Canonical name -> full tensor of every EP rank's experts in one gathered bucket."""
    full = {}
    for ep_rank, tensors in enumerate(by_ep):
        for u, t in zip(bucket, tensors):
            layer, slot, fc = _expert_key(u, per_rank)
            full[mapping.expert_name(layer, ep_rank * per_rank + slot, fc)] = t
    return full


def _expert_buckets(units: List[LocalUnit], cfg: ModelConfig, layout: Layout,
                    bucket_bytes: int, alloc: Alloc) -> Iterator[HFBucket]:
    if layout.edp_rank != 0 or not units:
        return  # expert-data-parallel replicas hold the same experts
    from megatron.core import parallel_state as ps

    per_rank = cfg.num_experts // layout.ep_size
    units = sorted(units, key=lambda u: _expert_key(u, per_rank))
    etp_size = units[0].tp_size
    for bucket in _buckets(units, bucket_bytes, lambda u: u.tp_size * layout.ep_size):
        parts = _gather_flat([u.tensor for u in bucket], _groups(True), etp_size, alloc,
                             "staging")
        if layout.etp_rank != 0:
            continue
        local_full = [mapping.unshard([p[i] for p in parts], u.spec) for i, u in enumerate(bucket)]
        by_ep = _gather_flat(local_full, ps.get_expert_model_parallel_group(), layout.ep_size,
                             alloc)
        if not layout.is_leader:
            continue
        hf = _to_hf(_by_global_expert(by_ep, bucket, per_rank), cfg)
        del parts, local_full, by_ep  # as in _dense_buckets
        yield hf


def _stage_buckets(model_chunks: Sequence[torch.nn.Module], cfg: ModelConfig, layout: Layout,
                   bucket_bytes: int, alloc: Alloc) -> Iterator[HFBucket]:
    """This stage's buckets, on its leader (other ranks of the stage take part and get none)."""
    units = [u for chunk in model_chunks for u in iter_local_units(chunk, cfg)
             if mapping.is_exported(u.name, cfg)]
    order = {n: i for i, n in enumerate(mapping.canonical_names(cfg))}
    units.sort(key=lambda u: order[u.name] if u.name in order else len(order))
    yield from _dense_buckets([u for u in units if not u.spec.expert], cfg, layout, bucket_bytes,
                              alloc)
    yield from _expert_buckets([u for u in units if u.spec.expert], cfg, layout, bucket_bytes,
                               alloc)


def _send_to_rank0(bucket: Optional[HFBucket]) -> None:
    header = None if bucket is None else [(n, list(t.shape), str(t.dtype)) for n, t in bucket]
    dist.send_object_list([header], dst=0)
    if bucket:
        dist.send(_flat([t for _, t in bucket]), dst=0)


def _recv_from(src: int, device: torch.device, alloc: Alloc) -> Iterator[HFBucket]:
    while True:
        box: List = [None]
        dist.recv_object_list(box, src=src)
        header = box[0]
        if header is None:
            return
        like = [torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")), device="meta")
                for _, shape, dtype in header]
        flat = alloc("received", sum(_nbytes(t) for t in like), device)
        dist.recv(flat, src=src)
        bucket = list(zip([n for n, _, _ in header], _split(flat, like)))
        del flat  # not alive while the next bucket is received
        yield bucket


def _stage_leaders() -> List[int]:
    """Global rank of each stage's leader: rank 0's pipeline group lists them in stage order."""
    from megatron.core import parallel_state as ps

    return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())


def iter_hf_buckets(model_chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig,
                    bucket_bytes: int = 512 * 1024 ** 2, dst: str = "rank0",
                    alloc: Alloc = new_buffer) -> Iterator[HFBucket]:
    """Yield HF buckets on each stage leader (``dst="stage"``) or on rank 0 (``"rank0"``);
    ``alloc`` gives the buffers buckets are received into (see the module docstring)."""
    if dst not in ("rank0", "stage"):
        raise ValueError(f"dst must be 'rank0' or 'stage', got {dst!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    layout = Layout.current(model_cfg)
    multi = _multi()
    rank = dist.get_rank() if multi else 0
    device = next(iter(model_chunks[0].parameters())).device
    leaders = _stage_leaders() if multi and dst == "rank0" and layout.num_stages > 1 else [0]
    seen: List[str] = []
    for stage in range(layout.num_stages):
        if stage == layout.stage:
            for bucket in _stage_buckets(model_chunks, model_cfg, layout, bucket_bytes, alloc):
                if dst == "stage" or rank == 0:
                    seen += [n for n, _ in bucket]
                    yield bucket
                else:
                    _send_to_rank0(bucket)
            if dst == "rank0" and layout.is_leader and rank != 0:
                _send_to_rank0(None)
        elif dst == "rank0" and rank == 0:
            for bucket in _recv_from(leaders[stage], device, alloc):
                seen += [n for n, _ in bucket]
                yield bucket
        if multi and dst == "stage" and layout.num_stages > 1:
            dist.barrier()  # stages send one after the other
    if rank == 0 and dst == "rank0":
        _check_complete(seen, model_cfg)


def _check_complete(names: List[str], cfg: ModelConfig) -> None:
    expected = {n for c in mapping.canonical_names(cfg) if mapping.is_exported(c, cfg)
                for n in mapping.hf_names(c, cfg)}
    missing = sorted(expected - set(names))
    if missing or len(names) != len(set(names)):
        raise mapping.MappingError(f"gathered weights do not match the model config: missing "
                                   f"{missing[:5]}, {len(names) - len(set(names))} duplicates")


def iter_hf_tensors(model_chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig,
                    parallel_cfg: Optional[object] = None, dst: str = "rank0",
                    bucket_bytes: int = 512 * 1024 ** 2) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs of :func:`iter_hf_buckets` (export writes them one by one).

    ``parallel_cfg`` is accepted for symmetry with conversion; the layout is read from
    Megatron's parallel state. Every rank must exhaust the generator. Each pair is taken out of
    its bucket as it is handed over, so a bucket's memory is freed once the consumer drops its
    last tensor, before the next bucket is gathered (the consumer should drop it by then too).
    """
    for bucket in iter_hf_buckets(model_chunks, model_cfg, bucket_bytes, dst):
        bucket.reverse()
        while bucket:
            yield bucket.pop()
