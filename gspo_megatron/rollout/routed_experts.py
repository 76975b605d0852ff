"""The experts a rollout engine routed each token to (R3, rollout routing replay): the format,
and the checks every sample's routing passes.

SGLang 0.5.23 (read in ``srt/managers/io_struct.py``, ``srt/state_capturer/base.py`` and
``routed_experts.py``, ``srt/managers/detokenizer_manager.py``, ``tokenizer_manager.py``): a
server started with ``--enable-return-routed-experts`` answers a ``/generate`` request that sets
``return_routed_experts`` with ``meta_info["routed_experts"]``, the base64 of an int32 array
``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]`` (C order):
the top-k of every MoE layer for every position of prompt + output except the last token, which
is sampled but never fed back. A server without the flag has no capturer and silently leaves the
field out, so its absence is an error here, not a default.

The embedded engine records the same thing in the same order (``rollout/embedded/kv_decoder.py``). In
the trainer a sample keeps it as int16 (``2 * top_k`` bytes per token per layer); the learner
lays it out like the tokens and replays it (``learner/routing.py``).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

ROUTING_DTYPE = torch.int16


class MalformedRouting(ValueError):
    """A sample's routed experts are missing or do not fit the model; names the sample."""


@dataclass(frozen=True)
class RoutingShape:
    """What a sample's routing must look like: MoE layers, top-k, experts to choose from."""

    num_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.top_k, self.num_experts) < 1 or self.top_k > self.num_experts:
            raise ValueError(f"routing shape {self}: need layers, top_k, experts >= 1 and "
                             "top_k <= experts")
        if self.num_experts > torch.iinfo(ROUTING_DTYPE).max + 1:
            raise ValueError(f"{self.num_experts} experts do not fit int16 expert ids")

    def bytes_per_token(self) -> int:
        """What one token's routing costs in the trainer (int16, every layer)."""
        return 2 * self.top_k * self.num_layers


def decode_sglang(encoded: object, shape: RoutingShape, where: str) -> torch.Tensor:
    """SGLang's base64 int32 ``routed_experts`` as int16 ``[tokens, layers, top_k]``."""
    if not isinstance(encoded, str):
        raise MalformedRouting(f"{where}: routed_experts is {type(encoded).__name__}, expected "
                               "SGLang's base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedRouting(f"{where}: routed_experts is not valid base64 ({exc})") from exc
    per_token = 4 * shape.num_layers * shape.top_k
    if len(raw) % per_token:
        raise MalformedRouting(f"{where}: routed_experts has {len(raw)} bytes, not a multiple of "
                               f"{per_token} (int32 x {shape.num_layers} layers x top-{shape.top_k})")
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, shape.num_layers, shape.top_k)
    if array.size and (array.min() < 0 or array.max() >= shape.num_experts):
        raise MalformedRouting(f"{where}: routed_experts holds expert ids in "
                               f"[{array.min()}, {array.max()}], outside 0..{shape.num_experts - 1}")
    return torch.from_numpy(array.astype(np.int16))


def encode_sglang(routing: torch.Tensor) -> str:
    """int ``[tokens, layers, top_k]`` as SGLang sends it (the reference server uses this)."""
    return base64.b64encode(routing.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()
                            ).decode("ascii")


def check_sample_routing(sample, shape: RoutingShape) -> torch.Tensor:
    """``sample.routed_experts`` as int16 after checking it covers the sample under ``shape``."""
    where = f"sample (prompt_id={sample.prompt_id!r}, sample_index={sample.sample_index})"
    routing: Optional[torch.Tensor] = sample.routed_experts
    if routing is None:
        raise MalformedRouting(f"{where}: no routed experts from the rollout engine, which "
                               "algo.routing_replay=rollout replays (an SGLang server needs "
                               "--enable-return-routed-experts)")
    tokens = len(sample.prompt_token_ids) + len(sample.response_token_ids) - 1
    expected = (tokens, shape.num_layers, shape.top_k)
    if tuple(routing.shape) != expected:
        raise MalformedRouting(f"{where}: routed experts of shape {tuple(routing.shape)}, expected "
                               f"{expected} (prompt + response - 1 tokens, MoE layers, top-k)")
    if routing.is_floating_point() or routing.is_complex():
        raise MalformedRouting(f"{where}: routed experts are {routing.dtype}, expected integers")
    if routing.numel() and (int(routing.min()) < 0 or int(routing.max()) >= shape.num_experts):
        raise MalformedRouting(f"{where}: expert ids in [{int(routing.min())}, "
                               f"{int(routing.max())}], outside 0..{shape.num_experts - 1}")
    ordered = routing.sort(dim=-1).values
    if shape.top_k > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise MalformedRouting(f"{where}: a token's top-{shape.top_k} names the same expert twice")
    return routing.to(ROUTING_DTYPE)
