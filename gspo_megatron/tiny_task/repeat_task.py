"""The tiny long-tail task: write a digit a given number of times, e.g. ``"7*12="`` ->
``"777777777777"``.

Why: asynchronous rollouts (issue 40) pay where response lengths within one batch vary by 10x or
more, as reasoning lengths do; the addition task's answers are all 1-3 digits. Here the answer
length *is* the problem: the count ``n`` is drawn from a long-tailed distribution, so most answers
are short and a few are long, on the addition task's character vocabulary (``vocab.ALPHABET``:
digits, ``*``, ``=``) and model, so the cold-start SFT, GSPO and the ``tiny_repeat`` exact reward
(``rewards/builtin.py``) run it unchanged (``configs/tiny_longtail.yaml``). Copying the digit is
trivial; stopping after exactly ``n`` digits is what the tiny model must learn, and it is harder
the longer the answer, so long answers are also the ones sampled wrong, as long reasoning is.

**Length distribution.** ``n`` is log-uniform (the reciprocal distribution): ``n = floor(X)`` with
``log X`` uniform on ``[log min_count, log(max_count + 1))``, so every doubling of the length is
about equally likely, ``P(n = k) = log((k + 1) / k) / log((max + 1) / min)``. With the defaults
(1..40): ``P(n = 1)`` = 18.7%, median 6, mean 10.3, 10% of the answers 28-40 digits long.

**Spread by construction.** Rows come in blocks of ``block_size`` (32, a rollout batch's prompts)
drawn by stratified sampling: the block's ``i``-th count comes from quantile stratum
``[i / 32, (i + 1) / 32)`` of that distribution, then the block is shuffled. Every block therefore
holds the distribution's whole range: with the defaults at least five counts of 1 (strata 0-4 lie
below ``log 2 / log 41``) and one of 36-40 (the top stratum), so within every block the answer
lengths span >= 36x, the response lengths (answer + eos) >= 18.5x, and the block's 10th / 90th
percentile counts are 1 / >= 25 (response lengths 2 / >= 26: >= 13x). A trainer that reads the
file in order (``data.shuffle: false``) with ``batch.num_prompts_per_step`` and
``trainer.sft_batch_size`` multiples of 32 draws whole blocks only, since every split's size is a
multiple of the block size.

**Disjoint splits.** For every count, ``num_eval_digits`` of the 10 digits (drawn with
``split_seed``) are held out: eval rows use only those ``(digit, count)`` pairs, train rows only
the others, so every held-out problem pairs a digit and a count each seen in training, never
together. Both splits follow the same long-tail distribution (a pair recurs as often as it is
drawn; ids stay unique). The same config always writes byte-identical files.

    from gspo_megatron.tiny_task.repeat_task import RepeatTaskConfig, write_repeat_datasets
    write_repeat_datasets("runs/tiny_longtail_assets/data", RepeatTaskConfig())
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from gspo_megatron.tiny_task.task import write_jsonl

NUM_DIGITS = 10


@dataclass(frozen=True)
class RepeatTaskConfig:
    """Range and distribution of the counts, split sizes and seeds."""

    min_count: int = 1
    max_count: int = 40
    """Longest answer (digits); a response needs ``max_count + 1`` tokens with eos. At most 99,
    so a prompt is at most 5 characters (``"7*40="``)."""
    block_size: int = 32
    """Rows per stratified block (the rollout batch's prompts); split sizes are multiples of it."""
    num_train: int = 4096
    num_eval: int = 192
    num_eval_digits: int = 2
    """Digits held out for evaluation, per count."""
    split_seed: int = 2
    train_seed: int = 0
    eval_seed: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_count < self.max_count <= 99:
            raise ValueError(f"need 1 <= min_count < max_count <= 99, got "
                             f"{self.min_count}..{self.max_count}")
        if not 1 <= self.num_eval_digits < NUM_DIGITS:
            raise ValueError(f"num_eval_digits must be in 1..{NUM_DIGITS - 1}, "
                             f"got {self.num_eval_digits}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("num_train", "num_eval"):
            size = getattr(self, name)
            if size < self.block_size or size % self.block_size:
                raise ValueError(f"{name}={size} must be a positive multiple of "
                                 f"block_size={self.block_size} (whole blocks keep the spread)")


@dataclass(frozen=True)
class RepeatProblem:
    """One problem: ``digit`` written ``count`` times."""

    digit: int
    count: int

    @property
    def prompt(self) -> str:
        return f"{self.digit}*{self.count:02d}="

    @property
    def answer(self) -> str:
        return str(self.digit) * self.count


def count_at_quantile(u: float, cfg: RepeatTaskConfig) -> int:
    """The count at quantile ``u`` in [0, 1) of the log-uniform length distribution."""
    log_low, log_high = math.log(cfg.min_count), math.log(cfg.max_count + 1)
    return min(cfg.max_count, int(math.exp(log_low + u * (log_high - log_low))))


def block_counts(rng: random.Random, cfg: RepeatTaskConfig) -> List[int]:
    """One block's counts: one per equal-probability stratum, in shuffled order."""
    counts = [count_at_quantile((i + rng.random()) / cfg.block_size, cfg)
              for i in range(cfg.block_size)]
    rng.shuffle(counts)
    return counts


def held_out_digits(cfg: RepeatTaskConfig) -> Dict[int, Tuple[int, ...]]:
    """Count -> the digits whose ``(digit, count)`` problems belong to the eval split only."""
    rng = random.Random(cfg.split_seed)
    return {n: tuple(sorted(rng.sample(range(NUM_DIGITS), cfg.num_eval_digits)))
            for n in range(cfg.min_count, cfg.max_count + 1)}


def _draw_split(num_rows: int, digits_of: Dict[int, Sequence[int]], seed: int,
                cfg: RepeatTaskConfig) -> List[RepeatProblem]:
    rng = random.Random(seed)
    problems = []
    for _ in range(num_rows // cfg.block_size):
        problems += [RepeatProblem(rng.choice(digits_of[n]), n) for n in block_counts(rng, cfg)]
    return problems


def make_splits(cfg: RepeatTaskConfig) -> Tuple[List[RepeatProblem], List[RepeatProblem]]:
    """``(train, eval)`` problem lists; no ``(digit, count)`` pair is in both."""
    eval_digits = held_out_digits(cfg)
    train_digits = {n: [d for d in range(NUM_DIGITS) if d not in held]
                    for n, held in eval_digits.items()}
    return (_draw_split(cfg.num_train, train_digits, cfg.train_seed, cfg),
            _draw_split(cfg.num_eval, eval_digits, cfg.eval_seed, cfg))


def problem_rows(problems: Sequence[RepeatProblem], prefix: str) -> List[dict]:
    """Dataset rows in the loader's format: ``id``, ``prompt``, ``answer``, ``metadata``."""
    return [{"id": f"{prefix}-{i:05d}", "prompt": p.prompt, "answer": p.answer,
             "metadata": {"digit": p.digit, "count": p.count}} for i, p in enumerate(problems)]


def write_repeat_datasets(out_dir: Path, cfg: RepeatTaskConfig = RepeatTaskConfig()
                          ) -> Tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``; return their paths."""
    train, held_out = make_splits(cfg)
    out_dir = Path(out_dir)
    return (write_jsonl(problem_rows(train, "train"), out_dir / "train.jsonl"),
            write_jsonl(problem_rows(held_out, "eval"), out_dir / "eval.jsonl"))
