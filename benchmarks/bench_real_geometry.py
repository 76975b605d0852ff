"""Learner vs Hugging Face vs the real SGLang server at Qwen3-30B-A3B's real widths, on CPU.

    python benchmarks/bench_real_geometry.py --work /tmp/real_geometry --doc docs/real_geometry.md

Writes (or reuses, ``--assets``) the 1-layer Qwen3-30B-A3B checkpoint of
``tools/make_qwen3_assets.py`` and asks its chat-templated arithmetic questions
(``enable_thinking=False``). Three phases run one after another, never together, each measured
for wall time and peak owned memory (``benchmarks/owned_memory.py``: RssAnon + RssShmem over the
phase's processes):

1. **server**: the real SGLang 0.5.23 CPU server (``tests/real_sglang.py``) loads the checkpoint
   in bf16 and answers every prompt greedily with its log-probs; start time (launch to healthy),
   decode tokens/s of one sequence and of the batch.
2. **hf**: ``Qwen3MoeForCausalLM`` (transformers) teacher-forces the server's own tokens in fp32
   and in bf16: per-token log-probs, its argmax and the gap between its two best tokens.
3. **learner**: the Megatron learner's log-prob pass (``LogprobLearner.compute_logprobs``, the
   training Learner's pass without its optimizer) at TP2 x EP2 on two gloo ranks (torchrun), bf16.

Tolerance, fixed before any comparison: ``spread`` is how far HF's own bf16 run is from its fp32
run on the same tokens (max and mean |dlogp| over response tokens). A bf16 implementation that
only orders its rounding differently is as far from fp32 as HF's bf16 is, so each bf16 result
(learner, server) must lie within ``K x spread`` of HF fp32, K = 3 (``TOLERANCE_FACTOR``; the
max over a few dozen tokens is an extreme value, K leaves room for it), and two bf16 results
(learner, server, HF bf16) within ``2K x spread`` of each other (the triangle inequality through
fp32: their rounding errors are independent and may add). Greedy tokens:
random weights give near-flat distributions, so the server's argmax may differ from HF fp32's
where their two best tokens are closer than the bf16 spread (a near-tie); every position outside
a near-tie must agree.

The command, the conditions and the numbers go into the marked section of ``--doc``.
Exit code 0: every check passed; 1: one failed (the section is still written); 2: usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.owned_memory import SplitMemorySampler, run_measured  # noqa: E402

GIB = 2 ** 30
TOLERANCE_FACTOR = 3.0
BEGIN = "<!-- bench_real_geometry: begin (written by the benchmark; do not edit) -->"
END = "<!-- bench_real_geometry: end -->"


# ---- inputs ---------------------------------------------------------------------------------

def chat_prompts(model_dir: Path, eval_path: Path, num_prompts: int) -> List[List[int]]:
    """Token ids of the first ``num_prompts`` eval questions through the model's chat template
    (non-thinking mode, as a run sets ``data.chat_template_kwargs``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line) for line in eval_path.read_text().splitlines()[:num_prompts]]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
             for r in rows]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


# ---- phase 1: the real SGLang server ----------------------------------------------------------

def _generate(address: str, prompts: List[List[int]], max_new_tokens: int) -> List[dict]:
    import requests

    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}}
    resp = requests.post(f"http://{address}/generate", json=body, timeout=600)
    resp.raise_for_status()
    out = resp.json()
    return out if isinstance(out, list) else [out]


