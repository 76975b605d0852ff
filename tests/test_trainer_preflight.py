"""The run's start-up checks of ``model.hf_path``: a tokenizer with more tokens than config.json's
vocab_size and a config.json that disagrees with the weights are refused as ConfigErrors naming
the key and the files, before anything is built."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from gspo_megatron.config.schema import ModelConfig
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.trainer.preflight import check_hf_weights, load_tokenizer
from tests.qwen3_assets import REAL_VOCAB, qwen3_tokenizer_dir, write_tiny  # noqa: F401


def test_tokenizer_larger_than_vocab_size_is_refused(tmp_path, qwen3_tokenizer_dir):  # noqa: F811
    d = write_tiny(tmp_path / "m")  # vocab_size 1024
    for f in qwen3_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    with pytest.raises(ConfigError,
                       match=rf"^model.hf_path: {d}/tokenizer.json: the tokenizer has 151669 tokens "
                             rf"but {d}/config.json: 'vocab_size' is 1024; ids 1024..151668"):
        load_tokenizer(str(d))
    ok = write_tiny(tmp_path / "ok", tokenizer_dir=qwen3_tokenizer_dir, vocab_size=REAL_VOCAB)
    assert len(load_tokenizer(str(ok))) == 151669


def test_config_that_disagrees_with_the_weights_names_the_key(tmp_path):
    d = write_tiny(tmp_path / "m", num_experts=4)
    text = (d / "config.json").read_text().replace('"num_experts": 4', '"num_experts": 8')
    (d / "config.json").write_text(text)
    cfg = SimpleNamespace(model=ModelConfig(hf_path=str(d)))
    with pytest.raises(ConfigError, match=rf"^model.hf_path: {d}/config.json: 'num_experts' is 8 "
                                          "but the checkpoint's tensors hold 4"):
        check_hf_weights(cfg)
