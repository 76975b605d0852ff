"""Tiny assets: the written model, tokenizer and data load with transformers and generate; the
repeat task's data beside the same model (``--task repeat``); the free-text tiny policy of the
rollout tests."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from gspo_megatron.tiny_task.task import AdditionTaskConfig

TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_tiny_assets.py"


def make_assets_main(argv):
    spec = importlib.util.spec_from_file_location("make_tiny_assets", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_make_tiny_assets_tool_writes_loadable_model_tokenizer_and_data(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "assets"
    assert make_assets_main([str(out), "--num-train", "40", "--num-eval", "8"]) == 0
    model_dir = out / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 64)
    assert cfg.vocab_size == len(tok) and cfg.tie_word_embeddings is False
    assert cfg.max_position_embeddings == 128 and cfg.rope_theta == 10000.0
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    gen_cfg = GenerationConfig.from_pretrained(model_dir)
    assert (gen_cfg.eos_token_id, gen_cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)

    enc = tok(["1+2=", "10+20="], return_tensors="pt", padding=True)
    out_ids = model.generate(**enc, max_new_tokens=4, do_sample=True, num_return_sequences=2)
    assert out_ids.shape[0] == 4 and out_ids.shape[1] <= enc["input_ids"].shape[1] + 4
    assert int(out_ids.max()) < len(tok)

    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and len((out / "data" / "eval.jsonl").read_text().splitlines()) == 8


def load_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_assets", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeat_task_option_writes_the_same_model_beside_the_repeat_data(tmp_path):
    torch.set_num_threads(1)
    add, rep = tmp_path / "add", tmp_path / "rep"
    assert make_assets_main([str(add), "--num-train", "40", "--num-eval", "8"]) == 0
    assert make_assets_main([str(rep), "--task", "repeat", "--num-train", "64", "--num-eval", "32",
                             "--max-count", "30"]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (add / "model" / name).read_bytes() == (rep / "model" / name).read_bytes(), name
    rows = [json.loads(line) for line in (rep / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and len((rep / "data" / "eval.jsonl").read_text().splitlines()) == 32
    assert all(r["answer"] == str(r["metadata"]["digit"]) * r["metadata"]["count"] for r in rows)
    assert max(r["metadata"]["count"] for r in rows) <= 30 and rows[0]["prompt"].endswith("=")


def test_tool_defaults_are_each_tasks_own_and_misplaced_options_fail(tmp_path):
    from gspo_megatron.tiny_task.repeat_task import RepeatTaskConfig

    tool = load_tool()
    parse = lambda *argv: tool.task_config(argparse.Namespace(**{  # noqa: E731
        "task": "addition", "num_train": None, "num_eval": None, "num_digits": None,
        "max_count": None, **dict(argv)}))
    assert parse() == AdditionTaskConfig()  # the default output is today's, byte for byte
    assert parse(("task", "repeat")) == RepeatTaskConfig()
    assert parse(("task", "repeat"), ("num_train", 320)) == RepeatTaskConfig(num_train=320)
    for argv in (["--max-count", "9"], ["--task", "repeat", "--num-digits", "3"],
                 ["--task", "repeat", "--num-train", "100"]):
        assert make_assets_main([str(tmp_path / "x"), *argv]) == 1, argv


def test_same_seed_gives_identical_weights(tmp_path):
    from gspo_megatron.tiny_task.model import create_tiny_model
    from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    a, b, c = (create_tiny_model(tok, seed=s) for s in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert AdditionTaskConfig().num_digits == 2


def test_free_text_policy_has_the_asked_sizes_and_reads_letters():
    from gspo_megatron.tiny_task.model import build_tiny_policy

    model, tok = build_tiny_policy(seed=3, hidden_size=32, num_layers=3, num_experts=2,
                                   moe_ffn_hidden_size=16)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.moe_intermediate_size,
            cfg.head_dim, cfg.max_position_embeddings) == (32, 3, 2, 16, 8, 512)
    assert tok.decode(tok.encode("what is 1+1?")) == "what is 1+1?"
    again, _ = build_tiny_policy(seed=3, hidden_size=32, num_layers=3, num_experts=2,
                                 moe_ffn_hidden_size=16)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)
