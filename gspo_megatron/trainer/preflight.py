"""Check a run's inputs on disk before anything is built, loaded or written.

``config/validate.py`` checks the configuration tree on its own (it runs on every file in
``configs/`` in the tests, where the model directories do not exist). What needs the files
themselves is checked here, at start-up, so that a wrong path fails in a second with the key and
the file named, instead of minutes later inside transformers or Megatron:

* ``model.hf_path``: a directory with a readable ``config.json`` and a tokenizer;
* the tokenizer (``load_tokenizer``): it loads, and has no more tokens than config.json's
  ``vocab_size``;
* the initial weights: ``checkpoint.load_dir`` must be a complete gspo-megatron checkpoint;
  otherwise the safetensors in ``model.hf_path`` must be complete (no truncated shard) and match
  ``config.json`` key by key and tensor by tensor (the converter's own check,
  ``checkpoint/hf_checks.py``);
* ``data.train_path`` / ``data.eval_path``: existing files (their rows are checked on load), and
  enough usable prompts in the first to fill a step.

    check_input_files(cfg)                       # before the tokenizer and the data load
    check_enough_prompts(train.stats, cfg)       # once the prompts are loaded
    check_initial_weights(cfg, resuming=False)   # once the resume decision is known
"""

from __future__ import annotations

import logging
from pathlib import Path

from gspo_megatron.checkpoint.convert import model_config_for_hf_dir
from gspo_megatron.checkpoint.hf_checks import check_tokenizer_fits, open_validated
from gspo_megatron.checkpoint.hf_io import HFCheckpointError
from gspo_megatron.checkpoint.mapping import MappingError
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.data.records import DataLoadError
from gspo_megatron.learner.checkpoint_files import CheckpointError, require_complete
from gspo_megatron.learner.checkpointing import read_meta

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _check_hf_dir(hf_path: str) -> None:
    path = Path(hf_path)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise ConfigError(f"model.hf_path: {path} {what}; it must be a Hugging Face model "
                          "directory (config.json, tokenizer, safetensors)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.hf_path: {path} has no config.json")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.hf_path: {path} has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)})")


def check_initial_weights(cfg, resuming: bool) -> None:
    """The weights a fresh run starts from are complete and match the model's config."""
    if cfg.checkpoint.load_dir:
        try:
            require_complete(cfg.checkpoint.load_dir, require_manifest=False)
            read_meta(cfg.checkpoint.load_dir)
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint.load_dir: {exc}") from None
        return
    if resuming:
        return  # the run's own checkpoint holds the weights
    check_hf_weights(cfg)


def check_hf_weights(cfg) -> None:
    """The safetensors of ``model.hf_path`` are complete and match its config.json. Also run
    before the embedded engine starts: it loads this directory whatever the learner starts from,
    and its loader's own error is a size-mismatch traceback without the path."""
    model = model_config_for_hf_dir(cfg.model.hf_path, cfg.model)  # the sizes of config.json
    try:
        open_validated(cfg.model.hf_path, model)
    except (HFCheckpointError, MappingError) as exc:
        raise ConfigError(f"model.hf_path: {exc}") from None


def _check_data_files(cfg) -> None:
    if not cfg.data.train_path:
        raise ConfigError("data.train_path: no training prompts given")
    for key in ("train_path", "eval_path"):
        value = getattr(cfg.data, key)
        if value and not Path(value).is_file():
            raise ConfigError(f"data.{key}: {value} "
                              f"{'is not a file' if Path(value).exists() else 'does not exist'}")


def check_input_files(cfg) -> None:
    """The model directory and the prompt files exist (before the tokenizer or data load)."""
    if not cfg.model.hf_path:
        raise ConfigError("model.hf_path: the trainer needs a Hugging Face directory for the "
                          "tokenizer and the rollout engine's architecture")
    _check_hf_dir(cfg.model.hf_path)
    _check_data_files(cfg)


def check_enough_prompts(stats, cfg) -> None:
    """A step draws ``batch.num_prompts_per_step`` distinct prompts (each one's samples share its
    group); fewer usable ones than that cannot fill a step, so refuse at start with the counts."""
    need = cfg.batch.num_prompts_per_step
    if stats.num_loaded < need:
        raise DataLoadError(
            f"{stats.path}: {stats.num_loaded} usable prompts ({stats.num_rows} rows, "
            f"{stats.num_bad} malformed, {stats.num_too_long} longer than "
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}), fewer than "
            f"batch.num_prompts_per_step={need}: add prompts, raise data.max_prompt_tokens or "
            "lower batch.num_prompts_per_step")


def load_tokenizer(hf_path: str):
    """The run's tokenizer; transformers' errors become one line naming ``model.hf_path``."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_path)
    except (OSError, ValueError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model.hf_path: cannot load the tokenizer from {hf_path}: {first}") from None
    tokenizer_file = next((Path(hf_path) / n for n in TOKENIZER_FILES
                           if (Path(hf_path) / n).is_file()), Path(hf_path))
    try:
        check_tokenizer_fits(len(tokenizer), model_config_for_hf_dir(hf_path).vocab_size,
                             tokenizer_file, Path(hf_path) / "config.json")
    except HFCheckpointError as exc:
        raise ConfigError(f"model.hf_path: {exc}") from None
    return tokenizer
