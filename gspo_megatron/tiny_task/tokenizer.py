"""Character-level tokenizer of the tiny addition task.

Every character of the task alphabet is one token, so the model sees digits one at a time and
the reward can compare generated digits exactly. The tokenizer is built with the ``tokenizers``
library (WordLevel vocabulary, a ``Split("", "isolated")`` pre-tokenizer that cuts text into
single characters, a ``Fuse`` decoder that glues them back) and wrapped in
``transformers.PreTrainedTokenizerFast`` so that every consumer (rollout engine, learner, HF
``generate``) loads it with ``AutoTokenizer.from_pretrained``.

Two pitfalls of the wrapper are handled here: ``model_input_names`` must exclude
``token_type_ids`` (``generate`` rejects them) and ``padding_side`` must be passed to the
constructor (it is otherwise lost when the tokenizer is saved and reloaded).
"""

from __future__ import annotations

from typing import Dict

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gspo_megatron.tiny_task.vocab import (  # noqa: F401  (re-exported)
    ALPHABET,
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
)


def build_vocab(alphabet: str = ALPHABET) -> Dict[str, int]:
    """Token -> id: special tokens first (pad = 0), then the alphabet in a fixed order."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet {alphabet!r} repeats a character")
    tokens = list(SPECIAL_TOKENS) + list(alphabet)
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer(padding_side: str = "left", model_max_length: int = 128,
                         alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer (left padding by default, as generation needs).

    ``alphabet`` defaults to the addition task's; rollout tests pass a wider one (letters)."""
    core = Tokenizer(models.WordLevel(vocab=build_vocab(alphabet), unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side=padding_side,
        model_max_length=model_max_length,
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )
