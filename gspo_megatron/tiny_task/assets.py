"""Write every asset of the tiny CPU demo into one directory.

Layout of ``out_dir``::

    model/        HF Qwen3-MoE (random init): config.json, model.safetensors,
                  generation_config.json, tokenizer files
    data/train.jsonl, data/eval.jsonl   addition problems (disjoint, fixed seeds)

The same ``seed`` and task settings always give byte-identical datasets and identical weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gspo_megatron.tiny_task.model import TinyModelSpec, create_tiny_model, save_tiny_model
from gspo_megatron.tiny_task.task import AdditionTaskConfig, write_task_datasets
from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyAssets:
    """Paths of the written assets."""

    model_dir: Path
    train_path: Path
    eval_path: Path


def make_tiny_assets(out_dir: Path, task: AdditionTaskConfig = AdditionTaskConfig(),
                     spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> TinyAssets:
    """Build tokenizer, model and datasets under ``out_dir``."""
    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer()
    model = create_tiny_model(tokenizer, seed=seed, spec=spec)
    model_dir = save_tiny_model(model, tokenizer, out_dir / "model")
    train_path, eval_path = write_task_datasets(out_dir / "data", task)
    logger.info("tiny assets: model %s (%d parameters, vocab %d), %d train / %d eval problems",
                model_dir, sum(p.numel() for p in model.parameters()), len(tokenizer),
                task.num_train, task.num_eval)
    return TinyAssets(model_dir=model_dir, train_path=train_path, eval_path=eval_path)
