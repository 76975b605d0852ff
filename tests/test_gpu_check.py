"""The GPU verification kit (gspo_megatron/gpu_check/, tools/gpu_check.py): its CPU dry run end to
end, and the parts a GPU run relies on that can be checked here (configs, FLOP counts, the SGLang
tensor-payload stand-in, statuses and exit codes)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.gpu_check import ipc_engine
from gspo_megatron.gpu_check.report import CheckResult, NotRun, Report
from gspo_megatron.gpu_check.runner import CHECKS, main, run_check
from gspo_megatron.gpu_check.sizes import QWEN3_30B_A3B_HF_CONFIG, TINY_HF_CONFIG, gpu_sizes
from gspo_megatron.gpu_check.throughput import (attention_flops, forward_flops,
                                                matmul_flops_per_token, train_step_flops)
from gspo_megatron.model.hf_config import model_config_from_hf
from tests.ahead import Command

ROOT = Path(__file__).resolve().parents[1]


AHEAD = {
    "test_cpu_dry_run_passes_every_check_it_can": Command(
        ["{python}", "{repo}/tools/gpu_check.py", "--cpu-dry-run", "--out", "{dir}/out"],
        env={"OMP_NUM_THREADS": "2"}, timeout_s=600),
    "test_a_subset_of_checks_builds_no_model": Command(
        ["{python}", "{repo}/tools/gpu_check.py", "--cpu-dry-run", "--checks",
         "logprob_kernel_memory", "--out", "{dir}/out"], timeout_s=300),
}
"""The kit's CPU dry runs (~26 CPU-seconds), in the background while the tests before them run
(``tests/ahead.py``); the kernel check's peak is the kernel's own (``VmHWM``), not sampled."""


@pytest.mark.slow
def test_cpu_dry_run_passes_every_check_it_can(ahead):
    out, res = ahead.dir / "out", ahead
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-dry-run" and report["status"] == "pass"
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == set(CHECKS) | {"runtime", "setup"}
    assert {n: c["status"] for n, c in checks.items() if c["status"] != "pass"} == \
        {"te_fp8": "not_run"}
    assert "GPU" in checks["te_fp8"]["message"]
    sync = checks["weight_sync_cuda_ipc"]["numbers"]
    assert sync["differ_before"] == sync["learner_tensors"] > 0 and sync["differ_after"] == 0
    assert sync["buckets"] > 1 and sync["missing_in_engine"] == sync["engine_only"] == 0
    assert checks["logprob_kernel_memory"]["numbers"]["chunked_over_naive"] <= 0.5
    assert checks["logprobs_vs_hf"]["numbers"]["learner_vs_hf_fp32_mean"] < 1e-4
    train = checks["learner_train"]["numbers"]
    assert train["backend"] == "gloo" and train["train_tokens_per_s"] > 0
    assert checks["cpu_compat_not_applied"]["numbers"]["applied"] is True
    assert "PASS" in (out / "gpu_check.txt").read_text()


@pytest.mark.slow
def test_a_subset_of_checks_builds_no_model(ahead):
    out, res = ahead.dir / "out", ahead
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["runtime", "logprob_kernel_memory"]


def test_report_status_summary_and_files(tmp_path):
    report = Report(mode="gpu", out_dir=tmp_path, environment={"device": "cuda:0"})
    report.add(CheckResult("a", "pass", "fine", {"x": 1.23456}))
    report.add(CheckResult("b", "not_run", "no TE"))
    assert report.status() == "pass"
    report.add(CheckResult("c", "fail", "too slow"))
    assert report.status() == "fail"
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["status"] for c in saved["checks"]] == ["pass", "not_run", "fail"]
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "[NOT_RUN] b" in text and "x = 1.235" in text and "FAIL" in text.splitlines()[0]
    with pytest.raises(ValueError, match="status"):
        CheckResult("d", "skipped")


def test_run_check_turns_exceptions_into_statuses():
    report = Report(mode="cpu-dry-run")

    def missing():
        raise NotRun("no TE here")

    def broken():
        raise KeyError("boom")

    run_check(report, "learner_train", lambda: (True, "ok", {"n": 1}))
    run_check(report, "te_fp8", missing)
    run_check(report, "logprobs_vs_hf", broken)
    run_check(report, "weight_sync_cuda_ipc", broken, selected=("learner_train",))
    got = {c.name: c for c in report.checks}
    assert [c.status for c in report.checks] == ["pass", "not_run", "error"]
    assert got["te_fp8"].message == "no TE here"
    assert "KeyError" in got["logprobs_vs_hf"].message
    assert "boom" in got["logprobs_vs_hf"].numbers["traceback"]


def test_flops_of_qwen3_30b_a3b_match_its_active_parameters():
    m = model_config_from_hf(QWEN3_30B_A3B_HF_CONFIG)
    per_layer = (2048 * (4096 + 2 * 512) + 4096 * 2048) + 2048 * 128 + 8 * 3 * 2048 * 768
    assert matmul_flops_per_token(m) == 2 * (48 * per_layer + 2048 * 151936)
    # "A3B": ~3.3e9 activated parameters, counting the embedding table (a lookup, no matmul).
    activated = matmul_flops_per_token(m) / 2 + 2048 * 151936
    assert 3.2e9 < activated < 3.45e9
    tiny = model_config_from_hf(dict(TINY_HF_CONFIG, num_hidden_layers=1))
    # causal attention over 3 tokens: 1 + 2 + 3 = 6 query-key pairs, QK^T and AV, 2 FLOPs each
    assert attention_flops(tiny, 3) == 6 * 2 * 2 * tiny.num_attention_heads * tiny.head_dim
    assert train_step_flops(tiny, [3, 5]) == 3 * forward_flops(tiny, [3, 5])


def test_gpu_sizes_keep_qwen3_30b_a3b_layer_shapes():
    sizes = gpu_sizes(3)
    hf = sizes.hf_config
    assert hf["num_hidden_layers"] == 3 and sizes.params_dtype == "bf16"
    assert {k: hf[k] for k in ("hidden_size", "num_experts", "num_experts_per_tok",
                               "moe_intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "vocab_size")} == dict(
        hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936)
    assert sizes.kernel_vocab == 151936
    with pytest.raises(ValueError, match="num-layers"):
        gpu_sizes(8)


def test_kit_learner_configs_validate_and_map_to_megatron(tmp_path):
    """The GPU run's learner configs (local spec; TE + FP8) pass validation and Megatron mapping."""
    from gspo_megatron.config.schema import FP8Config
    from gspo_megatron.gpu_check.inputs import learner_config
    from gspo_megatron.model.provider import transformer_config_kwargs

    sizes = gpu_sizes(2)
    (tmp_path / "config.json").write_text(json.dumps(sizes.hf_config))
    local = learner_config(tmp_path, sizes, tmp_path / "run", impl="local")
    assert (local.model.num_experts, local.model.moe_router_topk, local.model.num_layers) == (128, 8, 2)
    kw = transformer_config_kwargs(local.model, local.parallel, on_gpu=True)
    assert kw["params_dtype"] == torch.bfloat16 and kw["moe_grouped_gemm"] is False
    fp8 = FP8Config(enabled=True, recipe="tensorwise", num_layers_at_start_in_bf16=0,
                    num_layers_at_end_in_bf16=0)
    te = learner_config(tmp_path, sizes, tmp_path / "run", impl="transformer_engine", fp8=fp8)
    kw = transformer_config_kwargs(te.model, te.parallel, on_gpu=True)
    assert kw["fp8"] == "hybrid" and kw["fp8_recipe"] == "tensorwise"
    assert kw["moe_grouped_gemm"] and kw["moe_token_dispatcher_type"] == "alltoall"


