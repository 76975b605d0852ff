"""The rollout servers' parameter names and shapes, to refuse a payload before it is sent.

The real SGLang 0.5.23 server takes a wrong payload badly (tried on CPU, docs/rollout.md):
a tensor of the wrong shape in ``/update_weights_from_tensor`` or ``_from_distributed`` fails
an assertion inside the scheduler and **kills the server**; a name its model does not have
answers success and is **silently ignored**, so the run would go on with stale weights.

A server loads its weights from a Hugging Face checkpoint (``/server_info``'s ``model_path``);
the safetensors headers of that checkpoint list every name and shape its loader accepts, and
they are read here without loading a tensor. Every sender checks each bucket against them before
the bucket leaves (``weight_sync/sync.py``). Where the checkpoint cannot be read from the
learner's filesystem (a hub id, a path only the server nodes mount) the check is skipped with one
warning, and the server's own behaviour applies.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Dict, Iterable, Optional, Tuple

log = logging.getLogger(__name__)

Shapes = Dict[str, Tuple[int, ...]]


class PayloadMismatch(ValueError):
    """A weight the rollout servers' model does not have, or has in another shape."""


def _header_shapes(path: str) -> Shapes:
    """Names and shapes from one safetensors file's JSON header (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def checkpoint_shapes(model_path: str) -> Shapes:
    """Every tensor name -> shape of the HF checkpoint directory ``model_path``."""
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors file")
    shapes: Shapes = {}
    for name in files:
        shapes.update(_header_shapes(os.path.join(model_path, name)))
    return shapes


class ServerModel:
    """The names and shapes one fleet's model accepts (all members serve the same model)."""

    def __init__(self, shapes: Shapes, source: str) -> None:
        self.shapes = shapes
        self.source = source

    @classmethod
    def from_server(cls, client) -> Optional["ServerModel"]:
        """Read the checkpoint the server at ``client`` loaded; None (and a warning) when its
        path is not a readable directory here."""
        model_path = client.server_info().get("model_path")
        if not model_path or not os.path.isdir(model_path):
            log.warning("cannot read rollout server %s's model %r from here: weight names and "
                        "shapes are not checked before sending (SGLang ignores unknown names "
                        "and dies on a wrong shape)", client.address, model_path)
            return None
        return cls(checkpoint_shapes(model_path), f"{client.address}: {model_path}")

    def check(self, items: Iterable[Tuple[str, Tuple[int, ...]]]) -> None:
        """Raise :class:`PayloadMismatch` naming the first weight the servers cannot take."""
        for name, shape in items:
            expected = self.shapes.get(name)
            if expected is None:
                raise PayloadMismatch(
                    f"weight {name!r} is not a parameter of the rollout servers' model "
                    f"({self.source}); SGLang would ignore it silently and keep the old weights. "
                    "Does the learner's model match model.hf_path?")
            if tuple(shape) != expected:
                raise PayloadMismatch(
                    f"weight {name!r} has shape {list(shape)} but the rollout servers' model "
                    f"({self.source}) has {list(expected)}; SGLang's loader would fail an "
                    "assertion and the server would die. Not sent.")