def server_phase(model_dir: Path, prompts: List[List[int]], max_new_tokens: int,
                 log_path: Path) -> dict:
    """Start the server, answer every prompt greedily, time decoding, stop it."""
    from tests.real_sglang import RealServer

    server = RealServer(str(model_dir), log_path)

    def is_server(pid: int) -> bool:  # its launcher, known once started; its children with it
        return server.process is not None and pid == server.process.pid

    # only the server's own tree: this process may have other children (a test session's
    # commands run ahead: fresh clone 8 counted them, 6.6 GiB against the server's ~3.3)
    sampler = SplitMemorySampler(os.getpid(), is_server).start()
    try:
        t0 = time.monotonic()
        server.start()
        start_s = time.monotonic() - t0
        try:
            _generate(server.address, [prompts[0]], 2)  # warm-up
            t0 = time.monotonic()
            _generate(server.address, [prompts[0]], 1)
            one_token_s = time.monotonic() - t0
            t0 = time.monotonic()
            _generate(server.address, [prompts[0]], max_new_tokens)
            single_s = time.monotonic() - t0
            t0 = time.monotonic()
            answers = _generate(server.address, prompts, max_new_tokens)
            batch_s = time.monotonic() - t0
        finally:
            server.stop()
    finally:
        sampler.stop()
    peak = sampler.overall()["branch"]
    timings = re.findall(r"Engine startup timings \(s\): (load_weight=[\d.]+).*?"
                         r"(scheduler_e2e=[\d.]+).*?(tokenizer_e2e=[\d.]+)",
                         log_path.read_text(errors="replace"))
    tokens = [[int(t[1]) for t in a["meta_info"]["output_token_logprobs"]] for a in answers]
    logprobs = [[float(t[0]) for t in a["meta_info"]["output_token_logprobs"]] for a in answers]
    return {"tokens": tokens, "logprobs": logprobs, "start_s": start_s,
            "startup_timings": ", ".join(timings[-1]) if timings else "not logged",
            "peak_owned_gib": peak / GIB,
            "decode_tok_s_single": (max_new_tokens - 1) / max(single_s - one_token_s, 1e-9),
            "decode_tok_s_batch": len(prompts) * max_new_tokens / batch_s}


# ---- phase 2: Hugging Face ---------------------------------------------------------------------