def test_serializer_round_trip_and_allowlist():
    param = torch.nn.Parameter(torch.randn(4, 6))
    items = [("a", torch.randn(3, dtype=torch.bfloat16)), ("b", param),
             ("c", param.detach()[:, 1:4]), ("d", torch.arange(5))]
    out = ipc_engine.deserialize(ipc_engine.serialize(items))
    assert [n for n, _ in out] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(items, out):
        assert got.dtype == want.dtype and torch.equal(got, want.detach())

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="blocked global"):
        ipc_engine.deserialize(ipc_engine.serialize([("x", Evil())]))
    with pytest.raises(ValueError):  # SGLang decodes base64 with validate=True
        ipc_engine.deserialize("not base64!")


def test_update_weights_from_tensor_loads_by_name_and_refuses_bad_bodies():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

    hf = {k: v for k, v in TINY_HF_CONFIG.items() if k != "model_type"}
    torch.manual_seed(0)
    engine = EmbeddedEngine(Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)))
    new = {n: torch.randn_like(t) for n, t in engine.model.state_dict().items()}
    blob = ipc_engine.serialize(list(new.items()))
    bad = [({"serialized_named_tensors": [blob], "extra": 1}, "unknown fields"),
           ({"serialized_named_tensors": [blob, blob]}, "one entry per TP rank"),
           ({"serialized_named_tensors": [blob], "load_format": "flattened_bucket"}, "load_format")]
    for body, why in bad:
        status, answer = ipc_engine.update_weights_from_tensor(engine, body)
        assert status == 400 and not answer["success"] and why in answer["message"]
    status, answer = ipc_engine.update_weights_from_tensor(
        engine, {"serialized_named_tensors": [blob], "load_format": None, "flush_cache": True,
                 "weight_version": "v7"})
    assert status == 200 and answer["success"] and engine.weight_version == "v7"
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, new[name]), name


def test_te_fp8_check_says_why_it_does_not_run():
    from gspo_megatron.gpu_check.fp8_check import transformer_engine_version

    try:
        version = transformer_engine_version()
    except NotRun as exc:
        assert ("transformer_engine" if torch.cuda.is_available() else "no GPU") in str(exc)
    else:
        assert torch.cuda.is_available() and version


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--checks", "learner_train,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--out", str(tmp_path)]) == 2
        assert "--cpu-dry-run" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


def test_device_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    res = subprocess.run([shellcheck, str(ROOT / "tools" / "gpu_check_device.sh")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
