"""Write every asset of the tiny CPU demo into one directory.

Layout of ``out_dir``::

    model/        HF Qwen3-MoE (random init): config.json, model.safetensors,
                  generation_config.json, tokenizer files
    data/train.jsonl, data/eval.jsonl   the task's problems (disjoint, fixed seeds): addition
                  (``task.py``, the default) or the long-tail repeat task (``repeat_task.py``),
                  chosen by the type of ``task``

The same ``seed`` and task settings always give byte-identical datasets and identical weights;
the model does not depend on the task.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from gspo_megatron.tiny_task.model import TinyModelSpec, create_tiny_model, save_tiny_model
from gspo_megatron.tiny_task.repeat_task import RepeatTaskConfig, write_repeat_datasets
from gspo_megatron.tiny_task.task import AdditionTaskConfig, write_task_datasets
from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer

TaskConfig = Union[AdditionTaskConfig, RepeatTaskConfig]
_DATASET_WRITERS = {AdditionTaskConfig: write_task_datasets,
                    RepeatTaskConfig: write_repeat_datasets}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyAssets:
    """Paths of the written assets."""

    model_dir: Path
    train_path: Path
    eval_path: Path


def make_tiny_assets(out_dir: Path, task: TaskConfig = AdditionTaskConfig(),
                     spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> TinyAssets:
    """Build tokenizer, model and the datasets of ``task`` under ``out_dir``."""
    write_datasets = _DATASET_WRITERS.get(type(task))
    if write_datasets is None:
        raise TypeError(f"no dataset writer for task config {type(task).__name__}")
    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer()
    model = create_tiny_model(tokenizer, seed=seed, spec=spec)
    model_dir = save_tiny_model(model, tokenizer, out_dir / "model")
    train_path, eval_path = write_datasets(out_dir / "data", task)
    logger.info("tiny assets: model %s (%d parameters, vocab %d), %d train / %d eval problems (%s)",
                model_dir, sum(p.numel() for p in model.parameters()), len(tokenizer),
                task.num_train, task.num_eval, type(task).__name__)
    return TinyAssets(model_dir=model_dir, train_path=train_path, eval_path=eval_path)
