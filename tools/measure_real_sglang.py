"""Measure the real SGLang 0.5.23 server on this CPU machine and write docs/real_sglang.md.

    make sglang-venv && .venv/bin/python tools/measure_real_sglang.py [--launches 3]

For each of ``--launches`` fresh launches of the CPU server on the free-text tiny Qwen3-MoE
(``tests/real_sglang.py``, the command line our launcher builds for ``rollout.sglang.device=cpu``):
seconds to the first healthy ``/health_generate`` and the resident memory of its process group.
Then, on one server: the engine-vs-teacher-forced log-prob gap per token at temperature 1 and
0.7 with the checkpoint's dtype (float32) and with SGLang's ``--dtype auto`` (which serves a
float32 checkpoint in float16), and the wall time of one weight update per transport. Also the
size of the server's virtualenv. Every number in the written file comes from this run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import torch  # noqa: E402

from gspo_megatron.config.schema import WeightSyncConfig  # noqa: E402
from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs  # noqa: E402
from gspo_megatron.rollout.sglang.engine import SGLangEngine  # noqa: E402
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams  # noqa: E402
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model  # noqa: E402
from gspo_megatron.weight_sync import build_transport  # noqa: E402
from tests.real_sglang import SGLANG_PYTHON, RealServer  # noqa: E402

PROMPTS = ["1+2=", "hello", "abc", "99+1="]


def group_rss_gb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in GB."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 1e9


def logprob_gap(engine: SGLangEngine, model, tok, temperature: float) -> tuple:
    """Mean and max |engine - recomputed| log-prob per response token over 4 x 8 samples."""
    samples = engine.generate([GenerationRequest(f"p{i}", tok(t)["input_ids"], n=8)
                               for i, t in enumerate(PROMPTS)],
                              SamplingParams(temperature=temperature, max_new_tokens=24, seed=1))
    diffs = []
    with torch.no_grad():
        for s in samples:
            ref = teacher_forced_logprobs(model, s.prompt_token_ids, s.response_token_ids, temperature)
            diffs.append((torch.tensor(s.response_logprobs) - ref).abs())
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max()), int(d.numel())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "docs" / "real_sglang.md"))
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="measure_sglang_"))
    model, tok = build_tiny_policy(seed=0)
    model_dir = save_tiny_model(model, tok, work / "model")
    venv = Path(SGLANG_PYTHON).parents[1]
    venv_gb = int(subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True,
                                 check=True).stdout.split()[0]) / 1e9

    starts, rss = [], []
    for i in range(args.launches):
        server = RealServer(str(model_dir), work / f"launch{i}.log")
        t0 = time.perf_counter()
        server.start()
        starts.append(time.perf_counter() - t0)
        rss.append(group_rss_gb(server.process.pid))
        server.stop()

    rows = []
    for label, extra in (("checkpoint dtype (float32, our launcher's default)", []),
                         ("`--dtype auto` (SGLang serves float32 as float16)", ["--dtype", "auto"])):
        server = RealServer(str(model_dir), work / "gap.log", extra_args=extra).start()
        try:
            engine = SGLangEngine([server.address], request_timeout_s=120)
            for temperature in (1.0, 0.7):
                mean, worst, count = logprob_gap(engine, model, tok, temperature)
                rows.append(f"| {label} | {temperature:g} | {count} | {mean:.2e} | {worst:.2e} |")
            if not extra:
                sync_rows = []
                for transport in ("disk", "tensor", "nccl"):
                    build_transport(WeightSyncConfig(transport=transport, bucket_bytes=1 << 20,
                                                     disk_dir=str(work / "sync")),
                                    engine, "sglang", mode="disaggregated",
                                    master_address="127.0.0.1", config_dir=str(model_dir))
                    times = []
                    for k in range(3):
                        state = model.state_dict()
                        t0 = time.perf_counter()
                        engine.update_weights(((n, t.clone()) for n, t in state.items()), f"{transport}-{k}")
                        times.append(time.perf_counter() - t0)
                    sync_rows.append(f"| `{transport}` | {statistics.median(times):.3f} | "
                                     f"{min(times):.3f} - {max(times):.3f} |")
            engine.shutdown()
        finally:
            server.stop()

    params = sum(t.numel() for t in model.state_dict().values())
    today = datetime.date.today().isoformat()
    text = f"""# The real SGLang 0.5.23 server on this CPU machine (measured)

Written by `python tools/measure_real_sglang.py --launches {args.launches}` on {today}
({os.cpu_count()} cores, `OMP_NUM_THREADS=1` for the server; the free-text tiny Qwen3-MoE of the
rollout tests: {params:,} parameters, 2 layers, 4 experts top-2, fp32). The server runs from
`make sglang-venv` with our CPU `sgl_kernel` (docs/rollout.md, "The real SGLang server on CPU").

| what | measured |
|---|---|
| server virtualenv (`{venv.name}`) | {venv_gb:.1f} GB on disk |
| launch to first healthy `/health_generate` | median {statistics.median(starts):.1f} s over {len(starts)} launches ({min(starts):.1f} - {max(starts):.1f} s) |
| resident memory of the server's processes | median {statistics.median(rss):.2f} GB ({min(rss):.2f} - {max(rss):.2f} GB) |

Engine log-probs against a teacher-forced forward of the same weights (transformers, fp32), per
response token of 4 prompts x 8 samples x up to 24 tokens:

| server dtype | temperature | tokens | mean abs gap | max abs gap |
|---|---|---|---|---|
""" + "\n".join(rows) + """

One weight update of all {params:,} parameters (1 MiB buckets), whole protocol (pause, session,
buckets, end, flush, continue), 3 updates each:

| transport | median s | range s |
|---|---|---|
""".replace("{params:,}", f"{params:,}") + "\n".join(sync_rows) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
