"""Held-out accuracy of the current policy, measured through the rollout engine, and the table
of the first and last evaluation that ends a run.

Greedy decoding is approximated by a very low temperature (engines validate ``temperature > 0``
because greedy log-probs are not a policy); with a fixed seed the result is deterministic, so
an evaluation after resume equals the one an uninterrupted run makes.
"""

from __future__ import annotations

import time
from typing import Dict, List

from gspo_megatron.rollout.types import GenerationRequest, SamplingParams

EVAL_TEMPERATURE = 1e-4


def evaluate_accuracy(engine, prompts, reward_runner, tokenizer, cfg) -> Dict[str, float]:
    """Fraction of held-out prompts whose (near-)greedy answer gets reward >= 1."""
    start = time.perf_counter()
    eos = getattr(tokenizer, "eos_token_id", None)
    params = SamplingParams(temperature=EVAL_TEMPERATURE, top_p=1.0,
                            max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
                            stop_token_ids=() if eos is None else (int(eos),),
                            seed=cfg.trainer.seed)
    requests = [GenerationRequest(p.prompt_id, p.prompt_token_ids, n=1) for p in prompts]
    samples = engine.generate(requests, params)  # sorted by prompt id: score by id, not position
    rewards = reward_runner.score(samples, {p.prompt_id: p for p in prompts})
    correct = sum(r >= 1.0 for r in rewards)
    return {"eval/accuracy": correct / len(rewards), "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/num_prompts": float(len(rewards)), "time/eval_s": time.perf_counter() - start}


def before_after_table(history: List[Dict[str, float]]) -> str:
    """First and last evaluated rows of the run, side by side ('' when nothing was evaluated)."""
    evals = [row for row in history if "eval/accuracy" in row]
    if not evals:
        return ""
    first, last = evals[0], evals[-1]
    keys = [k for k in first if k.startswith("eval/") and k in last]
    lines = [f"{'metric':<20} {'step ' + str(int(first['step'])):>12} {'step ' + str(int(last['step'])):>12}"]
    lines += [f"{k:<20} {first[k]:>12.4f} {last[k]:>12.4f}" for k in keys]
    return "\n".join(lines)
