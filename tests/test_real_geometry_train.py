"""Two GSPO steps of ``gspo-train configs/qwen3_30b_a3b_1layer_cpu.yaml`` against the real SGLang
0.5.23 CPU server that the trainer starts, on a Qwen3-MoE with the real geometry's structural
features (``tests/test_real_geometry_agreement.py``'s: head_dim 128 != 256 / 4 heads, 64 experts
top-8, the real vocabulary, tokenizer and chat template) at widths that fit CI.

The run is ``benchmarks/bench_real_width_train.py``'s training phase (the 30B widths run there):
disaggregated, weights broadcast after every update and verified on the server, the embedding and
output layer frozen (``optimizer.freeze``). Checked: every step's rollout came from the weights
the learner sent (probe and rollout log-probs agree with the learner's to bf16 precision), the
step time split is logged, the frozen tensors leave the run exactly as they came in while the
trained ones moved, and the peak owned memory of the learner's and the server's processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks.bench_real_width_train import SPLIT_KEYS, train_phase
from gspo_megatron.real_geometry.checkpoint_writer import write_random_checkpoint
from gspo_megatron.real_geometry.geometries import GENERATION_CONFIG
from gspo_megatron.real_geometry.task import write_question_datasets
from tests.qwen3_assets import qwen3_tokenizer_dir  # noqa: F401
from tests.real_sglang import SGLANG_PYTHON
from tests.test_real_geometry_agreement import STRUCTURAL

pytestmark = pytest.mark.slow

NUM_STEPS = 2
# Measured here (docs/real_geometry.md): learner ~1.3 GiB, server ~3.3 GiB at their peaks.
PEAK_GIB = {"learner": 2.0, "server": 4.5}
BF16_LOGP_TOLERANCE = 0.05  # the config's rollout.weight_sync.verify_tolerance
SMALLER = ("batch.num_prompts_per_step=2", "rollout.max_new_tokens=8",
           "algo.diagnostics.expert_volatility_num_seqs=4")
"""Half the config's step (2 prompts x 4 samples, 8 new tokens): every phase still runs."""


def _hf_tensors(model_dir, names):
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())["weight_map"] if index_path.exists() \
        else {name: "model.safetensors" for name in names}
    out = {}
    for name in names:
        with safe_open(str(model_dir / index[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_two_gspo_steps_against_the_real_server(tmp_path, qwen3_tokenizer_dir):  # noqa: F811
    assets = tmp_path / "assets"
    model_dir = write_random_checkpoint(assets / "model", STRUCTURAL, GENERATION_CONFIG,
                                        qwen3_tokenizer_dir, seed=0, max_shard_bytes=10**9)
    write_question_datasets(assets / "data")
    run = train_phase(tmp_path / "work", assets, NUM_STEPS, SGLANG_PYTHON, timeout_s=900,
                      extra=SMALLER)

    rows = run["rows"]
    assert [r["step"] for r in rows] == list(range(NUM_STEPS + 1))
    for row in rows[1:]:
        assert 0.0 < row["reward/mean"] <= 1.0
        assert row["weight_sync/probe_abs_logp"] < BF16_LOGP_TOLERANCE, row["step"]
        assert row["rollout/learner_vs_engine_abs_logp"] < BF16_LOGP_TOLERANCE, row["step"]
        assert row["weight_sync/gb"] > 0 and row["train/grad_norm"] > 0
        for key in SPLIT_KEYS.values():
            assert row[key] > 0, key
        assert 0.0 <= row["routing/activated_expert_changed_frac"] <= 1.0

    run_dir = tmp_path / "work" / "run"
    assert not (run_dir / "checkpoints").exists()  # checkpoint.save_final=false: export only
    frozen = ["model.embed_tokens.weight", "lm_head.weight"]
    trained = ["model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight"]
    before = _hf_tensors(model_dir, frozen + trained)
    after = _hf_tensors(run_dir / "hf_export", frozen + trained)
    for name in frozen:
        assert torch.equal(before[name], after[name]), name
    for name in trained:
        assert not torch.equal(before[name], after[name]), name

    peak = {"learner": max(p["main"] for p in run["peaks"].values()) / 2**30,
            "server": max(p["branch"] for p in run["peaks"].values()) / 2**30}
    print("peak owned GiB", peak, "step s", [round(r["time/step_s"], 1) for r in rows[1:]])
    assert peak["learner"] < PEAK_GIB["learner"] and peak["server"] < PEAK_GIB["server"], peak
    assert peak["server"] > 1.0, peak  # the server's processes were found and counted apart
