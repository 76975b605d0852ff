"""Learner throughput: tokens/s and model FLOP/s of GSPO train steps, against measured matmul peak.

Runs the real learner (Megatron-Core schedules, DDP, distributed optimizer, packed micro-batches)
on a synthetic rollout batch and reports, as one JSON line:

* ``tokens_per_s``: prompt+response tokens processed per second of ``train_step``;
* ``model_tflops``: model FLOPs per second, counted analytically (6 x active parameters per token
  for the matmuls incl. the output layer, plus causal attention 12 x layers x heads x head_dim x
  mean context) -- the MFU convention, so recomputation and padding do not count;
* ``matmul_peak_tflops``: what this device's own dense matmul reaches (fp32 on CPU, bf16 on GPU);
* ``ratio``: model FLOP/s over that peak.

    OMP_NUM_THREADS=2 python benchmarks/bench_learner.py                 # CPU, tiny MoE
    torchrun --nproc_per_node=1 benchmarks/bench_learner.py --preset gpu  # one GPU, TE + bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gspo_megatron.config.schema import GSPOConfig, ModelConfig, ParallelConfig  # noqa: E402

PRESETS = {
    # Small enough for a shared 2-core CPU, large enough that matmuls dominate.
    "cpu": dict(model=dict(num_layers=2, hidden_size=256, ffn_hidden_size=512,
                           num_attention_heads=8, num_query_groups=4, head_dim=32,
                           vocab_size=2048, num_experts=8, moe_router_topk=2,
                           moe_ffn_hidden_size=256, transformer_impl="local", params_dtype="fp32"),
                num_seqs=16, min_len=96, max_len=256, max_tokens=1024, matmul_n=1024),
    # Qwen3-30B-A3B-shaped layers, 4 of them, on one GPU.
    "gpu": dict(model=dict(num_layers=4, hidden_size=2048, ffn_hidden_size=6144,
                           num_attention_heads=32, num_query_groups=4, head_dim=128,
                           vocab_size=151936, num_experts=128, moe_router_topk=8,
                           moe_ffn_hidden_size=768, moe_grouped_gemm=True,
                           moe_token_dispatcher="alltoall"),
                num_seqs=64, min_len=512, max_len=2048, max_tokens=16384, matmul_n=8192),
}


@dataclass
class FlopCount:
    per_token_matmul: float
    attention_per_token_ctx: float

    def train_flops(self, lengths) -> float:
        """6 x active params per token + causal attention (QK^T and AV, fwd + 2x bwd)."""
        tokens = sum(lengths)
        ctx = sum(n * (n + 1) / 2 for n in lengths)  # sum over tokens of attended positions
        return 6.0 * self.per_token_matmul * tokens + 12.0 * self.attention_per_token_ctx * ctx


def flop_count(m: ModelConfig) -> FlopCount:
    """Active (per-token) matmul parameters; the embedding lookup is not a matmul."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    attn = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    if m.num_experts > 0:
        mlp = m.num_experts * m.hidden_size + m.moe_router_topk * 3 * m.hidden_size * m.moe_ffn_hidden_size
    else:
        mlp = 3 * m.hidden_size * m.ffn_hidden_size
    active = m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size
    return FlopCount(per_token_matmul=float(active),
                     attention_per_token_ctx=float(m.num_layers * q))


def matmul_peak(n: int, device: torch.device, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """Sustained FLOP/s of an n x n x n matmul on this device."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    sync()
    return 2.0 * n ** 3 * iters / (time.perf_counter() - start)


def synthetic_batch(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int):
    from gspo_megatron.learner.batch import SequenceBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=gen).tolist()
    tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    prompts = [max(1, n // 4) for n in lengths]
    adv = torch.randn(num_seqs, generator=gen).tolist()
    return SequenceBatch(token_ids=tokens, prompt_lens=prompts, advantages=adv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="default: gpu when CUDA is available, else cpu")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps (after 1 warm-up)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.distributed.runtime import init_distributed, shutdown_distributed
    from gspo_megatron.learner.learner import Learner

    preset = PRESETS[args.preset or ("gpu" if torch.cuda.is_available() else "cpu")]
    cfg = GSPOConfig()
    cfg.model = ModelConfig(arch="qwen3_moe", max_position_embeddings=4096, **preset["model"])
    cfg.parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, sp=args.tp > 1)
    cfg.batch.max_tokens_per_micro_batch = preset["max_tokens"]
    cfg.optimizer.lr = 1e-6
    rt = init_distributed(cfg.parallel, seed=0)
    try:
        learner = Learner(cfg, rt, total_steps=args.steps + 1)
        dtype = torch.bfloat16 if rt.device.type == "cuda" else torch.float32
        peak = matmul_peak(preset["matmul_n"], rt.device, dtype)
        loss = get_policy_loss("gspo")
        flops = flop_count(learner.model_cfg)
        batch = synthetic_batch(preset["num_seqs"], preset["min_len"], preset["max_len"],
                                cfg.model.vocab_size, seed=0)
        learner.train_step(batch, loss)  # warm-up: allocations, first-call overheads
        elapsed, tokens, model_flops = 0.0, 0, 0.0
        for step in range(args.steps):
            batch = synthetic_batch(preset["num_seqs"], preset["min_len"], preset["max_len"],
                                    cfg.model.vocab_size, seed=step + 1)
            metrics = learner.train_step(batch, loss)
            elapsed += metrics["step_time_s"]
            lengths = [len(t) for t in batch.token_ids]
            tokens += sum(lengths)
            model_flops += flops.train_flops(lengths)
        world = rt.world_size
        result = {
            "device": str(rt.device.type), "world_size": world, "threads": torch.get_num_threads(),
            "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep},
            "model": {k: v for k, v in preset["model"].items() if k != "transformer_impl"},
            "tokens_per_s": tokens / elapsed,
            "model_tflops": model_flops / elapsed / 1e12,
            "matmul_peak_tflops": peak / 1e12 * world,
            "ratio": (model_flops / elapsed) / (peak * world),
            "steps": args.steps, "tokens_per_step": tokens / args.steps,
            "micro_batches_per_step": metrics["num_micro_batches"],
        }
        if rt.is_main:
            print(json.dumps(result))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
