"""Let real Megatron-Core run on CPU (gloo) by answering its CUDA assumptions.

Megatron-Core 0.16.1 is written for GPUs: it asks ``torch.cuda.current_device()`` where to put
tensors, creates some with ``device="cuda"``, keeps RNG states in CUDA generators and, without
Transformer Engine, refers to an undefined ``te_general_gemm``. None of these are numerical: the
model code itself is device-agnostic. Each patch below answers one assumption and carries a
``probe`` that shows, in a fresh interpreter without the patches, that it is still needed;
``tests/test_cpu_compat.py`` runs every probe, so a Megatron upgrade that fixes one (or moves it)
makes a test fail and the patch can be dropped or updated.

Apply with :func:`apply_cpu_compat` only when no GPU is present; it refuses to run on a GPU.
What was measured and why each patch exists: ``../shared/notes/megatron-on-cpu.md``.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable, List

import torch

from gspo_megatron.distributed.deferred_imports import defer_import, megatron_imports_wandb

log = logging.getLogger(__name__)

_APPLIED = False
_LOCK = threading.Lock()
_CPU = torch.device("cpu")


def _to_cpu_device(device):
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:0"``, ``0``, torch.device) to CPU."""
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


def _cuda_type_name(tensor: torch.Tensor) -> str:
    """``Tensor.type()`` as it would read on a GPU ("torch.cuda.FloatTensor" for a CPU float)."""
    name = torch._C._TensorBase.type(tensor)
    if tensor.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
        return "torch.cuda." + name[len("torch."):]
    return name


# Every torch factory Megatron-Core 0.16.1 calls with ``device=`` (an AST scan of its source,
# re-run by tests/test_cpu_compat.py so a new call site fails a test), and their siblings.
REDIRECTED_FACTORIES = (
    "arange", "as_tensor", "empty", "empty_like", "empty_strided", "eye", "full", "full_like",
    "linspace", "ones", "ones_like", "rand", "rand_like", "randint", "randint_like", "randn",
    "randn_like", "randperm", "tensor", "zeros", "zeros_like")
REDIRECTED_TENSOR_METHODS = ("new_empty", "new_full", "new_ones", "new_tensor", "new_zeros")


def _device_kwarg_to_cpu(factory):
    """``factory`` with a CUDA ``device=`` keyword mapped to the CPU; a Python call per use."""

    @functools.wraps(factory)
    def call(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _to_cpu_device(device)
        return factory(*args, **kwargs)

    call.cuda_to_cpu = True
    return call


def _tensor_to(original):
    """``Tensor.to`` with a CUDA device, positional or keyword, mapped to the CPU."""

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args:
            args = (_to_cpu_device(args[0]),) + args[1:]
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _to_cpu_device(device)
        return original(self, *args, **kwargs)

    to.cuda_to_cpu = True
    return to


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """``Tensor.cuda()`` on a machine whose device is the CPU: the tensor itself."""
    return self


_tensor_cuda.cuda_to_cpu = True


def _tensor_type(original):
    """``Tensor.type()`` without arguments answers as on a GPU; with a target it converts."""

    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if not args and not kwargs:
            return _cuda_type_name(self)
        return original(self, *args, **kwargs)

    type_.cuda_to_cpu = True
    return type_


def redirect_installed() -> bool:
    """Whether CUDA device arguments are mapped to the CPU in this process."""
    return bool(getattr(torch.zeros, "cuda_to_cpu", False))


# ---- the patches -----------------------------------------------------------------------------


def _eager(fn=None, **_kwargs):
    """``torch.compile``'s decorator forms, returning the function itself."""
    return fn if fn is not None else (lambda f: f)


def _patch_jit_fuser() -> None:
    """Import Megatron with ``torch.compile`` as a no-op, so its ``jit_fuser`` is one.

    ``megatron/core/jit.py`` sets ``jit_fuser = torch.compile`` when Megatron is imported and
    ~40 fusion helpers are decorated with it at import time; the first decoration imports
    ``torch._dynamo``: ~2.5 CPU-seconds of every process start (docs/performance.md). None of
    these helpers is on the CPU path (local spec, unfused bias/activation), and compiling them on
    CPU would need inductor's C++ toolchain. Must run before anything imports Megatron; later it
    only makes decorations that are still to come eager (``disable_jit_fuser``).
    """
    import sys

    if "megatron.core.jit" in sys.modules:
        import megatron.core.jit as jit

        jit.disable_jit_fuser()
        return
    original = torch.compile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401  (runs every @jit_fuser decoration now)
    finally:
        torch.compile = original  # type: ignore[assignment]


def _patch_save_results_queue() -> None:
    """Give Megatron's checkpoint writer an in-process results queue.

    On the first save of a process, ``dist_checkpointing/strategies/filesystem_async.py``
    creates ``mp.get_context("spawn").Manager().Queue()``: a server process with a fresh
    interpreter, ~2-4 s of every process that saves (and an error when the main module has no
    ``__main__`` guard). It only matters for asynchronous saves, whose writer is another
    process; the synchronous ``dist_checkpointing.save`` used here puts and gets the write
    results in this process (the forked file writers use their own local queue).
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


class _DoneWork:
    """What an async collective returns, for one that was already complete."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _single_rank_identity(collective):
    """``collective(output, input, ...)`` as a copy when its group holds this rank only."""
    import torch.distributed as dist

    def call(output, input_, *args, group=None, async_op=False, **kwargs):
        if dist.get_world_size(group) != 1:
            return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)
        if output.data_ptr() != input_.data_ptr() or output.shape != input_.shape:
            output.copy_(input_.view_as(output))
        return _DoneWork() if async_op else None

    call.single_rank_identity = True
    return call


