"""``distributed/cpu_bf16_matmul.py``: when bf16 products run in fp32 (the processor's flags, the
variable), and what they compute: a bf16 layer's forward and backward products taken, equal to
the fp32 product rounded once, close to torch's own bf16 path, fp32 work left alone."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.distributed import cpu_bf16_matmul as m


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse2 {flags}\n\n")
    return str(path)


def test_the_processor_flags_decide_under_auto(tmp_path):
    avx2 = _cpuinfo(tmp_path, "avx2 fma")
    assert not m.cpu_has_native_bf16(avx2) and m.wanted("auto", avx2)
    amx = _cpuinfo(tmp_path, "avx2 avx512f avx512_bf16 amx_bf16")
    assert m.cpu_has_native_bf16(amx) and not m.wanted("auto", amx)
    assert m.cpu_has_native_bf16(str(tmp_path / "missing"))  # unknown: leave torch alone
    assert m.wanted("fp32", amx) and not m.wanted("native", avx2)


def test_the_variable_is_read_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv(m.ENV, raising=False)
    assert m.setting_from_env() == "auto"
    monkeypatch.setenv(m.ENV, " FP32 ")
    assert m.setting_from_env() == "fp32" and m.wanted()
    monkeypatch.setenv(m.ENV, "fast")
    with pytest.raises(ValueError, match="GSPO_CPU_BF16_MATMUL='fast' is not one of auto, fp32, native"):
        m.setting_from_env()


def _layer_step(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, dtype=dtype)
    x = torch.randn(37, 64, dtype=dtype, requires_grad=True)
    y = layer(x)
    (y.float() ** 2).sum().backward()
    return layer, x, y


def test_a_bf16_layer_runs_its_products_in_fp32_forward_and_backward():
    with m.Fp32Matmuls() as mode:
        layer, x, y = _layer_step(torch.bfloat16)
    assert mode.products >= 3  # addmm forward; mm for the input's and the weight's gradients
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    # The forward is the fp32 product rounded once to bf16, bit for bit.
    want = torch.addmm(layer.bias.detach().float(), x.detach().float(),
                       layer.weight.detach().float().t()).to(torch.bfloat16)
    assert torch.equal(y.detach(), want)
    # torch's own bf16 path also accumulates in fp32: the two agree to bf16's rounding.
    native_layer, native_x, native_y = _layer_step(torch.bfloat16)
    for got, ref in ((y, native_y), (x.grad, native_x.grad),
                     (layer.weight.grad, native_layer.weight.grad)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


def test_batched_products_and_fp32_work_are_handled_as_they_should():
    a = torch.randn(3, 8, 5, dtype=torch.bfloat16)
    b = torch.randn(3, 5, 4, dtype=torch.bfloat16)
    with m.Fp32Matmuls() as mode:
        out = torch.bmm(a, b)
        fp32 = torch.mm(torch.randn(4, 4), torch.randn(4, 4))
    assert mode.products == 1 and out.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert torch.equal(out, torch.bmm(a.float(), b.float()).to(torch.bfloat16))


def test_the_mode_is_on_only_for_bf16_work_on_a_machine_that_needs_it(monkeypatch):
    with m.bf16_matmuls_in_fp32(has_bf16=False, setting="fp32") as mode:
        assert mode is None
    with m.bf16_matmuls_in_fp32(has_bf16=True, setting="native") as mode:
        assert mode is None
    with m.bf16_matmuls_in_fp32(has_bf16=True, setting="fp32") as mode:
        torch.mm(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16))
        assert mode.products == 1
    # the mode is gone after the block: a product is not counted any more
    torch.mm(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16))
    assert mode.products == 1
