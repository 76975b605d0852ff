"""``gspo-plan``: prints both production configs' plans on 4 and 8 nodes in under 5 s of CPU
(fresh interpreter, torch never imported), with the RL steps against the rollout staleness, JSON
output, and exit code 2 with the key named (a ``--doc`` file without the markers too)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from tests.test_config import REPO

SCRIPT = ("import sys, runpy; sys.argv = ['gspo-plan'] + sys.argv[1:]; "
          "from gspo_megatron.cli.plan import main; rc = main(); "
          "assert 'torch' not in sys.modules, 'gspo-plan imported torch'; sys.exit(rc)")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("config", ["qwen3_30b_a3b_gspo.yaml", "qwen3_235b_a22b_gspo.yaml"])
def test_plans_both_production_configs_on_4_and_8_nodes_quickly(config):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = _run(f"configs/{config}", "--nodes", "4", "8", "--search-optimizer")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr
    assert cpu_s < 5.0, f"gspo-plan took {cpu_s:.1f} s of CPU"
    text = out.stdout
    for needle in ("the config's own layout", "weights", "grad buffer (fp32)", "optimizer state",
                   "RL steps against rollout.max_staleness (k)", "RL steps/h at k=0/1/2/4",
                   "activations (full recompute", "KV cache per GPU", "FP8 weight copies",
                   "sequences of 9216 tokens per server", "best layouts on 4 nodes",
                   "best layouts on 8 nodes", "parallel.tp="):
        assert needle in text, needle
    assert "fits, margin" in text.split("rollout")[0]
    # 30B: one stage, which also runs the log-prob pass; 235B: a middle stage of PP4 (3 in flight)
    assert ("logits / log-prob pass" in text) == config.startswith("qwen3_30b")
    assert ("3 in flight" in text) == config.startswith("qwen3_235b")


def test_json_output_and_bad_input():
    out = _run("configs/qwen3_30b_a3b_gspo.yaml", "--nodes", "4", "--json", "--top", "2")
    doc = json.loads(out.stdout)
    assert doc["config"]["fits"] and len(doc["ranked"]["4"]) == 2
    assert doc["config"]["learner"]["peak_gb"] < 76
    rates = doc["config"]["steps_per_s_by_staleness"]
    assert list(rates) == ["0", "1", "2", "4"] and rates["0"] < rates["1"] <= rates["2"]
    bad = _run("configs/qwen3_30b_a3b_gspo.yaml", "parallel.tpp=2")
    assert bad.returncode == 2 and "parallel.tpp" in bad.stderr
    bad = _run("configs/qwen3_30b_a3b_gspo.yaml", "--gpu-memory", "lots")
    assert bad.returncode == 2 and "--gpu-memory" in bad.stderr
    bad = _run("configs/qwen3_30b_a3b_gspo.yaml", "--nodes", "1")
    assert bad.returncode == 2 and "--nodes" in bad.stderr
    bad = _run("configs/qwen3_30b_a3b_gspo.yaml", "--doc", "README.md")  # no markers: untouched
    assert bad.returncode == 2 and "--doc README.md: no section marked" in bad.stderr
    bad = _run("configs/qwen3_30b_a3b_gspo.yaml", "plan.truncated_frac=0.9")
    assert bad.returncode == 2 and "plan.truncated_frac" in bad.stderr


def test_host_mode_predicts_each_process_and_what_the_freeze_saves():
    cfg = "configs/qwen3_30b_a3b_1layer_cpu.yaml"
    frozen_run = _run(cfg, "--host", "--host-memory", "24GiB", "--json")
    assert frozen_run.returncode == 0, frozen_run.stderr
    frozen = json.loads(frozen_run.stdout)["host"]
    full = json.loads(_run(cfg, "optimizer.freeze=[]", "--host", "--host-memory", "24GiB",
                           "--json").stdout)["host"]
    assert frozen["learner"]["moment"] == full["learner"]["moment"] == "training"
    embedding = 151936 * 2048  # the vocabulary is a multiple of 128: no padding at TP1
    # 16 bytes per frozen parameter (fp32 grad 4, main weight 4, Adam moments 8), and the
    # output layer's CPU weight-gradient copy (bf16 2 + fp32 4) that a frozen layer never makes
    saved = full["learner"]["peak_bytes"] - frozen["learner"]["peak_bytes"]
    assert saved == pytest.approx(2 * embedding * 16 + embedding * 6, rel=1e-9)
    assert frozen["fits"] and not full["fits"]
    saving = json.loads(_run(cfg, "checkpoint.save_final=true", "--host", "--host-memory", "24GiB",
                             "--json").stdout)["host"]["learner"]
    # A save holds one tensor beyond the state (issue 49: the optimizer's own shard is written,
    # no gather of 12 bytes per trained parameter): it does not raise the training peak.
    assert saving["moment"] == "training"
    assert saving["peak_bytes"] == frozen["learner"]["peak_bytes"]
    server = {t["name"]: t["bytes"] for t in frozen["server"]["terms"]}
    assert server["weights (bf16)"] == pytest.approx(2 * 1.2457e9, rel=1e-3)
    assert server["KV pool"] == 4096 * 1 * 4 * 2 * 128 * 2  # max_total_tokens x layers x kv x K,V
    text = _run(cfg, "--host", "--host-memory", "24GiB").stdout
    assert "learner rank x 1, peak at training" in text and "SGLang CPU server x 1" in text
    assert "of 24.00 GiB: fits" in text
    bad = _run("configs/qwen3_30b_a3b_gspo.yaml", "--host")
    assert bad.returncode == 2 and "--host: plans a CPU run" in bad.stderr
