"""Full-disk faults: a real tmpfs in a private mount namespace (``harness.in_tmpfs``) under the
trainer's run directory or a tool's output, remounted larger for the rerun. Before a checkpoint
or an export the free-space check must stop the write early (exit 4, path and both numbers); with
the check bypassed (``BYPASS_SPACE_CHECK``) the write runs into ENOSPC and must end the same way,
the partial output removed; a leftover ``.partial`` must not keep the disk full.
"""

from __future__ import annotations

import re
import sys
from typing import List

from tools.reliability import harness
from tools.reliability.fault_kit import (BYPASS_SPACE_CHECK, fault, first_problem, no_traceback,
                                         same_as_reference)


def _tmpfs_train(ws, d, size: str, overrides=(), inject="", then: str = "") -> tuple:
    """Train on a tmpfs of ``size``; then remount it at 64 MB and rerun (``then`` shell lines run
    between the two). Returns (exit codes, output, copy of the run directory after the rerun)."""
    mnt = d / "mnt"
    first = harness.shell(harness.train_command(ws.overrides(mnt / "run", *overrides), inject=inject))
    second = harness.shell(harness.train_command(ws.overrides(mnt / "run", *overrides)))
    out = harness.in_tmpfs(size, mnt, f"""
{then}
{first} > {d}/train.log 2>&1; echo "rc1=$?"
find $MNT -name '*.partial' | sed 's/^/partial: /'
ls $MNT/run/checkpoints 2>/dev/null | sed 's/^/ckpt: /'
mount -o remount,size=64m $MNT
{second} > {d}/rerun.log 2>&1; echo "rc2=$?"
cp -a $MNT/run {d}/run
""")
    codes = re.findall(r"rc\d=(\d+)", out)
    return codes, out, d / "run"


def _disk_full(ws, d, size, pattern, overrides=(), inject="", then="", partial_ok=False):
    codes, out, run_dir = _tmpfs_train(ws, d, size, overrides, inject, then)
    line = harness.find_line(d / "train.log", pattern)
    problem = first_problem((codes[:1] == ["4"], f"first run exited {codes[:1]}, expected 4"),
                            (bool(line), f"no line matching {pattern!r}"),
                            ("partial:" not in out or partial_ok, "a .partial was left behind"),
                            (codes[1:2] == ["0"], f"rerun after freeing space exited {codes[1:2]}"),
                            no_traceback(d))
    return " then ".join(codes), line, problem or same_as_reference(ws, run_dir)


@fault("Disk full before a checkpoint", "run on a 2 MB tmpfs (a checkpoint is ~2.4 MB); then 64 MB "
       "and rerun")
def disk_full_precheck(ws, d):
    return _disk_full(ws, d, "2m", "not enough space for checkpoint")


@fault("Disk fills during a checkpoint write", "free-space check bypassed; 3 MB tmpfs: the second "
       "checkpoint hits ENOSPC mid-write; then 64 MB and rerun")
def disk_full_mid_write(ws, d):
    return _disk_full(ws, d, "3m", "no space left on", inject=BYPASS_SPACE_CHECK)


@fault("Disk full during the final HF export", "2.75 MB tmpfs, checkpoint at the end only: the "
       "checkpoint (~2.4 MB) fits, the export (~0.52 MB) does not; then 64 MB and rerun")
def disk_full_export(ws, d):
    return _disk_full(ws, d, "2816k", "not enough space for Hugging Face export",
                      overrides=("checkpoint.save_every_steps=0",))


@fault("Leftover .partial keeps the disk full", "5 MB tmpfs holding a 4.5 MB step_000009.partial "
       "from a killed write; run (checkpoint at the end only)")
def leftover_partial(ws, d):
    mnt = d / "mnt"
    cmd = harness.shell(harness.train_command(ws.overrides(mnt / "run",
                                                           "checkpoint.save_every_steps=0")))
    out = harness.in_tmpfs("5m", mnt, f"""
mkdir -p $MNT/run/checkpoints/step_000009.partial
head -c 4718592 /dev/zero > $MNT/run/checkpoints/step_000009.partial/__0_0.distcp
{cmd} > {d}/train.log 2>&1; echo "rc1=$?"
cp -a $MNT/run {d}/run
""")
    codes = re.findall(r"rc\d=(\d+)", out)
    line = harness.find_line(d / "train.log", "step_000009.partial")
    problem = first_problem((codes == ["0"], f"exit {codes}"), (bool(line), "no cleanup logged"),
                            no_traceback(d))
    return " ".join(codes), line, problem or same_as_reference(ws, d / "run")


def _tool_on_full_disk(ws, d, argv: List[str], pattern: str, inject: bool = False,
                      size: str = "1m") -> tuple:
    mnt = d / "mnt"
    module = argv[0]
    if inject:
        code = f"{BYPASS_SPACE_CHECK}\nimport sys\nfrom {module} import main\nsys.exit(main())"
        cmd = harness.shell([sys.executable, "-c", code, *argv[1:]])
    else:
        cmd = harness.shell([sys.executable, "-m", *argv])
    out = harness.in_tmpfs(size, mnt, f"""
{cmd} > {d}/tool.log 2>&1; echo "rc1=$?"
find $MNT | sed 's/^/file: /'
""")
    codes = re.findall(r"rc\d=(\d+)", out)
    line = harness.find_line(d / "tool.log", pattern)
    leftovers = [ln for ln in out.splitlines() if ln.startswith("file: ") and ln != f"file: {mnt}"]
    problem = first_problem((codes == ["4"], f"exit {codes}, expected 4"),
                            (bool(line), f"no line matching {pattern!r}"),
                            (not leftovers, f"left {leftovers}"), no_traceback(d))
    return " ".join(codes), line, problem


@fault("gspo-convert onto a full disk", "--out on a 512 KB tmpfs (the checkpoint is ~0.67 MB)")
def convert_disk_full(ws, d):
    return _tool_on_full_disk(ws, d, ["gspo_megatron.cli.convert", "--hf-dir", str(ws.model_dir),
                                      "--out", str(d / "mnt" / "ckpt")], "not enough space",
                              size="512k")


@fault("gspo-export onto a full disk", "--out on a 384 KB tmpfs (the export is ~0.52 MB)")
def export_disk_full(ws, d):
    return _tool_on_full_disk(ws, d, ["gspo_megatron.cli.export", "--ckpt",
                                      str(ws.converted_checkpoint()), "--out",
                                      str(d / "mnt" / "hf")], "not enough space", size="384k")


@fault("gspo-export, disk fills mid-write", "free-space check bypassed; --out on a 256 KB tmpfs "
       "(the export is ~0.5 MB), --max-shard-size 100KB")
def export_enospc(ws, d):
    return _tool_on_full_disk(ws, d, ["gspo_megatron.cli.export", "--ckpt",
                                      str(ws.converted_checkpoint()), "--out",
                                      str(d / "mnt" / "hf"), "--max-shard-size", "100KB"],
                              "no space left on", inject=True, size="256k")
