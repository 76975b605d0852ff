"""The bad inputs: each is a command line a user could type, run against the tiny config.

A case names the tool, its arguments (built from the workspace and a fresh directory, after an
optional ``setup`` that writes the bad file), the exit code it must get and a piece of text the
error must contain (the key, file or path). :func:`run_bad_input` runs it in this process and
judges it: ``clear error`` needs that exit code (2), that text, no traceback and nothing written
into the case's directory; otherwise the verdict says what went wrong (``raw traceback``,
``silent acceptance``, ``unclear error``, ``wrote ...``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from tools.reliability.harness import TINY_CONFIG, Result, Workspace, call_cli, snapshot

Argv = Callable[[Workspace, Path], List[str]]


@dataclass
class BadInput:
    name: str
    tool: str
    """``train``, ``export`` or ``convert``."""
    argv: Argv
    expect: str
    """Text the error line must contain (usually the key or the file)."""
    setup: Optional[Callable[[Workspace, Path], None]] = None
    code: int = 2


def _train(*overrides: str, config: Optional[str] = None) -> Argv:
    """``gspo-train tiny_cpu.yaml <small run> overrides``; ``{d}`` is the case's directory."""
    def argv(ws: Workspace, d: Path) -> List[str]:
        cfg = config.format(d=d) if config else str(TINY_CONFIG)
        return [cfg, *ws.overrides(d / "run"), *(o.format(d=d, ws=ws) for o in overrides)]
    return argv


def _tool(*args: str) -> Argv:
    return lambda ws, d: [a.format(d=d, ws=ws) for a in args]


def _write(name: str, data: bytes | str) -> Callable[[Workspace, Path], None]:
    def setup(ws: Workspace, d: Path) -> None:
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return setup


def _copy_model(edit: Callable[[Path], None]) -> Callable[[Workspace, Path], None]:
    def setup(ws: Workspace, d: Path) -> None:
        shutil.copytree(ws.model_dir, d / "model")
        edit(d / "model")
    return setup


