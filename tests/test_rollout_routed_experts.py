"""SGLang's routed-experts format (base64 int32 [tokens, layers, top_k]) and the checks every
sample's routing passes before the learner replays it (R3)."""

import base64

import numpy as np
import pytest
import torch

from gspo_megatron.rollout.routed_experts import (MalformedRouting, RoutingShape,
                                                  check_sample_routing, decode_sglang,
                                                  encode_sglang)
from gspo_megatron.rollout.types import Sample

SHAPE = RoutingShape(num_layers=2, top_k=2, num_experts=8)


def _sample(routing, prompt=(1, 2, 3), response=(4, 5)) -> Sample:
    return Sample("p7", 3, list(prompt), list(response), [-0.5] * len(response), "stop", 0.1,
                  routed_experts=routing)


def test_sglangs_bytes_decode_to_int16_in_token_layer_slot_order():
    array = np.arange(4 * 2 * 2, dtype="<i4").reshape(4, 2, 2) % 8
    encoded = base64.b64encode(array.tobytes()).decode()  # what the detokenizer sends
    routing = decode_sglang(encoded, SHAPE, "server a")
    assert routing.dtype == torch.int16 and routing.shape == (4, 2, 2)
    assert routing.tolist() == array.tolist()
    assert encode_sglang(routing) == encoded


@pytest.mark.parametrize("encoded, message", [
    ([1, 2], "is list, expected SGLang's base64 string"),
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"\0" * 12).decode(), "12 bytes, not a multiple of 16"),
    (base64.b64encode(np.array([0, 1, 2, 9], "<i4").tobytes()).decode(), r"in \[0, 9\], outside 0..7"),
])
def test_malformed_answers_name_where_they_came_from(encoded, message):
    with pytest.raises(MalformedRouting, match=f"server b, request r1: .*{message}"):
        decode_sglang(encoded, SHAPE, "server b, request r1")


def test_a_samples_routing_must_cover_prompt_and_response_but_the_last_token():
    good = torch.tensor([[[0, 1], [2, 3]]] * 4, dtype=torch.int32)
    assert check_sample_routing(_sample(good), SHAPE).dtype == torch.int16
    where = r"sample \(prompt_id='p7', sample_index=3\)"
    cases = [
        (None, "no routed experts from the rollout engine"),
        (good[:3], r"shape \(3, 2, 2\), expected \(4, 2, 2\)"),
        (good.float(), "are torch.float32, expected integers"),
        (good + 7, r"expert ids in \[7, 10\], outside 0..7"),
        (torch.zeros(4, 2, 2, dtype=torch.int16), "names the same expert twice"),
    ]
    for routing, message in cases:
        with pytest.raises(MalformedRouting, match=f"{where}: .*{message}"):
            check_sample_routing(_sample(routing), SHAPE)


def test_the_shape_refuses_what_int16_or_top_k_cannot_hold():
    assert RoutingShape(48, 8, 128).bytes_per_token() == 768  # Qwen3-30B-A3B: 48 layers, top-8
    with pytest.raises(ValueError, match="top_k <= experts"):
        RoutingShape(2, 4, 2)
    with pytest.raises(ValueError, match="do not fit int16"):
        RoutingShape(2, 2, 40_000)
