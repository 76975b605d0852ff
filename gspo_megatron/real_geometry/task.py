"""The real-format task: arithmetic questions asked the way a user asks Qwen3.

Each row's prompt is a plain question (``"What is 12+34?"``); the data loader renders it through
the model's own chat template, and a run sets ``data.chat_template_kwargs={enable_thinking:
false}`` so that the template closes the prompt with Qwen3's empty think block (non-thinking
mode). Digits are single tokens, so a prompt is 17 tokens plus its digits: 21 for ``12+34``.
The problems are the tiny task's (``tiny_task/task.py``: same seeds, disjoint train / eval), only
asked in words.

Rewards, both in ``rewards/chat.py``: ``final_number`` parses a reply the way a user's
evaluation would (thinking block removed, ``\\boxed{}`` / "the answer is" / last number) and is
the task's real reward; ``brevity`` moves even for a randomly initialised model and is there for
the real-width CPU runs, whose random weights never answer correctly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Tuple

from gspo_megatron.tiny_task.task import (AdditionProblem, AdditionTaskConfig, make_splits,
                                          write_jsonl)


def question_rows(problems: Iterable[AdditionProblem], prefix: str) -> List[dict]:
    """Dataset rows (``id``, ``prompt``, ``answer``, ``metadata``) asking each sum in words."""
    return [{"id": f"{prefix}-{i:05d}", "prompt": f"What is {p.a}+{p.b}?", "answer": p.answer,
             "metadata": {"a": p.a, "b": p.b}} for i, p in enumerate(problems)]


def write_question_datasets(out_dir: Path, cfg: AdditionTaskConfig = AdditionTaskConfig()
                            ) -> Tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``; return their paths."""
    train, held_out = make_splits(cfg)
    out_dir = Path(out_dir)
    return (write_jsonl(question_rows(train, "train"), out_dir / "train.jsonl"),
            write_jsonl(question_rows(held_out, "eval"), out_dir / "eval.jsonl"))
