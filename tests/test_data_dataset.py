"""Loading prompt datasets: JSONL and Parquet, chat templates, long / malformed rows, errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_megatron.config.schema import DataConfig
from gspo_megatron.data import DataLoadError, load_prompt_dataset
from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}A:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture()
def chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _rows(n):
    return [json.dumps({"id": f"p{i}", "prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(n)]


def test_jsonl_loads_raw_prompts_with_ids_answers_metadata(tmp_path, tokenizer):
    lines = [json.dumps({"id": "a", "prompt": "12+34=", "answer": 46, "metadata": {"k": 1},
                         "level": 3}),
             "",
             json.dumps({"prompt": "1+2=", "answer": "3"})]
    ds = load_prompt_dataset(_write_lines(tmp_path / "d.jsonl", lines), tokenizer, DataConfig())
    assert [r.prompt_id for r in ds.records] == ["a", "d.jsonl:3"]
    first = ds.records[0]
    assert first.prompt_text == "12+34="
    assert tokenizer.decode(list(first.prompt_token_ids)) == "12+34="
    assert first.answer == "46"
    assert first.metadata == {"k": 1, "level": 3}
    assert ds.stats.num_rows == 2 and ds.stats.num_loaded == 2 and ds.stats.num_bad == 0


def test_parquet_with_custom_keys_and_chat_messages(tmp_path, chat_tokenizer):
    table = pa.table({
        "question": [[{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}],
                     [{"role": "user", "content": "2+2="}]],
        "gold": ["2", "4"],
    })
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    cfg = DataConfig(prompt_key="question", answer_key="gold")
    ds = load_prompt_dataset(path, chat_tokenizer, cfg)
    assert [r.prompt_text for r in ds.records] == ["[system]add\n[user]1+1=\nA:", "[user]2+2=\nA:"]
    assert [r.prompt_id for r in ds.records] == ["d.parquet:row1", "d.parquet:row2"]
    assert [r.answer for r in ds.records] == ["2", "4"]


def test_string_prompt_is_wrapped_as_user_message_when_template_exists(tmp_path, chat_tokenizer):
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "3+4=", "answer": "7"})])
    ds = load_prompt_dataset(path, chat_tokenizer, DataConfig())
    record = ds.records[0]
    assert record.prompt_text == "[user]3+4=\nA:"
    assert len(record.prompt_token_ids) == len(record.prompt_text) - len("[user]") + 6


def test_chat_template_kwargs_reach_the_template(tmp_path, chat_tokenizer):
    chat_tokenizer.chat_template = CHAT_TEMPLATE + "{% if enable_thinking is false %}no{% endif %}"
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "3+4=", "answer": "7"})])
    cfg = DataConfig(chat_template_kwargs={"enable_thinking": False})
    assert load_prompt_dataset(path, chat_tokenizer, cfg).records[0].prompt_text == "[user]3+4=\nA:no"
    assert load_prompt_dataset(path, chat_tokenizer, DataConfig()).records[0].prompt_text == "[user]3+4=\nA:"


def test_long_prompts_are_skipped_and_counted(tmp_path, tokenizer):
    lines = [json.dumps({"prompt": "1+1=", "answer": "2"}),
             json.dumps({"prompt": "1" * 40 + "+1=", "answer": "x"})]
    cfg = DataConfig(max_prompt_tokens=10)
    ds = load_prompt_dataset(_write_lines(tmp_path / "d.jsonl", lines), tokenizer, cfg)
    assert len(ds) == 1 and ds.stats.num_too_long == 1 and ds.stats.num_bad == 0


def test_malformed_rows_are_skipped_with_file_and_line(tmp_path, tokenizer, caplog):
    lines = _rows(30)
    lines[4] = "{not json"
    lines[9] = json.dumps({"prompt": "1+1="})  # missing answer
    lines[14] = json.dumps({"prompt": 5, "answer": "5"})  # wrong type
    lines[19] = json.dumps({"prompt": [{"role": "user"}], "answer": "1"})  # bad message
    lines[24] = json.dumps({"id": "p0", "prompt": "1=", "answer": "1"})  # duplicate id
    path = _write_lines(tmp_path / "d.jsonl", lines)
    ds = load_prompt_dataset(path, tokenizer, DataConfig(max_bad_row_fraction=0.2))
    assert len(ds) == 25 and ds.stats.num_bad == 5
    locations = [b.location for b in ds.stats.bad_rows]
    assert locations == [f"{path}:{n}" for n in (5, 10, 15, 20, 25)]
    reasons = " | ".join(b.reason for b in ds.stats.bad_rows)
    for expected in ("invalid JSON", "missing answer key 'answer'", "must be a string or a list",
                     "'prompt[0]' needs string 'role' and 'content'", "duplicate id 'p0'"):
        assert expected in reasons
    assert f"{path}:10" in caplog.text


def test_too_many_bad_rows_stop_the_load_naming_file_and_lines(tmp_path, tokenizer):
    lines = _rows(10)
    lines[2] = "[1, 2]"
    lines[6] = json.dumps({"answer": "1"})
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataLoadError) as err:
        load_prompt_dataset(path, tokenizer, DataConfig(max_bad_row_fraction=0.1))
    message = str(err.value)
    assert str(path) in message and "2 of 10 rows" in message
    assert f"{path}:3: expected a JSON object" in message
    assert f"{path}:7: missing prompt key 'prompt'" in message


def test_messages_without_chat_template_are_bad_rows(tmp_path, tokenizer):
    path = _write_lines(tmp_path / "d.jsonl",
                        [json.dumps({"prompt": [{"role": "user", "content": "1"}], "answer": "1"})])
    with pytest.raises(DataLoadError, match="need a tokenizer with a chat template"):
        load_prompt_dataset(path, tokenizer, DataConfig())


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_file_is_a_clear_error(tmp_path, tokenizer, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataLoadError, match=r"empty\.jsonl: dataset is empty"):
        load_prompt_dataset(path, tokenizer, DataConfig())


def test_all_prompts_too_long_is_a_clear_error(tmp_path, tokenizer):
    path = _write_lines(tmp_path / "d.jsonl", _rows(3))
    with pytest.raises(DataLoadError, match="no usable prompts.*3 longer than"):
        load_prompt_dataset(path, tokenizer, replace(DataConfig(), max_prompt_tokens=1))


def test_missing_file_and_unknown_format(tmp_path, tokenizer):
    with pytest.raises(DataLoadError, match="not found"):
        load_prompt_dataset(tmp_path / "nope.jsonl", tokenizer, DataConfig())
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataLoadError, match="unsupported dataset format '.csv'"):
        load_prompt_dataset(csv, tokenizer, DataConfig())


def test_binary_file_is_refused_naming_it(tmp_path, tokenizer):
    binary = tmp_path / "train.jsonl"
    binary.write_bytes(b"PAR1\x00\x15\x04" + bytes(range(256)))
    with pytest.raises(DataLoadError, match=r"train\.jsonl: binary data, not JSON Lines text "
                                            r"\(it starts like a Parquet file\)"):
        load_prompt_dataset(binary, tokenizer, DataConfig())
    with pytest.raises(DataLoadError, match="is a directory"):
        load_prompt_dataset(tmp_path, tokenizer, DataConfig())


def test_lines_that_are_not_utf8_are_bad_rows_with_their_line(tmp_path, tokenizer, caplog):
    path = tmp_path / "d.jsonl"
    rows = [line.encode() for line in _rows(199)]
    path.write_bytes(b"\n".join(rows[:5] + [b'{"prompt": "\xff\xfe", "answer": "1"}'] + rows[5:])
                     + b"\n")
    data = load_prompt_dataset(path, tokenizer, DataConfig())
    assert len(data) == 199 and data.stats.num_bad == 1
    assert f"{path}:6: not UTF-8 text (byte 0xff at column 13)" in caplog.text
