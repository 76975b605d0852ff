"""The tiny verifiable task: n-digit + n-digit addition, e.g. prompt ``"12+34="``, answer ``"46"``.

Why addition: the answer is checkable exactly, a tiny Qwen3-MoE learns the format in a few
dozen supervised steps but the carries take much longer, so after a short cold-start SFT the
model is right on a minority of prompts and sampled responses are sometimes right — exactly the
situation in which GSPO has a signal to push on. Train and held-out eval sets are drawn with
fixed seeds and never share a problem.

The response the model must produce is the decimal sum followed by the tokenizer's eos token;
the ``tiny_addition`` reward (``rewards/builtin.py``) gives 1.0 when the digits generated before
eos (or before the end of the text) equal the answer, else 0.0.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Tuple


@dataclass(frozen=True)
class AdditionTaskConfig:
    """Sizes and seeds of the generated datasets."""

    num_digits: int = 2
    """Digits of each operand (operands are drawn uniformly from [0, 10**num_digits))."""
    num_train: int = 4000
    num_eval: int = 200
    train_seed: int = 0
    eval_seed: int = 1


@dataclass(frozen=True)
class AdditionProblem:
    """One problem: ``prompt`` is what the model is given, ``answer`` the exact expected digits."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def _draw_pairs(num: int, num_digits: int, rng: random.Random,
                exclude: Optional[set] = None) -> List[Tuple[int, int]]:
    space = 10 ** num_digits
    exclude = exclude or set()
    if num > space * space - len(exclude):
        raise ValueError(f"cannot draw {num} distinct {num_digits}-digit problems "
                         f"({space * space} exist, {len(exclude)} excluded)")
    pairs: List[Tuple[int, int]] = []
    seen = set(exclude)
    while len(pairs) < num:
        pair = (rng.randrange(space), rng.randrange(space))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def make_splits(cfg: AdditionTaskConfig) -> Tuple[List[AdditionProblem], List[AdditionProblem]]:
    """Disjoint (train, eval) problem lists; the eval set is drawn first so it does not depend
    on ``num_train``."""
    eval_pairs = _draw_pairs(cfg.num_eval, cfg.num_digits, random.Random(cfg.eval_seed))
    train_pairs = _draw_pairs(cfg.num_train, cfg.num_digits, random.Random(cfg.train_seed),
                              exclude=set(eval_pairs))
    return ([AdditionProblem(a, b) for a, b in train_pairs],
            [AdditionProblem(a, b) for a, b in eval_pairs])


def problem_rows(problems: Iterable[AdditionProblem], prefix: str) -> List[dict]:
    """Dataset rows in the loader's format: ``id``, ``prompt``, ``answer``, ``metadata``."""
    return [{"id": f"{prefix}-{i:05d}", "prompt": p.prompt, "answer": p.answer,
             "metadata": {"a": p.a, "b": p.b}} for i, p in enumerate(problems)]


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: Path) -> Path:
    """Write one JSON object per line (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_task_datasets(out_dir: Path, cfg: AdditionTaskConfig = AdditionTaskConfig()
                        ) -> Tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``; return their paths."""
    train, held_out = make_splits(cfg)
    out_dir = Path(out_dir)
    return (write_jsonl(problem_rows(train, "train"), out_dir / "train.jsonl"),
            write_jsonl(problem_rows(held_out, "eval"), out_dir / "eval.jsonl"))
