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
with torch.device("meta"):  # a device context still places the redirected factories' tensors
    assert torch.nn.Linear(2, 2).weight.device.type == "meta", "built on the CPU, not on meta"
    assert torch.empty(2).device.type == torch.zeros(2).device.type == "meta"
import sys
import megatron.core.jit
assert megatron.core.jit.jit_fuser is not torch.compile, "Megatron's fusion decorator is eager"
assert "torch._dynamo" not in sys.modules, "importing Megatron must not pull in torch._dynamo"
assert type(sys.modules["wandb"]).__name__ == "DeferredModule", "Megatron loaded wandb at import"
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
assert torch.ones(2).to(torch.device("cuda"), torch.float64).dtype == torch.float64
assert torch.ones(2).to(device="cuda", dtype=torch.int64).dtype == torch.int64
assert torch.ones(2).to(0).device.type == "cpu"  # a device index
assert torch.ones(2).to(torch.float16).dtype == torch.float16  # a dtype is not a device
assert torch.zeros(2).type() == "torch.cuda.FloatTensor"  # what Megatron's optimizer checks
assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # a conversion still converts
for name in ("empty", "tensor", "arange", "full", "linspace", "eye", "as_tensor", "randn"):
    args = {"tensor": ([1.0],), "full": ((2,), 1.0), "linspace": (0, 1, 3),
            "as_tensor": ([1.0],)}.get(name, (2,))
    assert getattr(torch, name)(*args, device="cuda").device.type == "cpu", name
x = torch.ones(3)
for name in ("empty_like", "zeros_like", "ones_like", "randn_like"):
    assert getattr(torch, name)(x, device="cuda:0").device.type == "cpu", name
assert x.new_zeros(2, device="cuda").device.type == "cpu"
assert x.new_tensor([1], device=torch.device("cuda", 0)).device.type == "cpu"
assert torch.nn.Linear(2, 2).to("cuda").weight.device.type == "cpu"
import threading
seen = []
t = threading.Thread(target=lambda: seen.append(torch.zeros(1, device="cuda").device.type))
t.start(); t.join()
assert seen == ["cpu"], "the redirect holds in every thread"
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
from torch.overrides import _get_current_function_mode_stack
assert not _get_current_function_mode_stack(), "no per-call torch function mode"
from torch.utils._python_dispatch import TorchDispatchMode
from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight
ops = []
class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
w = torch.randn(6, 4)
x = torch.randn(3, 2, 4, requires_grad=True)
g = torch.randn(2, 3, 6).transpose(0, 1)  # the output layer's gradient: transposed logits
with Ops():
    LinearWithFrozenWeight.apply(x, w, None, False, None).backward(g)
assert "bmm" not in ops and "mm" in ops, ops  # one GEMM, no broadcast copies of the weight
assert torch.allclose(x.grad, torch.einsum("sbv,vh->sbh", g, w), atol=1e-6)
print("ok")
"""
    from gspo_megatron.distributed.ports import free_port

    env = dict(os.environ, PROBE_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_refuses_to_patch_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be applied on a machine with a GPU"):
        cpu_compat.apply_cpu_compat()


def _device_call_sites(root):
    """(callee, file:line) of every call in ``root``'s Python source with a ``device=``
    keyword or spelling ``.cuda()`` / ``.to(...)`` / ``.type()``."""
    import ast
    import pathlib

    sites = []
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            if any(k.arg == "device" for k in node.keywords):
                sites.append((ast.unparse(node.func), where))
            elif node.func.attr in ("cuda", "to", "type"):
                sites.append(("." + node.func.attr, where))
    return sites


# Device-carrying calls of Megatron-Core 0.16.1 that the redirect does not cover, and why that
# is safe here: GPU-only features that the CPU path never reaches.
NOT_ON_THE_CPU_PATH = {
    "torch.cuda.Stream": "CUDA streams for overlapped communication (GPU only)",
    "torch.cuda.random.get_rng_state": "CUDA-graph RNG capture (GPU only)",
    "torch.Generator": "inference's CUDA-graph sampling (not used by the learner)",
    "symm_mem.empty": "NVSHMEM symmetric memory (GPU only)",
}


def test_redirect_covers_every_device_call_site_of_megatron_core():
    """Every torch factory or tensor method that Megatron-Core calls with ``device=`` is
    redirected (or listed as GPU-only above): a new call site after an upgrade fails here
    instead of as 'Torch not compiled with CUDA enabled' deep in a run."""
    import megatron.core

    root = os.path.dirname(megatron.core.__file__)
    sites = _device_call_sites(root)
    assert len(sites) > 300, "the scan must see Megatron-Core's call sites"
    tensor_methods = set(cpu_compat.REDIRECTED_TENSOR_METHODS) | {"to", "cuda", "type"}
    missed = []
    for callee, where in sites:
        head, _, name = callee.rpartition(".")
        if callee in NOT_ON_THE_CPU_PATH:
            continue
        if callee.startswith("torch."):  # torch.cuda.*, torch.Generator, ... included
            if head != "torch" or name not in cpu_compat.REDIRECTED_FACTORIES:
                missed.append((callee, where))
        elif hasattr(torch.Tensor, name) and name not in tensor_methods:
            missed.append((callee, where))
    assert not missed, f"device arguments the CPU redirect does not map: {missed[:20]}"
    callees = {callee for callee, _ in sites}
    stale = set(NOT_ON_THE_CPU_PATH) - callees
    assert not stale, f"listed as GPU-only but no longer called with device=: {stale}"
    for name in cpu_compat.REDIRECTED_FACTORIES:
        assert callable(getattr(torch, name)), name