def _patch_single_rank_collectives() -> None:
    """Skip gloo for the data-parallel collectives of a one-rank group (DP = 1).

    Megatron's DDP buckets reduce-scatter their grads and all-gather their params through the
    distributed optimizer's group at every step (``distributed/param_and_grad_buffer.py``,
    ``start_grad_sync`` / ``start_param_sync``), also when that group is this rank alone. Gloo
    still runs them: a size-1 reduce-scatter of a 1.2 MB buffer measured 26 ms wall (3.7 ms
    CPU). Over one rank both are the identity (the shard is the whole buffer), so they become a
    copy (none at all when, as Megatron passes them, input and output are the same memory).
    """
    from megatron.core.distributed import param_and_grad_buffer as pgb

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        current = getattr(pgb, name)
        if not getattr(current, "single_rank_identity", False):
            setattr(pgb, name, _single_rank_identity(current))


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def _patch_device_arguments() -> None:
    """Map ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` to the CPU where they are spelt.

    Only the calls that can carry a device pay for the redirect: the torch factories, the
    tensor factory methods, ``Tensor.to`` / ``.cuda`` / ``.type``. A ``TorchFunctionMode``
    did this before and saw every torch call of the thread (35k per RL step of the benchmark
    MoE, ~20% of the learner update: docs/performance.md). Global, so every thread sees it.
    """
    if redirect_installed():
        return
    # ``with torch.device("meta")`` places the calls of the factories in a set torch builds on
    # first use, by identity: built after the swap below, it would hold the wrappers, never the
    # functions the device context sees, and a model meant for the meta device would be
    # allocated whole on the CPU (issue 41: one 235B layer, 43 s and 7.5 GB). Build it first.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in REDIRECTED_FACTORIES:
        setattr(torch, name, _device_kwarg_to_cpu(getattr(torch, name)))
    for name in REDIRECTED_TENSOR_METHODS:
        setattr(torch.Tensor, name, _device_kwarg_to_cpu(getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)  # type: ignore[method-assign]
    torch.Tensor.cuda = _tensor_cuda  # type: ignore[method-assign]
    torch.Tensor.type = _tensor_type(torch.Tensor.type)  # type: ignore[method-assign]


def _patch_rng() -> None:
    """Back Megatron's CUDA RNG tracker with the CPU generator (the CPU *is* the device here)."""
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]


