"""Character tokenizer: one token per character, round trips, survives save/load with its settings."""

from __future__ import annotations

from transformers import AutoTokenizer

from gspo_megatron.tiny_task.tokenizer import ALPHABET, SPECIAL_TOKENS, build_char_tokenizer


def test_one_token_per_character_and_round_trip():
    tok = build_char_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(ALPHABET)
    text = "Q: 12+34= 46\nA:"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.convert_ids_to_tokens(tok("10")["input_ids"]) == ["1", "0"]
    assert tok("x")["input_ids"] == [tok.unk_token_id]


def test_save_and_reload_keeps_padding_side_and_input_names(tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.padding_side == "left"
    assert tok.model_input_names == ["input_ids", "attention_mask"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    batch = tok(["1+2=", "10+20="], padding=True)
    assert set(batch) == {"input_ids", "attention_mask"}
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2  # left padded


def test_a_wider_alphabet_keeps_the_special_ids_and_refuses_repeats():
    import pytest

    from gspo_megatron.tiny_task.vocab import TEXT_ALPHABET as CHARS

    tok = build_char_tokenizer(alphabet=CHARS)
    default = build_char_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS)
    assert (tok.pad_token_id, tok.eos_token_id) == (default.pad_token_id, default.eos_token_id)
    assert tok.decode(tok.encode("what is 1+1?")) == "what is 1+1?"
    with pytest.raises(ValueError, match="repeats a character"):
        build_char_tokenizer(alphabet="aab")
