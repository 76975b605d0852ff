"""Distributed runtime: launcher detection, and real Megatron-Core forward/backward of a tiny
Qwen3-style MoE GPTModel under TP=2 (+SP), PP=2 and EP=2 on two gloo processes."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.config import ConfigError
from gspo_megatron.config.schema import ModelConfig, ParallelConfig
from gspo_megatron.distributed.runtime import detect_launch_env, init_distributed
from tests.descriptors import listening_sockets
from tests.multiproc import run_on_ranks

TINY_MOE = ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                       num_attention_heads=4, num_query_groups=2, head_dim=8, vocab_size=50,
                       make_vocab_size_divisible_by=8, max_position_embeddings=64,
                       num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                       transformer_impl="local", params_dtype="fp32")


def test_detects_torchrun_then_slurm_then_single():
    tr = detect_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                            "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port, tr.launcher) == \
        (3, 8, 1, "n1", 1234, "torchrun")
    sl = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                            "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"})
    assert (sl.rank, sl.world_size, sl.local_rank, sl.launcher) == (5, 16, 5, "slurm")
    assert sl.master_addr == "gpu07" and sl.master_port == 20000 + 4242
    single = detect_launch_env({})
    assert (single.rank, single.world_size, single.launcher) == (0, 1, "single")


def test_layout_that_does_not_fit_the_world_is_refused():
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="3 processes launched \\(torchrun\\) cannot run") as err:
        init_distributed(ParallelConfig(tp=2), environ=env)
    assert "world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2" in str(err.value)
    with pytest.raises(ConfigError, match="config says 4 but 3 processes were launched"):
        init_distributed(ParallelConfig(world_size=4), environ=env)


RENDEZVOUS = """
import json, socket, sys
from gspo_megatron.config import ConfigError
from gspo_megatron.config.schema import ParallelConfig
from gspo_megatron.distributed import runtime
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
port = taken.getsockname()[1]
runtime.free_port = lambda: port  # what another process binding the picked port first looks like
env = json.loads(sys.argv[1])
env.update(MASTER_PORT=str(port)) if env else None
try:
    info = runtime.init_distributed(ParallelConfig(), environ=env)
    print("up", info.launch.launcher, runtime.dist.get_world_size())
    runtime.shutdown_distributed()
except ConfigError as exc:
    print("refused", port, exc)
"""


def _rendezvous(env: dict) -> str:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RENDEZVOUS, json.dumps(env)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_one_process_meets_itself_without_a_port_and_a_taken_port_is_named():
    """One process needs no TCP port (a picked one can be taken before it is bound: a trainer
    failed so in a reliability run, EADDRINUSE deep in torch); several that cannot bind theirs
    get an error naming MASTER_ADDR:MASTER_PORT, not torch's traceback. In a fresh interpreter:
    the default process group is global."""
    assert _rendezvous({}) == "up single 1"
    refused = _rendezvous({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1"})
    port = refused.split()[1]
    assert refused.startswith("refused") and (f"rank 0 of 2 (torchrun) could not meet the others "
                                              f"at 127.0.0.1:{port} (MASTER_ADDR / MASTER_PORT)") \
        in refused and "EADDRINUSE" in refused, refused


def _forward_backward(rank: int, layout: dict) -> dict:
    """Train-mode forward + backward through Megatron's own schedule for this layout."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.model.provider import build_gpt_model

    parallel = ParallelConfig(**layout)
    rt = init_distributed(parallel, seed=7)
    assert rt.backend == "gloo" and rt.device.type == "cpu"
    model = build_gpt_model(TINY_MOE, parallel)
    seq, mbs, num_micro = 16, 2, 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY_MOE.vocab_size, (num_micro, mbs, seq), generator=gen)
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    batches = iter(range(num_micro))

    def forward_step(data_iterator, m):
        i = next(data_iterator)
        labels = torch.roll(tokens[i], -1, dims=1)
        loss_per_token = m(tokens[i], position_ids, causal, labels=labels)

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"loss": loss.detach()}

        return loss_per_token, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=[model],
        num_microbatches=num_micro, seq_length=seq, micro_batch_size=mbs, forward_only=False)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads, "backward produced no gradients"
    grad_sq = float(sum((g.float() ** 2).sum() for g in grads))
    loss = float(losses[0]["loss"]) if losses else None
    return {"loss": loss, "grad_sq": grad_sq, "num_params": sum(p.numel() for p in model.parameters())}


LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "ep2": dict(ep=2)}


def _all_layouts(rank: int) -> dict:
    """Every layout on the same two processes (one process group, parallel state rebuilt)."""
    from megatron.core import parallel_state

    out = {}
    for name, layout in LAYOUTS.items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        out[name] = _forward_backward(rank, layout)
    return out


@pytest.mark.slow
def test_tiny_moe_forward_backward_on_two_gloo_ranks():
    results = run_on_ranks(_all_layouts, world_size=2)
    for name in LAYOUTS:
        for r in results:
            assert r[name]["grad_sq"] > 0 and torch.isfinite(torch.tensor(r[name]["grad_sq"])), name
        last = results[-1][name]["loss"]  # the loss lives on the last pipeline stage
        assert last is not None and 2.0 < last < 6.0, f"{name}: unexpected initial loss {last}"


def _groups_left_after_shutdown(rank: int) -> list:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gspo_megatron.distributed.runtime import shutdown_distributed

    init_distributed(ParallelConfig(), seed=1)
    held = [name for name, value in vars(parallel_state).items()
            if isinstance(value, dist.ProcessGroup)]
    shutdown_distributed()
    left = [name for name, value in vars(parallel_state).items()
            if isinstance(value, dist.ProcessGroup)]
    return [held, left, listening_sockets()]


def test_shutdown_leaves_no_group_in_parallel_state():
    """Megatron-Core 0.16.1's ``destroy_model_parallel`` forgets to reset
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` (and ``_GLOO``): their gloo group outlived
    every runtime of the process (its listening socket among its descriptors)."""
    held, left, listening = run_on_ranks(_groups_left_after_shutdown, world_size=1)[0]
    assert "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO" in held and len(held) > 10
    assert left == [] and listening == 0