def _patch_te_general_gemm() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_adam_step_state() -> None:
    """Let the distributed optimizer load its reshardable state into torch's Adam.

    Without Transformer Engine or apex, Megatron falls back to ``torch.optim.AdamW``, which keeps
    a per-parameter ``step`` tensor in its state. ``load_parameter_state_from_fully_reshardable``
    deliberately leaves ``step`` out (it restores it from the param groups), but
    ``_set_main_param_and_optimizer_states`` then copies every key of the destination state and
    fails with ``KeyError: 'step'``. Copy only the keys that were loaded, never ``step`` (the
    ``dp_reshardable`` form's entries hold the loading optimizer's own step, 0, as a
    non-persistent value, and a ``padding`` flag beside the tensors).

    Also, ``DistributedOptimizer.state_dict`` asserts that torch's state holds exactly one
    ``step`` value, which fails before the first step (empty state) -- exactly when a run
    resumes from a checkpoint. Give empty states the zeros and ``step=0`` that torch's Adam
    itself would start from. And ``load_state_dict`` gives every parameter the *same* ``step``
    tensor, which torch's Adam then increments once per parameter in place (wrong bias
    correction after a resume): give each parameter its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    original_state_dict = DistributedOptimizer.state_dict

    def state_dict(self):
        inner = self.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    state = inner.state[param]
                    if len(state) == 0:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(param)
                        state["exp_avg_sq"] = torch.zeros_like(param)
        return original_state_dict(self)

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            # 'step' comes from the param groups (load_state_dict); the dp_reshardable entries
            # carry the fresh optimizer's own step tensor (0) and a 'padding' flag beside them
            if key != "step" and key in dst and torch.is_tensor(value):
                dst[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer.state_dict = state_dict
    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        inner = self.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].detach().clone()

    DistributedOptimizer.load_state_dict = load_state_dict


def _patch_linear_backward_grad_layout() -> None:
    """Hand Megatron's linear backward a contiguous output gradient.

    ``GPTModel`` returns its logits transposed (``[s, b, V] -> [b, s, V]``), so the gradient
    reaching the output layer is a non-contiguous ``[s, b, V]`` view. Both of Megatron's linear
    backwards start with ``grad_input = grad_output.matmul(weight)`` (``tensor_parallel/layers.py``:
    ``LinearWithFrozenWeight`` and ``LinearWithGradAccumulationAndAsyncCommunication``), and
    torch's matmul folds a 3-D left operand into one GEMM only when that needs no copy (or when it
    requires grad, which a gradient in a backward does not): otherwise it broadcasts the weight
    to ``[s, V, h]`` and runs a batched GEMM, which on CPU materialises ``s`` copies of the
    weight. For Qwen3's output layer (151,936 x 2048 bf16) and 37-token rows that is 23 GB, in
    the backward of every micro-batch. Contiguous, the same matmul is one ``[s*b, V] x [V, h]``
    GEMM; the weight-gradient code that follows makes the gradient contiguous anyway
    (``prepare_input_tensors_for_wgrad_compute``), so the trainable path pays nothing and the
    frozen one (``optimizer.freeze``) one ``[s*b, V]`` copy. Only a non-contiguous gradient of
    more than two dimensions is touched: 2-D ones (the experts') fold as they are, and copying
    them earlier raised the planner benchmark's MoE peaks by up to 19 MB (``docs/planner.md``).
    """
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithFrozenWeight, layers.LinearWithGradAccumulationAndAsyncCommunication):
        original = cls.backward

        def backward(ctx, grad_output, *rest, _original=original):
            if grad_output.dim() > 2 and not grad_output.is_contiguous():  # what matmul can't fold
                grad_output = grad_output.contiguous()
            return _original(ctx, grad_output, *rest)

        cls.backward = staticmethod(backward)


# ---- probes: each returns True when, unpatched, the assumption still breaks on CPU ------------


def _probe_linear_backward_grad_layout() -> bool:
    """A transposed 3-D gradient through the frozen linear's backward still broadcasts the
    weight into a batched GEMM (``aten.bmm``) instead of one ``aten.mm``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    seen = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    weight = torch.randn(6, 4)
    x = torch.randn(3, 2, 4, requires_grad=True)
    out = LinearWithFrozenWeight.apply(x, weight, None, False, None)  # [3, 2, 6]
    grad = torch.randn(2, 3, 6).transpose(0, 1)  # non-contiguous, as GPTModel's logits give it
    with Ops():
        out.backward(grad)
    return "bmm" in seen


def _probe_save_results_queue() -> bool:
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return "Manager()" in inspect.getsource(filesystem_async._get_write_results_queue)


def _probe_single_rank_collectives() -> bool:
    import inspect

    from megatron.core.distributed import param_and_grad_buffer as pgb

    source = inspect.getsource(pgb._ParamAndGradBucketGroup.start_grad_sync)
    return "dist_reduce_scatter_func(" in source and "_size == 1" not in source


def _probe_jit_fuser() -> bool:
    import megatron.core.jit as jit

    return jit.jit_fuser is torch.compile


def _probe_current_device() -> bool:
    try:
        torch.cuda.current_device()
        return False
    except (AssertionError, RuntimeError):
        return True


def _probe_device_arguments() -> bool:
    import inspect

    import megatron.core.pipeline_parallel.schedules as schedules

    return 'device="cuda"' in inspect.getsource(schedules)


def _probe_tensor_type_names() -> bool:
    import inspect

    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    return "'torch.cuda.FloatTensor'" in inspect.getsource(distrib_optimizer)


def _probe_torch_adam_step_state() -> bool:
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer._set_main_param_and_optimizer_states)
    return "for key in dst_tensors" in source


