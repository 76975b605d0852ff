"""The Megatron-Core CPU compatibility layer: each patch is still needed, and each one works.

A probe runs in a fresh interpreter without the patches; if Megatron or torch stops making the
CUDA assumption, the probe returns False and this test fails, so the patch can be retired.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gspo_megatron.distributed import cpu_compat


def test_every_patch_is_still_needed_on_unpatched_megatron():
    code = ("import json; from gspo_megatron.distributed import cpu_compat as c; "
            "print(json.dumps({p.name: p.probe() for p in c.PATCHES}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300)
    still_needed = json.loads(out.stdout.strip().splitlines()[-1])
    assert still_needed == {p.name: True for p in cpu_compat.PATCHES}


def test_patches_answer_each_assumption():
    code = r"""
import torch
from gspo_megatron.distributed.cpu_compat import apply_cpu_compat, cpu_compat_applied
apply_cpu_compat(); apply_cpu_compat()  # idempotent
assert cpu_compat_applied()
assert torch.device(torch.cuda.current_device()).type == "cpu"
torch.cuda.synchronize()
assert torch.zeros([], device="cuda").device.type == "cpu"
assert torch.ones(2).cuda().device.type == "cpu"
assert torch.ones(2).to("cuda:0").device.type == "cpu"
assert torch.zeros(2).type() == "torch.cuda.FloatTensor"  # what Megatron's optimizer checks
from megatron.core.tensor_parallel import random as mrandom
tracker = mrandom.CudaRNGStatesTracker()
tracker.add("a", 123)
torch.manual_seed(0)
before = torch.rand(3)
torch.manual_seed(0)
with tracker.fork("a"):
    inside = torch.rand(3)
after = torch.rand(3)
assert torch.equal(after, before), "fork must restore the default generator"
assert not torch.equal(inside, before), "the tracked state must be its own stream"
import megatron.core.transformer.moe.moe_utils as mu
assert mu.te_general_gemm is None
from gspo_megatron.distributed.cpu_compat import device_redirect_suspended
with device_redirect_suspended():  # the HF rollout engine runs without the per-call mode
    try:
        torch.zeros([], device="cuda")
        raise SystemExit("the device redirect was still active inside the suspended block")
    except (AssertionError, RuntimeError):
        pass
assert torch.zeros([], device="cuda").device.type == "cpu", "the redirect must come back"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_refuses_to_patch_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be applied on a machine with a GPU"):
        cpu_compat.apply_cpu_compat()