def _truncate_weights(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        cfg = json.loads((model / "config.json").read_text())
        cfg.update(changes)
        (model / "config.json").write_text(json.dumps(cfg))
    return edit


def _index_missing_shard(model: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    weight_map = {n: ("model-00001-of-00002.safetensors" if i % 2 else "model.safetensors")
                  for i, n in enumerate(names)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _checkpoint(damage: Optional[str] = None) -> Callable[[Workspace, Path], None]:
    """A converted checkpoint at ``d/ckpt`` (optionally with one file deleted)."""
    def setup(ws: Workspace, d: Path) -> None:
        shutil.copytree(ws.converted_checkpoint(), d / "ckpt")
        if damage:
            (d / "ckpt" / damage).unlink()
    return setup


def _train_rows(rows: List[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


GOOD_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(50)]
M = "{d}/model"

CASES: List[BadInput] = [
    # ---- the configuration file and overrides ----
    BadInput("config file missing", "train", _train(config="{d}/nope.yaml"),
             "nope.yaml: config file not found"),
    BadInput("config not YAML", "train", _train(config="{d}/bad.yaml"), "bad.yaml: not valid YAML",
             setup=_write("bad.yaml", "model: [unclosed\n")),
    BadInput("config top level a list", "train", _train(config="{d}/list.yaml"),
             "list.yaml: top level must be a mapping",
             setup=_write("list.yaml", "- 1\n- 2\n")),
    BadInput("defaults cycle", "train", _train(config="{d}/a.yaml"), "'defaults' form a cycle",
             setup=lambda ws, d: ((d / "a.yaml").write_text("defaults: [b.yaml]\n"),
                                  (d / "b.yaml").write_text("defaults: [a.yaml]\n")) and None),
    BadInput("unknown key in the config file", "train", _train(config="{d}/typo.yaml"),
             "unknown key 'algo.cilp_eps_low'",
             setup=_write("typo.yaml", f"defaults: [{TINY_CONFIG}]\nalgo:\n  cilp_eps_low: 0.1\n")),
    BadInput("misspelt override key", "train", _train("algo.cilp_eps_low=0.1"),
             "unknown key 'algo.cilp_eps_low'"),
    BadInput("override of the wrong type", "train", _train("trainer.num_steps=abc"),
             "bad value for 'trainer.num_steps': Value 'abc' of type 'str' could not be converted to Integer"),
    BadInput("override without '='", "train", _train("trainer.num_steps"), "expected key=value"),
    BadInput("unknown loss", "train", _train("algo.loss=ppo"), "algo.loss: 'ppo' is not one of"),
    BadInput("unknown rollout engine", "train", _train("rollout.engine=vllm"),
             "rollout.engine: 'vllm' is not one of"),
    BadInput("unknown resume mode", "train", _train("checkpoint.resume=maybe"),
             "checkpoint.resume: 'maybe' is not one of auto, always, never"),
    BadInput("unknown wandb mode", "train", _train("logging.wandb.mode=sometimes"),
             "logging.wandb.mode: 'sometimes' is not one of offline, online, disabled"),
    BadInput("negative RL steps", "train", _train("trainer.num_steps=-1"),
             "trainer.num_steps: -1 must be >= 0"),
    BadInput("negative SFT steps", "train", _train("trainer.num_sft_steps=-5"),
             "trainer.num_sft_steps: -5 must be >= 0"),
    BadInput("negative checkpoint interval", "train", _train("checkpoint.save_every_steps=-2"),
             "checkpoint.save_every_steps: -2 must be >= 0"),
    BadInput("keep no checkpoint", "train", _train("checkpoint.keep_last=0"),
             "checkpoint.keep_last: 0 must be >= 1"),
    BadInput("negative server restart budget", "train", _train("rollout.sglang.restarts_per_hour=-1"),
             "rollout.sglang.restarts_per_hour: -1 must be >= 0"),
    BadInput("zero hang deadline for the servers", "train", _train("rollout.sglang.hang_timeout_s=0"),
             "rollout.sglang.hang_timeout_s: 0.0 must be > 0.0"),
    BadInput("unknown routing of samples to servers", "train", _train("rollout.sglang.routing=round_robin"),
             "rollout.sglang.routing: 'round_robin' is not one of least_loaded, prompt_affinity"),
    BadInput("zero new tokens", "train", _train("rollout.max_new_tokens=0"),
             "rollout.max_new_tokens: 0 must be >= 1"),
    BadInput("one sample per prompt with group-normalised advantages", "train",
             _train("rollout.n_samples_per_prompt=1"),
             "rollout.n_samples_per_prompt: group-normalised advantages need >= 2 samples per prompt"),
    BadInput("zero SFT batch", "train", _train("trainer.sft_batch_size=0"),
             "trainer.sft_batch_size: 0 must be >= 1"),
    BadInput("zero prompt tokens", "train", _train("data.max_prompt_tokens=0"),
             "data.max_prompt_tokens: 0 must be >= 1"),
    BadInput("mini-batches do not divide the batch", "train", _train("batch.num_mini_batches=3"),
             "batch.num_mini_batches: 3 must divide"),
    BadInput("micro-batch cannot hold a sequence", "train",
             _train("batch.max_tokens_per_micro_batch=4"),
             "batch.max_tokens_per_micro_batch: 4 cannot hold"),
    BadInput("sequence longer than the model's context", "train",
             _train("rollout.max_new_tokens=200"),
             "exceeds model.max_position_embeddings"),
    BadInput("temperature 0", "train", _train("rollout.temperature=0"),
             "rollout.temperature: must be > 0"),
    BadInput("top_p above 1", "train", _train("rollout.top_p=1.5"),
             "rollout.top_p: must be in (0, 1]"),
    BadInput("clip range above 1", "train", _train("algo.clip_eps_low=1.5"),
             "algo.clip_eps_low: 1.5 must be in [0, 1)"),
    BadInput("negative KL coefficient", "train", _train("algo.kl_coef=-1"),
             "algo.kl_coef: must be >= 0"),
    BadInput("TIS cap below 1", "train", _train("algo.tis.mode=truncate", "algo.tis.cap=0.5"),
             "algo.tis.cap: 0.5 must be >= 1"),
    BadInput("mask band of width 0", "train", _train("algo.tis.mode=mask", "algo.tis.cap=1"),
             "algo.tis.cap: 1.0 must be > 1 with algo.tis.mode=mask"),
    BadInput("unknown correction mode", "train", _train("algo.tis.mode=clip"),
             "algo.tis.mode: 'clip' is not one of auto, off, truncate, mask"),
    BadInput("unknown routing replay mode", "train", _train("algo.routing_replay=engine"),
             "algo.routing_replay: 'engine' is not one of off, learner, rollout (learner: R2, the "
             "learner's old-policy routing; rollout: R3, the engine's routing)"),
    BadInput("engine dtype the embedded engine lacks", "train", _train("rollout.embedded_dtype=fp16"),
             "rollout.embedded_dtype: 'fp16' is not one of fp32, bf16"),
    BadInput("zero learning rate", "train", _train("optimizer.lr=0"),
             "optimizer.lr: must be > 0"),
    BadInput("min_lr above lr", "train", _train("optimizer.min_lr=1.0"),
             "optimizer.min_lr: 1.0 must be <= optimizer.lr"),
    BadInput("Adam beta2 = 1", "train", _train("optimizer.adam_beta2=1.0"),
             "optimizer.adam_beta2: 1.0 must be < 1"),
    BadInput("bad-row fraction above 1", "train", _train("data.max_bad_row_fraction=2"),
             "data.max_bad_row_fraction: 2.0 must be <= 1"),
    BadInput("zero reward workers", "train", _train("reward.num_workers=0"),
             "reward.num_workers: 0 must be >= 1"),
    BadInput("zero reward timeout", "train", _train("reward.timeout_s=0"),
             "reward.timeout_s: 0.0 must be > 0.0"),
    BadInput("tp that does not divide the heads", "train", _train("parallel.tp=3"),
             "parallel.tp: tp=3 must divide"),
    BadInput("MoE with tp=2 and no sequence parallelism", "train", _train("parallel.tp=2"),
             "requires sequence parallelism"),
    BadInput("ep that does not divide the experts", "train", _train("parallel.ep=3"),
             "parallel.ep: ep=3 must divide"),
    BadInput("virtual pipeline without pipeline", "train", _train("parallel.vpp=2"),
             "parallel.vpp: virtual pipeline stages need parallel.pp > 1"),
    BadInput("config world size vs launched processes", "train", _train("parallel.world_size=2"),
             "config says 2 but 1 processes"),
    BadInput("top-k above the expert count", "train", _train("model.moe_router_topk=5"),
             "model.moe_router_topk: 5 must be in [1, num_experts=4]"),
    BadInput("FP8 without Transformer Engine", "train", _train("model.fp8.enabled=true"),
             "model.fp8.enabled: FP8 needs model.transformer_impl=transformer_engine"),
    BadInput("disk weight sync without a directory", "train",
             _train("rollout.weight_sync.transport=disk"),
             "rollout.weight_sync.disk_dir: transport=disk needs a shared directory"),
    BadInput("NCCL weight sync with the embedded engine", "train",
             _train("rollout.weight_sync.transport=nccl"),
             "rollout.weight_sync.transport: 'nccl' needs server engines"),
    # ---- the model directory ----
    BadInput("model.hf_path unset", "train", _train("model.hf_path=null"),
             "model.hf_path: the trainer needs"),
    BadInput("model.hf_path does not exist", "train", _train("model.hf_path={d}/no_model"),
             "model.hf_path: {d}/no_model does not exist"),
    BadInput("model.hf_path is a file", "train", _train("model.hf_path={d}/file"),
             "model.hf_path: {d}/file is a file",
             setup=_write("file", "x")),
    BadInput("model directory without config.json", "train", _train(f"model.hf_path={M}"),
             "has no config.json",
             setup=_copy_model(lambda m: (m / "config.json").unlink())),
    BadInput("model directory without a tokenizer", "train", _train(f"model.hf_path={M}"),
             "has no tokenizer",
             setup=_copy_model(lambda m: (m / "tokenizer.json").unlink())),
    BadInput("config.json not JSON", "train", _train(f"model.hf_path={M}"),
             "config.json: not valid JSON",
             setup=_copy_model(lambda m: (m / "config.json").write_text("{"))),
    BadInput("unsupported model_type", "train", _train(f"model.hf_path={M}"),
             "model_type 'llama' is not supported",
             setup=_copy_model(_edit_config(model_type="llama"))),
    BadInput("config.json sizes do not match the weights", "train", _train(f"model.hf_path={M}"),
             "{d}/model/config.json: 'hidden_size' is 96 but the checkpoint's tensors hold 64",
             setup=_copy_model(_edit_config(hidden_size=96))),
    BadInput("truncated safetensors", "train", _train(f"model.hf_path={M}"),
             "model.hf_path: {d}/model/model.safetensors: cannot read safetensors file",
             setup=_copy_model(_truncate_weights)),
    BadInput("index lists a missing shard", "train", _train(f"model.hf_path={M}"),
             "model-00001-of-00002.safetensors: shard listed in model.safetensors.index.json is "
             "missing",
             setup=_copy_model(_index_missing_shard)),
    # ---- the prompt files ----
    BadInput("train file missing", "train", _train("data.train_path={d}/none.jsonl"),
             "data.train_path: {d}/none.jsonl does not exist"),
    BadInput("train path is a directory", "train", _train("data.train_path={d}"),
             "data.train_path: {d} is not a file"),
    BadInput("eval file missing", "train", _train("data.eval_path={d}/none.jsonl"),
             "data.eval_path: {d}/none.jsonl"),
    BadInput("binary train file", "train", _train("data.train_path={d}/train.jsonl"),
             "train.jsonl: binary data",
             setup=_write("train.jsonl", bytes(range(256)) * 8)),
    BadInput("Parquet file named .jsonl", "train", _train("data.train_path={d}/train.jsonl"),
             "(it starts like a Parquet file)",
             setup=_write("train.jsonl", b"PAR1\x15\x00\x15" + b"\x00" * 64)),
    BadInput("empty train file", "train", _train("data.train_path={d}/empty.jsonl"),
             "empty.jsonl: dataset is empty",
             setup=_write("empty.jsonl", "")),
    BadInput("train file not JSON", "train", _train("data.train_path={d}/t.jsonl"),
             "t.jsonl: 3 of 3 rows are malformed",
             setup=_write("t.jsonl", "a\nb\nc\n")),
    BadInput("train file not UTF-8", "train", _train("data.train_path={d}/t.jsonl"),
             "t.jsonl:1: not UTF-8 text",
             setup=_write("t.jsonl", b'{"prompt": "\xff\xfe", "answer": "1"}\n' * 3)),
    BadInput("wrong prompt key", "train",
             _train("data.train_path={d}/t.jsonl", "data.prompt_key=question"),
             "t.jsonl:1: missing prompt key 'question'",
             setup=_write("t.jsonl", _train_rows(GOOD_ROWS))),
    BadInput("duplicate ids", "train", _train("data.train_path={d}/t.jsonl"), "duplicate id 'x'",
             setup=_write("t.jsonl", _train_rows([{**r, "id": "x"} for r in GOOD_ROWS]))),
    BadInput("every prompt too long", "train", _train("data.max_prompt_tokens=1"),
             "no usable prompts"),
    BadInput("CSV train file", "train", _train("data.train_path={d}/t.csv"),
             "unsupported dataset format '.csv'",
             setup=_write("t.csv", "prompt,answer\n1+1=,2\n")),
    # ---- rewards and checkpoints ----
    BadInput("unknown reward", "train", _train("reward.name=no_such_reward"), "no_such_reward"),
    BadInput("reward module:function that does not import", "train",
             _train("reward.name=nowhere_mod:fn"), "nowhere_mod"),
    BadInput("checkpoint.load_dir missing", "train", _train("checkpoint.load_dir={d}/none"),
             "checkpoint.load_dir: {d}/none"),
    BadInput("checkpoint.load_dir not a checkpoint", "train", _train("checkpoint.load_dir={d}"),
             "checkpoint.load_dir:"),
    BadInput("checkpoint.load_dir missing a shard", "train", _train("checkpoint.load_dir={d}/ckpt"),
             "checkpoint.load_dir: {d}/ckpt: damaged or incomplete checkpoint",
             setup=_checkpoint("__0_0.distcp")),
    BadInput("--resume with no checkpoint", "train", lambda ws, d: _train()(ws, d) + ["--resume"],
             "checkpoint.resume=always but"),
    BadInput("resume after the train file changed", "train", _train("data.train_path={d}/t.jsonl"),
             "data.train_path changed since", setup=lambda ws,
             d: ws.finished_run(d, changed_data=True)),
    BadInput("resume with another seed", "train", _train("trainer.seed=7"), "trainer.seed is 7 but",
             setup=lambda ws, d: ws.finished_run(d)),
    # ---- gspo-export / gspo-convert ----
    BadInput("export --max-shard-size garbage", "export",
             _tool("--ckpt", "{d}", "--out", "{d}/o", "--max-shard-size", "garbage"),
             "'garbage' is not a size"),
    BadInput("export --max-shard-size 0", "export",
             _tool("--ckpt", "{d}", "--out", "{d}/o", "--max-shard-size", "0"),
             "'0' must be a positive size"),
    BadInput("export --tp 0", "export", _tool("--ckpt", "{d}", "--out", "{d}/o", "--tp", "0"),
             "--tp: 0 must be >= 1"),
    BadInput("export --dtype int8", "export",
             _tool("--ckpt", "{d}", "--out", "{d}/o", "--dtype", "int8"), "invalid choice: 'int8'"),
    BadInput("export from a missing directory", "export",
             _tool("--ckpt", "{d}/none", "--out", "{d}/o"), "{d}/none: neither"),
    BadInput("export from a checkpoint missing a file", "export",
             _tool("--ckpt", "{d}/ckpt", "--out", "{d}/o"),
             "{d}/ckpt: damaged or incomplete checkpoint", setup=_checkpoint("common.pt")),
    BadInput("export over an existing output", "export",
             _tool("--ckpt", "{d}/ckpt", "--out", "{d}/ckpt"),
             "already exists (use --overwrite", setup=_checkpoint()),
    BadInput("convert from a missing directory", "convert",
             _tool("--hf-dir", "{d}/none", "--out", "{d}/o"),
             "{d}/none: Hugging Face config.json not found"),
    BadInput("convert a truncated safetensors", "convert", _tool("--hf-dir", M, "--out", "{d}/o"),
             "model.safetensors: cannot read safetensors file",
             setup=_copy_model(_truncate_weights)),
    BadInput("convert over an existing output", "convert",
             _tool("--hf-dir", "{ws.model_dir}", "--out", "{d}"), "already exists"),
    BadInput("train with no arguments", "train", lambda ws, d: [],
             "the following arguments are required: config"),
]


def _cli_main(tool: str):
    if tool == "train":
        from gspo_megatron.cli.train import main
    elif tool == "export":
        from gspo_megatron.cli.export import main
    else:
        from gspo_megatron.cli.convert import main
    return main


def shown(case: BadInput, ws: Workspace, d: Path) -> str:
    """The case's own arguments (the shared tiny-run overrides left out)."""
    argv = case.argv(ws, d)
    base = set(ws.overrides(d / "run")) | {str(TINY_CONFIG)}
    text = " ".join(a for a in argv if a not in base) or "(no arguments)"
    return f"gspo-{case.tool} {text}"


def run_bad_input(ws: Workspace, case: BadInput) -> Result:
    """Run one case in this process and judge it (see the module docstring)."""
    start = time.monotonic()
    d = ws.fresh_dir(case.name)
    if case.setup:
        case.setup(ws, d)
    before = snapshot(d)
    call = call_cli(_cli_main(case.tool), case.argv(ws, d))
    written = sorted(set(snapshot(d).items()) - set(before.items()))
    expect = case.expect.format(d=d, ws=ws)
    if call.code == "traceback":
        verdict = "raw traceback"
    elif call.code == 0:
        verdict = "silent acceptance"
    elif call.code != case.code:
        verdict = f"exit {call.code}, expected {case.code}"
    elif expect not in call.line:
        verdict = f"unclear error (expected it to say: {expect})"
    elif written:
        verdict = f"wrote {[name for name, _ in written][:3]}"
    else:
        verdict = "clear error"
    return Result("bad input", case.name, shown(case, ws, d), str(call.code), call.line,
                  ok=verdict == "clear error", verdict=verdict,
                  seconds=time.monotonic() - start)