def _probe_rng() -> bool:
    import megatron.core.tensor_parallel.random as mrandom

    try:
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("probe", 1)
        return False
    except (AssertionError, RuntimeError):
        return True


def _probe_te_general_gemm() -> bool:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    apply: Callable[[], None]
    probe: Callable[[], bool]


PATCHES: List[Patch] = [
    Patch("deferred_wandb", "Megatron imports wandb at import (inference contexts, timers: "
          "~0.35 s per process) for code the CPU path never runs; loaded on first use instead",
          lambda: defer_import("wandb"), megatron_imports_wandb),
    Patch("jit_fuser", "Megatron decorates its fusion helpers with torch.compile at import, "
          "which imports torch._dynamo (~2.5 s per process); none runs on the CPU path",
          _patch_jit_fuser, _probe_jit_fuser),
    Patch("current_device", "tensor placement asks torch.cuda.current_device(); "
          "torch.cuda.synchronize is called between steps", _patch_current_device,
          _probe_current_device),
    Patch("device_arguments", "schedules and buffers create tensors with device='cuda' "
          "(schedules.py total_num_tokens, GlobalMemoryBuffer for SP, causal masks)",
          _patch_device_arguments, _probe_device_arguments),
    Patch("tensor_type_names", "the distributed optimizer and grad clipping check "
          "param.type() == 'torch.cuda.FloatTensor' (answered by the Tensor.type redirect "
          "that device_arguments installs)", lambda: None, _probe_tensor_type_names),
    Patch("torch_adam_step_state", "loading distributed-optimizer state into torch's AdamW "
          "(the no-TE/apex fallback) fails with KeyError 'step', and state_dict() of a fresh "
          "one fails its single-step assertion",
          _patch_torch_adam_step_state, _probe_torch_adam_step_state),
    Patch("rng", "the model-parallel RNG tracker keeps CUDA generator states",
          _patch_rng, _probe_rng),
    Patch("save_results_queue", "the checkpoint writer starts a spawn Manager process for "
          "its results queue on the first save (~2-4 s); synchronous saves need none",
          _patch_save_results_queue, _probe_save_results_queue),
    Patch("single_rank_collectives", "DDP reduce-scatters grads and all-gathers params over "
          "the data-parallel group even when it is one rank (gloo: ~26 ms a step)",
          _patch_single_rank_collectives, _probe_single_rank_collectives),
    Patch("te_general_gemm", "moe_utils refers to te_general_gemm without Transformer Engine",
          _patch_te_general_gemm, _probe_te_general_gemm),
    Patch("linear_backward_grad_layout", "the output layer's transposed gradient makes torch's CPU "
          "matmul copy the weight once per sequence position in the backward (23 GB at "
          "Qwen3's vocabulary and 37-token rows)",
          _patch_linear_backward_grad_layout, _probe_linear_backward_grad_layout),
]


def apply_cpu_compat() -> None:
    """Apply every patch once per process. Raises on a machine with a GPU."""
    global _APPLIED
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat must not be applied on a machine with a GPU")
    with _LOCK:
        if _APPLIED:
            return
        for patch in PATCHES:
            patch.apply()
        _APPLIED = True
    log.debug("Megatron-Core CPU compatibility patches applied: %s", [p.name for p in PATCHES])


def cpu_compat_applied() -> bool:
    """Whether this process runs with the patches (the GPU kit checks that it does not)."""
    return _APPLIED
