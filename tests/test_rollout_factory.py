"""Tests of engine construction from RolloutConfig (rollout/factory.py)."""

import pytest

from gspo_megatron.config.schema import RolloutConfig, SGLangConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.factory import build_engine
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model


def test_embedded_from_model_and_from_directory(tmp_path):
    model, tok = build_tiny_policy()
    eng = build_engine(RolloutConfig(), model=model, tokenizer=tok)
    assert isinstance(eng, EmbeddedEngine) and eng.model is model
    save_tiny_model(*build_tiny_policy(seed=1), str(tmp_path))
    assert isinstance(build_engine(RolloutConfig(), model_path=str(tmp_path)), EmbeddedEngine)


def test_embedded_engine_in_bf16_recording_routing(tmp_path):
    """``rollout.embedded_dtype=bf16`` (a bf16 engine beside the fp32 learner) and R3's routing
    shape reach the engine built from a directory."""
    import torch

    from gspo_megatron.rollout.routed_experts import RoutingShape
    from gspo_megatron.rollout.types import GenerationRequest, SamplingParams

    model, tok = build_tiny_policy(seed=1)
    save_tiny_model(model, tok, str(tmp_path))
    eng = build_engine(RolloutConfig(embedded_dtype="bf16"), model_path=str(tmp_path),
                       routing_shape=RoutingShape(2, 2, 4))
    assert eng.model.dtype == torch.bfloat16 and eng.record_routing
    sample = eng.generate([GenerationRequest("p", tok("1+1=")["input_ids"])],
                          SamplingParams(max_new_tokens=3, seed=1))[0]
    assert sample.routed_experts.shape[0] == len(sample.prompt_token_ids) + len(
        sample.response_token_ids) - 1
    assert all(lp <= 0.0 for lp in sample.response_logprobs)


def test_clear_errors():
    with pytest.raises(ValueError, match="hf_path"):
        build_engine(RolloutConfig(engine="embedded"))
    with pytest.raises(ValueError, match="server_addresses"):
        build_engine(RolloutConfig(engine="reference"))
    with pytest.raises(ValueError, match="model.hf_path"):
        build_engine(RolloutConfig(engine="sglang"))
    with pytest.raises(ValueError, match="not one of"):
        build_engine(RolloutConfig(engine="vllm"))


def test_reference_engine_attach_times_out_on_a_dead_address():
    cfg = RolloutConfig(engine="reference", sglang=SGLangConfig(
        server_addresses=["127.0.0.1:9"], health_timeout_s=0.5))
    with pytest.raises(TimeoutError, match="127.0.0.1:9"):
        build_engine(cfg)


def test_rollout_package_never_imports_megatron():
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, gspo_megatron.rollout as r\n"
            "for m in pkgutil.iter_modules(r.__path__): importlib.import_module('gspo_megatron.rollout.' + m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'sglang', 'gspo_megatron') "
            "and not m.startswith(('gspo_megatron.rollout', 'gspo_megatron.config', "
            "'gspo_megatron.faults')) and m != 'gspo_megatron')\n"  # floor 0: standard library only
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": __file__.rsplit("/tests/", 1)[0]})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_reference_fleet_is_launched_with_the_memory_saver_in_colocated_mode(monkeypatch):
    seen = {}

    def from_config(cfg, model_path, log_dir, enable_memory_saver, launch, key_file=None,
                    routing_shape=None, keep_partial_rollouts=False):
        seen.update(saver=enable_memory_saver, launch=launch.__name__, partial=keep_partial_rollouts)
        return "engine"

    monkeypatch.setattr(SGLangEngine, "from_config", staticmethod(from_config))
    assert build_engine(RolloutConfig(engine="reference"), model_path="/m") == "engine"
    assert seen == {"saver": True, "launch": "launch_reference_fleet", "partial": False}
    build_engine(RolloutConfig(engine="sglang", mode="disaggregated"), model_path="/m",
                 keep_partial_rollouts=True)
    assert seen == {"saver": False, "launch": "launch_sglang_fleet", "partial": True}


def test_partial_rollouts_are_refused_for_the_embedded_engine():
    with pytest.raises(ValueError, match="partial rollouts need rollout.engine=sglang or reference"):
        build_engine(RolloutConfig(engine="embedded"), model_path="/m", keep_partial_rollouts=True)
