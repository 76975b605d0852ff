"""The benchmark's comparison: tolerances from HF's own bf16 spread, argmax flips and
near-ties, and the doc section it writes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_real_geometry import BEGIN, END, compare, write_doc


def _inputs(server_shift=0.0, flip_at=None, gap=1.0):
    fp32 = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -0.7])]
    bf16 = [t + 0.01 for t in fp32]
    argmax = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    gaps = [torch.full((3,), gap), torch.full((2,), gap)]
    tokens = [a.tolist() for a in argmax]
    if flip_at is not None:
        tokens[0][flip_at] = 99
    server = {"tokens": tokens, "logprobs": [(t + 0.01 + server_shift).tolist() for t in fp32]}
    hf = {"fp32": {"logprobs": fp32, "argmax": argmax, "gap": gaps},
          "bf16": {"logprobs": bf16, "argmax": argmax, "gap": gaps}}
    return server, hf, {"logprobs": [t - 0.01 for t in fp32]}


def test_within_tolerance_and_every_argmax_agrees():
    cmp = compare(*_inputs())
    assert cmp.spread["max"] == pytest.approx(0.01, abs=1e-6)
    assert cmp.tolerance["max"] == pytest.approx(0.03, abs=1e-6)
    assert cmp.tolerance_bf16["max"] == pytest.approx(0.06, abs=1e-6)
    assert cmp.pairs["server vs learner"]["max"] == pytest.approx(0.02, abs=1e-6)
    assert (cmp.num_tokens, cmp.argmax_agree, cmp.argmax_flips) == (5, 5, 0)
    assert not cmp.failures


def test_a_gap_beyond_tolerance_fails():
    cmp = compare(*_inputs(server_shift=0.05))
    assert any(f.startswith("server vs HF fp32: max") for f in cmp.failures)


def test_a_flip_is_allowed_only_at_a_near_tie():
    flipped = compare(*_inputs(flip_at=1))
    assert (flipped.argmax_flips, flipped.flips_outside_near_ties) == (1, 1)
    assert any("outside a near-tie" in f for f in flipped.failures)
    tie = compare(*_inputs(flip_at=1, gap=0.001))
    assert (tie.near_ties, tie.flips_outside_near_ties, tie.failures) == (5, 0, [])


def test_write_doc_replaces_only_the_marked_section(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"head\n{BEGIN}\nold\n{END}\ntail\n")
    write_doc(doc, f"{BEGIN}\nnew\n{END}")
    assert doc.read_text() == f"head\n{BEGIN}\nnew\n{END}\ntail\n"
