"""The setup and harness of ``bench_vs_trl.py``, shared by its single-shape mode, its sweep
(``bench_vs_trl_sweep.py``) and ``bench_trees.py``; it imports none of them.

- the setup: the model and prompts (``make_assets``), gspo-train's command line and its sides
  (``gspo_command``, ``GSPO_SIDES``), the TRL side's recipe (``run_trl_child``);
- the harness: the TRL environment (``ensure_trl_venv``) and one timed run of a side in a fresh
  process (``run_side``), stopped with its children past a time limit.

The TRL side runs this file inside the TRL environment, which has no gspo_megatron installed:

    python benchmarks/vs_trl_setup.py --child trl --assets DIR --out DIR --steps N \\
        --prompts P --samples S --max-new-tokens T
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
OVERLAP_WARNING = "rollout.overlap_one_step does not pay here"  # trainer/schedule/one_step_threads.py
STEPS_PER_GENERATION = 4
GSPO_SIDES = {
    "gspo": [],
    # the split is the harness's setting, never the trainer's probe (it would be timed)
    "gspo_overlap": ["rollout.overlap_one_step=true", "rollout.overlap_probe_steps=0"],
    "gspo_learner_lp": ["algo.old_logprob_source=learner"],
}


# ---- the TRL side (runs inside the TRL virtual environment) ---------------------------------

def run_trl_child(args) -> None:
    """Train with TRL's GRPOTrainer and print one JSON line of timings."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO))  # the reward only (standard library), not the package
    from gspo_megatron.rewards.builtin import addition_reward

    assets = Path(args.assets)
    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    model = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    dataset = load_dataset("json", data_files=str(assets / "data" / "train.jsonl"), split="train")
    generated = []

    def reward(prompts, completions, completion_ids, answer, **_):
        generated.append(sum(len(c) for c in completion_ids))
        return [addition_reward(c, a) for c, a in zip(completions, answer)]

    ends = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, _args, state, *a, **k):
            if state.global_step % STEPS_PER_GENERATION == 0:  # one RL step = one generation
                ends.append(time.perf_counter())

    num_seqs = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=args.out, per_device_train_batch_size=num_seqs // STEPS_PER_GENERATION,
        steps_per_generation=STEPS_PER_GENERATION, gradient_accumulation_steps=1,
        num_generations=args.samples, max_completion_length=args.max_new_tokens,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        beta=0.0, learning_rate=1e-5, lr_scheduler_type="constant", weight_decay=0.0,
        max_steps=STEPS_PER_GENERATION * args.steps, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, seed=1234, temperature=1.0, top_p=1.0,
        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    print("RESULT " + json.dumps({"step_s": [b - a for a, b in zip(ends, ends[1:])],
                                  "gen_tokens": generated}), flush=True)


# ---- the harness ---------------------------------------------------------------------------

