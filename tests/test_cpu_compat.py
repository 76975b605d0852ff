"""The Megatron-Core CPU compatibility layer: each patch is still needed, and each one works.

A probe runs in a fresh interpreter without the patches; if Megatron or torch stops making the
CUDA assumption, the probe returns False and this test fails, so the patch can be retired.
"""

from __future__ import annotations

import json
import os
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
import sys
import megatron.core.jit
assert megatron.core.jit.jit_fuser is not torch.compile, "Megatron's fusion decorator is eager"
assert "torch._dynamo" not in sys.modules, "importing Megatron must not pull in torch._dynamo"
from megatron.core.dist_checkpointing.strategies import filesystem_async
assert filesystem_async._get_write_results_queue().__class__.__module__ == "queue"
import os
import torch.distributed as dist
from megatron.core.distributed import param_and_grad_buffer as pgb
assert pgb.dist_reduce_scatter_func.single_rank_identity and pgb.dist_all_gather_func.single_rank_identity
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
buf = torch.arange(6.0)
pgb.dist_reduce_scatter_func(buf[:6], buf, group=dist.group.WORLD)  # same memory: nothing to do
out = torch.zeros(6)
assert pgb.dist_all_gather_func(out, buf, group=dist.group.WORLD, async_op=True).wait()
assert torch.equal(out, torch.arange(6.0)), "one rank: the gather is a copy"
dist.destroy_process_group()
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
    from gspo_megatron.distributed.runtime import free_port

    env = dict(os.environ, PROBE_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_refuses_to_patch_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be applied on a machine with a GPU"):
        cpu_compat.apply_cpu_compat()