def hf_teacher_forced(model_dir: Path, sequences: List[List[int]], prompt_lens: List[int],
                      dtype: torch.dtype) -> dict:
    """Per response token: log-prob of the given token, the argmax and the top-1 - top-2 gap."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype).eval()
    out: Dict[str, list] = {"logprobs": [], "argmax": [], "gap": []}
    with torch.no_grad():
        for seq, p in zip(sequences, prompt_lens):
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[p - 1:-1]
            targets = ids[0, p:]
            out["logprobs"].append(logp.gather(-1, targets[:, None])[:, 0])
            top2 = logp.topk(2, dim=-1)
            out["argmax"].append(top2.indices[:, 0])
            out["gap"].append(top2.values[:, 0] - top2.values[:, 1])
    del model
    return out


def hf_main(work: Path) -> None:
    seqs = json.loads((work / "sequences.json").read_text())
    result = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        result[name] = hf_teacher_forced(Path(seqs["model_dir"]), seqs["sequences"],
                                         seqs["prompt_lens"], dtype)
    torch.save(result, work / "hf.pt")


# ---- phase 3: the Megatron learner (torchrun, 2 ranks) -----------------------------------------

def learner_main(work: Path, tp: int, ep: int) -> None:
    from gspo_megatron.checkpoint.convert import model_config_for_hf_dir
    from gspo_megatron.checkpoint.learner_hf import load_hf_into_learner
    from gspo_megatron.config.schema import GSPOConfig, ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.batch import SequenceBatch
    from gspo_megatron.learner.learner import LogprobLearner

    seqs = json.loads((work / "sequences.json").read_text())
    cfg = GSPOConfig()
    cfg.model = model_config_for_hf_dir(seqs["model_dir"])
    cfg.parallel = ParallelConfig(tp=tp, ep=ep, sp=tp > 1)
    runtime = init_distributed(cfg.parallel, seed=0)
    policy = LogprobLearner(cfg, runtime)
    load_hf_into_learner(policy, seqs["model_dir"])
    batch = SequenceBatch(token_ids=[torch.tensor(s) for s in seqs["sequences"]],
                          prompt_lens=seqs["prompt_lens"])
    out = policy.compute_logprobs(batch, temperature=1.0)
    if torch.distributed.get_rank() == 0:
        torch.save({"logprobs": out.logprobs,
                    "params_dtype": str(next(policy.model[0].parameters()).dtype)},
                   work / "learner.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---- the comparison ------------------------------------------------------------------------

def _flat(values) -> torch.Tensor:
    return torch.cat([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values])


def gap_stats(a, b) -> Dict[str, float]:
    d = (_flat(a) - _flat(b)).abs()
    return {"max": float(d.max()), "mean": float(d.mean())}


@dataclass
class Comparison:
    """Every |dlogp| (max / mean over response tokens), the tolerances and the argmax count."""

    num_tokens: int
    spread: Dict[str, float]
    """HF bf16 vs HF fp32: the bf16 rounding of one implementation."""
    tolerance: Dict[str, float]
    """Of a bf16 result against HF fp32."""
    tolerance_bf16: Dict[str, float]
    """Between two bf16 results."""
    pairs: Dict[str, Dict[str, float]]
    argmax_agree: int
    argmax_flips: int
    near_ties: int
    flips_outside_near_ties: int
    failures: List[str] = field(default_factory=list)

    def bound(self, pair: str) -> Dict[str, float]:
        """The tolerance of one pair: against fp32, or between two bf16 results."""
        return self.tolerance if pair.endswith("fp32") else self.tolerance_bf16


def compare(server: dict, hf: dict, learner: dict, factor: float = TOLERANCE_FACTOR) -> Comparison:
    spread = gap_stats(hf["bf16"]["logprobs"], hf["fp32"]["logprobs"])
    tol = {k: factor * v for k, v in spread.items()}
    tol_bf16 = {k: 2 * v for k, v in tol.items()}
    pairs = {"learner vs HF fp32": gap_stats(learner["logprobs"], hf["fp32"]["logprobs"]),
             "learner vs HF bf16": gap_stats(learner["logprobs"], hf["bf16"]["logprobs"]),
             "server vs HF fp32": gap_stats(server["logprobs"], hf["fp32"]["logprobs"]),
             "server vs HF bf16": gap_stats(server["logprobs"], hf["bf16"]["logprobs"]),
             "server vs learner": gap_stats(server["logprobs"], learner["logprobs"])}
    greedy = _flat(server["tokens"]).long()
    argmax = _flat(hf["fp32"]["argmax"]).long()
    near_tie = _flat(hf["fp32"]["gap"]) < spread["max"]
    flips = greedy != argmax
    cmp = Comparison(num_tokens=int(greedy.numel()), spread=spread, tolerance=tol,
                     tolerance_bf16=tol_bf16, pairs=pairs,
                     argmax_agree=int((~flips).sum()), argmax_flips=int(flips.sum()),
                     near_ties=int(near_tie.sum()),
                     flips_outside_near_ties=int((flips & ~near_tie).sum()))
    for name, stats in pairs.items():
        bound = cmp.bound(name)
        for k in ("max", "mean"):
            if not stats[k] <= bound[k]:
                cmp.failures.append(f"{name}: {k} |dlogp| {stats[k]:.4g} > {bound[k]:.4g}")
    if cmp.flips_outside_near_ties:
        cmp.failures.append(f"{cmp.flips_outside_near_ties} greedy tokens differ from HF fp32's "
                            "argmax outside a near-tie")
    return cmp


# ---- running it all ------------------------------------------------------------------------

def _python_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_phases(model_dir: Path, eval_path: Path, work: Path, num_prompts: int,
               max_new_tokens: int, tp: int = 2, ep: int = 2,
               timeout_s: float = 1800.0) -> dict:
    """Server, then HF, then learner, one after another; returns every measurement."""
    work.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompts(model_dir, eval_path, num_prompts)
    t0 = time.monotonic()
    server = server_phase(model_dir, prompts, max_new_tokens, work / "server.log")
    server["wall_s"] = time.monotonic() - t0
    seqs = {"model_dir": str(model_dir), "sequences": [p + t for p, t in zip(prompts,
                                                                             server["tokens"])],
            "prompt_lens": [len(p) for p in prompts]}
    (work / "sequences.json").write_text(json.dumps(seqs))
    me = [sys.executable, str(Path(__file__).resolve())]
    phases = {"hf": me + ["--phase", "hf", "--work", str(work)],
              "learner": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={tp * 1}", *me[1:], "--phase", "learner",
                          "--work", str(work), "--tp", str(tp), "--ep", str(ep)]}
    measured = {}
    for name, cmd in phases.items():
        run = run_measured(cmd, env=_python_env(), cwd=str(REPO), timeout_s=timeout_s)
        if run.returncode != 0:
            raise RuntimeError(f"{name} phase failed ({run.returncode}):\n{run.output[-4000:]}")
        measured[name] = {"wall_s": run.wall_s, "peak_owned_gib": run.peak_bytes / GIB}
    hf, learner = torch.load(work / "hf.pt"), torch.load(work / "learner.pt")
    return {"server": server, "hf": hf, "learner": learner, "measured": measured,
            "prompt_lens": seqs["prompt_lens"],
            "comparison": compare(server, hf, learner)}


def section(result: dict, argv: List[str], conditions: Dict[str, str]) -> str:
    c, s, m = result["comparison"], result["server"], result["measured"]
    lines = [BEGIN, "", "```bash", shlex.join(["python", "benchmarks/bench_real_geometry.py",
                                               *argv]), "```", "",
             "Conditions: " + "; ".join(f"{k} {v}" for k, v in conditions.items()) + ".", "",
             f"{len(s['tokens'])} chat-templated prompts ({min(result['prompt_lens'])}-"
             f"{max(result['prompt_lens'])} tokens), {c.num_tokens} greedy response tokens "
             "teacher-forced through HF and the learner.", "",
             "| phase | wall s | peak owned GiB |", "|---|---|---|",
             f"| SGLang server (start {s['start_s']:.1f} s, decode {s['decode_tok_s_single']:.2f} "
             f"tok/s one sequence, {s['decode_tok_s_batch']:.2f} tok/s batch of "
             f"{len(s['tokens'])}) | {s['wall_s']:.1f} | {s['peak_owned_gib']:.2f} |",
             f"| HF fp32 then bf16 | {m['hf']['wall_s']:.1f} | {m['hf']['peak_owned_gib']:.2f} |",
             f"| learner TP2xEP2, 2 ranks, bf16 | {m['learner']['wall_s']:.1f} | "
             f"{m['learner']['peak_owned_gib']:.2f} |", "",
             f"SGLang's own start-up timings (s): {s['startup_timings']}.", "",
             f"HF's own bf16-vs-fp32 spread: max {c.spread['max']:.4f}, mean "
             f"{c.spread['mean']:.5f}. Tolerance against HF fp32 = {TOLERANCE_FACTOR:g} x spread, "
             f"between two bf16 results = {2 * TOLERANCE_FACTOR:g} x spread.", "",
             "| pair | max abs dlogp | mean abs dlogp | tolerance max / mean | within |",
             "|---|---|---|---|---|"]
    for name, st in c.pairs.items():
        b = c.bound(name)
        ok = st["max"] <= b["max"] and st["mean"] <= b["mean"]
        lines.append(f"| {name} | {st['max']:.4f} | {st['mean']:.5f} | {b['max']:.4f} / "
                     f"{b['mean']:.5f} | {'yes' if ok else '**no**'} |")
    lines += ["", f"Greedy argmax: server = HF fp32 on {c.argmax_agree} / {c.num_tokens} tokens; "
              f"{c.near_ties} near-ties (top-2 gap < bf16 spread), {c.argmax_flips} flips, "
              f"{c.flips_outside_near_ties} outside a near-tie.", "",
              "Result: " + ("every check passed." if not c.failures
                            else "**failed**: " + "; ".join(c.failures)), "", END]
    return "\n".join(lines)


def write_doc(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no section marked {BEGIN!r} ... {END!r}")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(head + text + rest.split(END, 1)[1])


def _conditions(load_before: float) -> Dict[str, str]:
    import megatron.core
    import transformers

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "CPUs": str(os.cpu_count()),
            "load average (1 min) at start / end": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}",
            "code": commit,
            "versions": f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
                        f"transformers {transformers.__version__}, sglang 0.5.23 (CPU)",
            "memory": "RssAnon + RssShmem summed over the phase's processes, sampled every 0.1 s"}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/bench_real_geometry")
    parser.add_argument("--assets", default=None,
                        help="a make_qwen3_assets directory to reuse (default: WORK/assets)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--doc", default=None, help="markdown file whose marked section to replace")
    parser.add_argument("--phase", choices=["hf", "learner"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--ep", type=int, default=2, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    opts = parser.parse_args(argv)
    work = Path(opts.work)
    if opts.phase == "hf":
        hf_main(work)
        return 0
    if opts.phase == "learner":
        learner_main(work, opts.tp, opts.ep)
        return 0
    from gspo_megatron.real_geometry.assets import make_qwen3_assets

    assets = Path(opts.assets) if opts.assets else work / "assets"
    if not (assets / "model" / "config.json").exists():
        make_qwen3_assets(assets, geometry="30b", num_layers=1)
    load_before = os.getloadavg()[0]
    result = run_phases(assets / "model", assets / "data" / "eval.jsonl", work / "run",
                        opts.num_prompts, opts.max_new_tokens)
    text = section(result, argv, _conditions(load_before))
    (work / "results.json").write_text(json.dumps(
        {"comparison": asdict(result["comparison"]), "measured": result["measured"],
         **{k: v for k, v in result["server"].items() if k not in ("tokens", "logprobs")}},
        indent=1))
    print("\n" + text)
    if opts.doc:
        write_doc(Path(opts.doc), text)
    return 1 if result["comparison"].failures else 0


if __name__ == "__main__":
    sys.exit(main())