def ensure_trl_venv(venv: Path, trl_version: str) -> Path:
    """The TRL environment's python, creating the environment on first use."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"],
                                          capture_output=True).returncode == 0:
        return python
    import torch

    torch_version = torch.__version__.split("+")[0]
    print(f"creating {venv}: torch=={torch_version} trl=={trl_version}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}",
                    f"trl=={trl_version}"], check=True)
    return python


def make_assets(out: Path, hidden_size: int = 128, num_experts: int = 8,
                num_experts_per_tok: int = 2) -> Path:
    """The benchmark model (~0.99 M parameters at the defaults), tokenizer and prompts, written
    once per directory. Heads (4 / 2 KV of dim 32), layers (4) and expert width (64) are fixed."""
    if (out / "model" / "config.json").exists():
        return out
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.model import TinyModelSpec
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    spec = TinyModelSpec(num_layers=4, hidden_size=hidden_size, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=64)
    make_tiny_assets(out, task=AdditionTaskConfig(num_train=2000, num_eval=64), spec=spec)
    return out


def gspo_command(args, assets: Path, run_dir: Path, extra) -> list:
    return [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / "tiny_cpu.yaml"),
            f"model.hf_path={assets / 'model'}", f"data.train_path={assets / 'data' / 'train.jsonl'}",
            "data.eval_path=null", f"logging.run_dir={run_dir}", "logging.wandb.enabled=false",
            "logging.plot=false", f"trainer.num_steps={args.steps}", "trainer.num_sft_steps=0",
            f"batch.num_prompts_per_step={args.prompts}", f"rollout.n_samples_per_prompt={args.samples}",
            f"batch.num_mini_batches={STEPS_PER_GENERATION}", f"rollout.max_new_tokens={args.max_new_tokens}",
            "data.max_prompt_tokens=16", "optimizer.lr=1e-5", "optimizer.min_lr=0",
            "optimizer.lr_decay_style=constant",
            "optimizer.warmup_steps=0", "optimizer.weight_decay=0.0", "algo.old_logprob_source=rollout",
            "checkpoint.save_every_steps=0", "checkpoint.resume=never", "trainer.eval_every_steps=0",
            *([] if args.with_diagnostics else ["algo.diagnostics.expert_volatility_num_seqs=0"]),
            *extra]


def _load() -> float:
    return os.getloadavg()[0]


def _run(cmd, env, timeout_s: Optional[float]):
    """The finished process, or None when it ran past ``timeout_s`` (then its whole process
    group, which it was started as, is killed: gspo-train's engine process included)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_side(side: str, args, assets: Path, work: Path, trl_python: Path, index,
             threads: Optional[int] = None, overrides=(), timeout_s: Optional[float] = None) -> dict:
    """One fresh process of ``side`` with ``OMP_NUM_THREADS=threads`` (``--threads`` when None)
    and extra gspo-train ``overrides``; its step times, read back from the run. Past
    ``timeout_s`` the run is stopped and its step time is infinite."""
    run_dir = work / f"{side}_{index}"
    shutil.rmtree(run_dir, ignore_errors=True)  # the metrics log of a run dir is appended to
    threads = args.threads if threads is None else threads
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    if side == "trl":
        cmd = [str(trl_python), __file__, "--child", "trl", "--assets", str(assets),
               "--out", str(run_dir), "--steps", str(args.steps), "--prompts", str(args.prompts),
               "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)]
    else:
        cmd = gspo_command(args, assets, run_dir, [*GSPO_SIDES[side], *overrides])
    load_before = _load()
    start = time.perf_counter()
    proc = _run(cmd, env, timeout_s)
    whole = time.perf_counter() - start
    if proc is None:
        return {"side": side, "round": index, "threads": threads, "overrides": list(overrides),
                "step_s_median": float("inf"), "stopped_after_s": whole}
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    extra = {}
    if side == "trl":
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        data = json.loads(line[len("RESULT "):])
        step_s, tokens = data["step_s"], data["gen_tokens"]
    else:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["step"] >= 1]
        step_s = [r["time/step_s"] for r in rows]
        tokens = [r["rollout/response_len_mean"] * r["rollout/num_sequences"] for r in rows]
        extra = {k: v for r in rows for k, v in r.items() if k.startswith("overlap/probe")
                 or k == "overlap/pays"}
        extra["warned"] = OVERLAP_WARNING in proc.stdout + proc.stderr
    if len(step_s) != args.steps:
        raise RuntimeError(f"{side}: {len(step_s)} step times for {args.steps} steps")
    timed = step_s[1:]
    return {"side": side, "round": index, "threads": threads, "overrides": list(overrides),
            "step_s_median": statistics.median(timed), "step_s_all": step_s,
            "tokens_per_s": sum(tokens[1:]) / sum(timed), "whole_process_s": whole,
            "load_before": load_before, "load_after": _load(), **extra}


def main(argv=None) -> int:
    """The TRL side's process (started by :func:`run_side`): train, print one JSON line."""
    p = argparse.ArgumentParser(description="the TRL side of benchmarks/bench_vs_trl.py")
    p.add_argument("--child", choices=["trl"], required=True)
    p.add_argument("--assets", required=True)
    p.add_argument("--out", required=True)
    for flag in ("--steps", "--prompts", "--samples", "--max-new-tokens"):
        p.add_argument(flag, type=int, required=True)
    run_trl_child(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
