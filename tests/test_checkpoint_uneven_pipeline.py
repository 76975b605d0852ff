"""Uneven pipeline stages end to end: a 3-layer Qwen3-MoE on PP=2 (1 + 2 layers) converts,
exports bit-exactly, trains one GSPO step that matches the same step on one stage, reshards and
exports the trained weights again bit-exactly; the export keeps the source's config.json fields
(``router_aux_loss_coef``) although the run trained with another coefficient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo_megatron.config.schema import GSPOConfig, ModelConfig, ParallelConfig
from tests.multiproc import run_on_ranks
from tests.test_checkpoint_convert import VOCAB, assert_same_tensors, make_hf_model, reinit_layout

SOURCE_AUX_COEF = 0.001


def _learner_cfg(hf_dir: str, **parallel) -> GSPOConfig:
    cfg = GSPOConfig()
    cfg.model = ModelConfig(hf_path=hf_dir, transformer_impl="local", params_dtype="fp32",
                            moe_aux_loss_coeff=0.0)
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optimizer.lr = 1e-3
    cfg.batch.max_tokens_per_micro_batch = 24
    cfg.algo.clip_eps_low, cfg.algo.clip_eps_high = 0.2, 0.27
    return cfg


def _batch(old=None):
    from gspo_megatron.learner.batch import SequenceBatch

    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 12, 9, 15)]
    batch = SequenceBatch(token_ids=tokens, prompt_lens=[3, 4, 3, 5], advantages=[1.0, -1.0, 0.5, -0.5])
    if old is not None:
        batch.old_logprobs = [o + 1e-3 * torch.randn(o.shape, generator=gen) for o in old]
    return batch


def _train_one_step(cfg: GSPOConfig, init_dir: Path, out_dir: Path) -> dict:
    from megatron.core import parallel_state

    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=3), total_steps=4)
    learner.load_weights(init_dir)
    lp = learner.compute_logprobs(_batch()).logprobs
    metrics = learner.train_step(_batch(old=lp), get_policy_loss("gspo"))
    learner.save_weights(out_dir)
    layers = [len(c.module.decoder.layers) for c in learner.model]
    return {"lp": lp, "loss": metrics["loss"], "layers": layers}


def _uneven(rank: int, hf_dir: str, work: str) -> dict:
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import export_megatron_to_hf
    from gspo_megatron.checkpoint.reshard import reshard_checkpoint
    from gspo_megatron.learner.checkpointing import read_meta

    work_dir = Path(work)
    pp2 = ParallelConfig(pp=2)  # the tools choose the split: 3 layers -> 1 + 2
    reinit_layout(pp2)
    convert_hf_to_megatron(hf_dir, work_dir / "mcore", pp2)
    export_megatron_to_hf(work_dir / "mcore", work_dir / "hf_converted", pp2, max_shard_bytes=30_000)
    converted_parallel = read_meta(work_dir / "mcore")["parallel"]

    uneven = _train_one_step(_learner_cfg(hf_dir, pp=2, num_layers_in_first_pipeline_stage=1,
                                          num_layers_in_last_pipeline_stage=2),
                             work_dir / "mcore", work_dir / "trained_pp2")
    even = _train_one_step(_learner_cfg(hf_dir), work_dir / "mcore", work_dir / "trained_pp1")

    reinit_layout(pp2)
    export_megatron_to_hf(work_dir / "trained_pp2", work_dir / "hf_trained_pp2", pp2)
    pp1 = ParallelConfig()
    reinit_layout(pp1)
    reshard_checkpoint(work_dir / "trained_pp2", work_dir / "resharded_pp1", pp1)
    export_megatron_to_hf(work_dir / "resharded_pp1", work_dir / "hf_resharded", pp1)
    export_megatron_to_hf(work_dir / "trained_pp1", work_dir / "hf_trained_pp1", pp1)
    return {"converted_parallel": converted_parallel, "uneven": uneven, "even": even}


def _load_all(d: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.slow
def test_three_layers_on_two_stages_convert_train_reshard_export(tmp_path):
    hf_dir = make_hf_model("qwen3_moe", tmp_path / "hf", num_layers=3,
                           extra={"router_aux_loss_coef": SOURCE_AUX_COEF})
    results = run_on_ranks(_uneven, world_size=2, timeout_s=900, hf_dir=str(hf_dir),
                           work=str(tmp_path))
    r0, r1 = results
    assert r0["converted_parallel"]["num_layers_in_first_pipeline_stage"] == 1
    assert r0["converted_parallel"]["num_layers_in_last_pipeline_stage"] == 2
    assert r0["uneven"]["layers"] == [1] and r1["uneven"]["layers"] == [2]
    assert r0["even"]["layers"] == [3]

    # Conversion then export under the uneven layout is bit-exact (18 + 3*... tensors).
    assert assert_same_tensors(hf_dir, tmp_path / "hf_converted") == 3 * (8 + 1 + 4 * 3) + 3

    # The uneven PP=2 step is the single-stage step.
    for a, b in zip(r0["uneven"]["lp"], r0["even"]["lp"]):
        assert torch.allclose(a, b, atol=2e-5)
    assert r1["uneven"]["loss"] == pytest.approx(r0["even"]["loss"], rel=1e-4)
    trained, reference = _load_all(tmp_path / "hf_trained_pp2"), _load_all(tmp_path / "hf_trained_pp1")
    original = _load_all(hf_dir)
    assert sorted(trained) == sorted(reference) == sorted(original)
    moved = [k for k in trained if not torch.equal(trained[k], original[k])]
    assert len(moved) > len(trained) // 2, "one optimizer step must change most tensors"
    for k in trained:
        assert torch.allclose(trained[k], reference[k], atol=2e-6), k

    # Resharding the trained uneven checkpoint to one stage changes nothing.
    assert assert_same_tensors(tmp_path / "hf_trained_pp2", tmp_path / "hf_resharded") == len(trained)

    # The source's recipe fields survive export; the architecture is the model's.
    exported = json.loads((tmp_path / "hf_trained_pp2" / "config.json").read_text())
    assert exported["router_aux_loss_coef"] == SOURCE_AUX_COEF
    assert exported["num_hidden_layers"] == 3
