"""The three checkpoint tools: flags parse into a layout, ``--help`` works from a checkout, and bad
input exits with code 2 and one line naming the file."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.checkpoint import launch

ROOT = Path(__file__).resolve().parents[1]


def test_parallel_flags_become_a_layout():
    parser = argparse.ArgumentParser()
    launch.add_parallel_args(parser)
    p = launch.parallel_from_args(parser.parse_args(["--tp", "2", "--ep", "4", "--pp", "2"]))
    assert (p.tp, p.pp, p.ep, p.etp, p.vpp, p.sp) == (2, 2, 4, 1, None, True)
    p = launch.parallel_from_args(parser.parse_args([]))
    assert (p.tp, p.sp) == (1, False)


@pytest.mark.parametrize("tool", ["convert_hf_to_megatron", "export_megatron_to_hf", "reshard"])
def test_tool_help(tool):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--out" in out.stdout and "--tp" in out.stdout


@pytest.mark.slow
def test_convert_tool_exits_2_naming_the_file_and_key(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 1}')
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py"),
                          "--hf-dir", str(hf), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "config.json: missing key 'num_attention_heads'" in out.stderr
    assert not (tmp_path / "out").exists()
