"""The faults: kills, signals, two jobs, damaged checkpoints, torn files and full disks.

Each fault runs the tiny trainer (``Workspace.overrides``: 2 SFT + 4 RL steps, a checkpoint
every step) as a subprocess, does its damage, reruns when the fault calls for it, and checks the
outcome a user needs: the exit code, a line that says what happened, and no lost or mixed data
(a resumed run must end with exactly the metrics and exported weights of an uninterrupted one).
Full disks are real: a tmpfs in a private mount namespace (``harness.in_tmpfs``), remounted
larger for the rerun. Every function returns one :class:`harness.Result`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Callable, List, Optional

from tools.reliability import harness
from tools.reliability.harness import Result, Workspace

FAULTS: List[Callable[[Workspace], Result]] = []
BYPASS_SPACE_CHECK = ("import gspo_megatron.learner.checkpoint_write as w, "
                      "gspo_megatron.checkpoint.export as e\n"
                      "w.check_free_space = e.check_free_space = lambda *a, **k: None")


def fault(name: str, how: str):
    def register(fn):
        def wrapped(ws: Workspace) -> Result:
            start = time.monotonic()
            d = ws.fresh_dir(name)
            try:
                codes, line, problem = fn(ws, d)
            except Exception as exc:  # a broken fault must show up in the table, not vanish
                codes, line, problem = "-", "", f"fault script failed: {exc!r}"
            return Result("fault", name, how, codes, line, ok=not problem,
                          verdict=problem or "handled", seconds=time.monotonic() - start)
        wrapped.__name__ = fn.__name__
        wrapped.name = name
        FAULTS.append(wrapped)
        return wrapped
    return register


# ---- helpers ----------------------------------------------------------------------------------

def reference(ws: Workspace) -> Path:
    """An uninterrupted run with the standard overrides (made once)."""
    ref = ws.root / "reference" / "run"
    with harness.BUILD_ONCE:  # faults run in threads; one of them makes it
        if (ref / "hf_export").is_dir():
            return ref
        shutil.rmtree(ref.parent, ignore_errors=True)
        ref.parent.mkdir(parents=True)
        code = harness.run(harness.train_command(ws.overrides(ref)), ref.parent / "train.log")
        if code != 0:
            raise RuntimeError(f"reference run failed ({code}); see {ref.parent}/train.log")
        return ref


def copy_of_reference(ws: Workspace, d: Path) -> Path:
    run_dir = d / "run"
    shutil.copytree(reference(ws), run_dir)
    return run_dir


def same_as_reference(ws: Workspace, run_dir: Path) -> Optional[str]:
    """None when metrics and exported weights equal the uninterrupted run's, else why not."""
    ref = reference(ws)
    if harness.metrics_steps(run_dir) != harness.metrics_steps(ref):
        return f"metrics steps {harness.metrics_steps(run_dir)} != {harness.metrics_steps(ref)}"
    if harness.comparable_metrics(run_dir) != harness.comparable_metrics(ref):
        return "metrics differ from the uninterrupted run"
    for f in sorted((ref / "hf_export").glob("*.safetensors")):
        other = run_dir / "hf_export" / f.name
        if not other.is_file() or other.read_bytes() != f.read_bytes():
            return f"exported {f.name} differs from the uninterrupted run"
    return None


def train(ws: Workspace, d: Path, run_dir: Path, *extra: str, flags=(), log="train.log",
          env=None) -> int:
    return harness.run(harness.train_command(ws.overrides(run_dir, *extra), *flags), d / log,
                       env=env)


def spawn_train(ws: Workspace, d: Path, run_dir: Path, *extra: str, log="train.log", env=None):
    return harness.spawn(harness.train_command(ws.overrides(run_dir, *extra)), d / log, env)


def complete(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()


def first_problem(*checks) -> Optional[str]:
    return next((msg for ok, msg in checks if not ok), None)


def no_traceback(d: Path) -> tuple:
    logs = [p.name for p in d.glob("*.log") if harness.has_traceback(p)]
    return not logs, f"Python traceback in {', '.join(logs)}"


def killed_then_resumed(ws: Workspace, d: Path, ready: Callable[[Path], bool], sig=signal.SIGKILL,
                        expect_code=None, extra=(), line_pattern="resuming from|resumed from"):
    run_dir = d / "run"
    proc = spawn_train(ws, d, run_dir, *extra)
    if not harness.wait_until(lambda: ready(run_dir), proc, poll_s=0.01):
        return "-", "", f"the fault point was never reached (exit {proc.poll()})"
    proc.send_signal(sig)
    first = proc.wait(timeout=300)
    second = train(ws, d, run_dir, *extra, log="rerun.log")
    problem = first_problem(
        (expect_code is None or first == expect_code, f"first run exited {first}, expected {expect_code}"),
        (second == 0, f"rerun exited {second}"), no_traceback(d))
    problem = problem or same_as_reference(ws, run_dir)
    line = harness.find_line(d / "rerun.log", line_pattern) or harness.find_line(d / "train.log", line_pattern)
    return f"{first} then {second}", line, problem


# ---- kills and signals --------------------------------------------------------------------------

@fault("SIGKILL after a checkpoint, rerun", "kill -9 once step_000002 is complete; rerun")
def sigkill_mid_run(ws, d):
    return killed_then_resumed(ws, d, lambda r: complete(r, 2))


@fault("SIGKILL during a checkpoint write", "keep_last=1; kill -9 while step_000003.partial is being "
       "written; rerun")
def sigkill_during_checkpoint(ws, d):
    return killed_then_resumed(ws, d, lambda r: (r / "checkpoints" / "step_000003.partial").exists(),
                               extra=("checkpoint.keep_last=1",),
                               line_pattern="left over by an interrupted write|resuming from")


@fault("SIGKILL before the first checkpoint", "save_every_steps=3; kill -9 once metrics.jsonl has "
       "step 2; rerun (fresh start, no duplicate steps)")
def sigkill_before_first_checkpoint(ws, d):
    return killed_then_resumed(ws, d, lambda r: 2 in harness.metrics_steps(r),
                               extra=("checkpoint.save_every_steps=3",),
                               line_pattern="dropped \\d+ rows past a fresh start")


@fault("SIGUSR1 (Slurm time limit) mid-run", "kill -USR1 once metrics.jsonl has step 2; rerun")
def sigusr1_mid_run(ws, d):
    return killed_then_resumed(ws, d, lambda r: 2 in harness.metrics_steps(r), sig=signal.SIGUSR1,
                               expect_code=124, line_pattern="exiting 124 for requeue")


@fault("SIGTERM (Slurm preemption) mid-run", "kill -TERM once metrics.jsonl has step 1; rerun")
def sigterm_mid_run(ws, d):
    return killed_then_resumed(ws, d, lambda r: 1 in harness.metrics_steps(r), sig=signal.SIGTERM,
                               expect_code=124, line_pattern="exiting 124 for requeue")


@fault("SIGUSR1 during start-up", "kill -USR1 0.5 s after launch (still importing)")
def sigusr1_at_start(ws, d):
    run_dir = d / "run"
    proc = spawn_train(ws, d, run_dir)
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)
    code = proc.wait(timeout=300)
    written = harness.snapshot(run_dir)
    problem = first_problem((code == 124, f"exit {code}, expected 124 (requeue)"),
                            (not written, f"wrote {sorted(written)}"), no_traceback(d))
    return str(code), harness.find_line(d / "train.log", "SIGUSR1"), problem


def _descendants(pid: int) -> List[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@fault("SIGKILL leaves no process behind", "wandb offline on; kill -9 while checkpoint writer "
       "processes run (or after step 2); look for survivors 5 s later")
def sigkill_orphans(ws, d):
    run_dir = d / "run"
    env = dict(harness.python_env(), WANDB_MODE="offline")
    proc = spawn_train(ws, d, run_dir, "logging.wandb.enabled=true", env=env)
    seen = set()

    def writers_running() -> bool:
        seen.update(_descendants(proc.pid))
        forks = [p for p in seen if _alive(p) and "cli.train" in _cmdline(p)]
        return bool(forks) or complete(run_dir, 2)

    harness.wait_until(writers_running, proc, poll_s=0.005)
    seen.update(_descendants(proc.pid))
    proc.kill()
    proc.wait()
    time.sleep(5)
    alive = sorted(p for p in seen if _alive(p))
    line = f"{len(seen)} child processes seen, {len(alive)} alive 5 s after SIGKILL"
    problem = first_problem((bool(seen), "no child process was observed"),
                            (not alive, f"survivors: {alive}"))
    for pid in alive:  # ours: started by the trainer this function started
        os.kill(pid, signal.SIGKILL)
    return "-9", line, problem


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# ---- one run directory, one job -----------------------------------------------------------------

@fault("Two jobs in one run directory", "start a second identical job while the first holds the "
       "run directory (the first is paused meanwhile)")
def two_jobs(ws, d):
    run_dir = d / "run"
    first = spawn_train(ws, d, run_dir)
    if not harness.wait_until(lambda: (run_dir / "run.lock").exists(), first, poll_s=0.01):
        return "-", "", "the first job never took the lock"
    first.send_signal(signal.SIGSTOP)  # keep it mid-run, however slow the second one starts
    try:
        second = train(ws, d, run_dir, log="second.log")
    finally:
        first.send_signal(signal.SIGCONT)
    code = first.wait(timeout=600)
    line = harness.find_line(d / "second.log", "run directory is in use")
    problem = first_problem((second == 2, f"second job exited {second}, expected 2"),
                            (f"PID {first.pid}" in line, "the holder is not named"),
                            (code == 0, f"first job exited {code}"), no_traceback(d))
    return f"{code} and {second}", line, problem or same_as_reference(ws, run_dir)


def _stale_lock(ws, d, holder: dict, env_extra: dict):
    run_dir = d / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text(json.dumps(holder))
    code = train(ws, d, run_dir, env=dict(harness.python_env(), **env_extra))
    line = harness.find_line(d / "train.log", "took over the stale lock")
    problem = first_problem((code == 0, f"exit {code}"), (bool(line), "no takeover logged"),
                            no_traceback(d))
    return str(code), line, problem


@fault("Stale lock of a killed job", "run.lock left by a dead PID on this host")
def stale_lock_dead_pid(ws, d):
    proc = harness.spawn(["true"], d / "dead.log")
    proc.wait()
    holder = {"host": socket.gethostname(), "pid": proc.pid, "slurm_job_id": None,
              "started": "earlier"}
    return _stale_lock(ws, d, holder, {})


@fault("Stale lock after a Slurm requeue", "run.lock of this Slurm job id, written on another node")
def stale_lock_requeue(ws, d):
    holder = {"host": "node-0042", "pid": 4242, "slurm_job_id": "31337", "started": "earlier"}
    return _stale_lock(ws, d, holder, {"SLURM_JOB_ID": "31337"})


# ---- damaged checkpoints --------------------------------------------------------------------------

def _damaged_newest(ws, d, damage: Callable[[Path], None], flags=(), expect=0,
                    pattern="skipping damaged checkpoint"):
    run_dir = copy_of_reference(ws, d)
    damage(run_dir / "checkpoints" / "step_000004")
    code = train(ws, d, run_dir, flags=flags)
    line = harness.find_line(d / "train.log", pattern)
    problem = first_problem((code == expect, f"exit {code}, expected {expect}"),
                            (bool(line), f"no line matching {pattern!r}"), no_traceback(d))
    if expect == 0 and not problem:
        problem = same_as_reference(ws, run_dir) or first_problem(
            (complete(run_dir, 4), "step_000004 was not rewritten complete"))
    return str(code), line, problem


@fault("Newest checkpoint lost a .distcp shard", "rm step_000004/__0_0.distcp; rerun")
def damaged_distcp(ws, d):
    return _damaged_newest(ws, d, lambda s: (s / "__0_0.distcp").unlink())


@fault("Newest checkpoint lost common.pt", "rm step_000004/common.pt; rerun")
def damaged_common(ws, d):
    return _damaged_newest(ws, d, lambda s: (s / "common.pt").unlink())


@fault("Newest checkpoint truncated", "truncate step_000004/__0_1.distcp to half; rerun")
def damaged_truncated(ws, d):
    def truncate(s: Path) -> None:
        f = s / "__0_1.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return _damaged_newest(ws, d, truncate)


@fault("Newest checkpoint without its manifest", "rm step_000004/manifest.json (a write that never "
       "finished); rerun")
def damaged_manifest(ws, d):
    return _damaged_newest(ws, d, lambda s: (s / "manifest.json").unlink())


@fault("Every checkpoint damaged, --resume", "rm manifest.json of step 3 and 4; rerun --resume")
def all_damaged(ws, d):
    def damage(s: Path) -> None:
        (s / "manifest.json").unlink()
        (s.parent / "step_000003" / "manifest.json").unlink()
    return _damaged_newest(ws, d, damage, flags=("--resume",), expect=2,
                           pattern="no complete checkpoint")


@fault("Final rename of a checkpoint interrupted", "mv step_000004 step_000004.partial (complete); "
       "rerun")
def interrupted_rename(ws, d):
    def rename(s: Path) -> None:
        s.rename(s.with_name(s.name + ".partial"))
    return _damaged_newest(ws, d, rename, pattern="into place")


@fault("Torn last line in metrics.jsonl", "rm step_000004; append half a row to metrics.jsonl; rerun")
def torn_metrics(ws, d):
    def tear(s: Path) -> None:
        shutil.rmtree(s)
        with open(s.parent.parent / "metrics.jsonl", "a") as f:
            f.write('{"step": 5, "reward/me')
    return _damaged_newest(ws, d, tear, pattern="dropping a torn last line")


# ---- full disks -------------------------------------------------------------------------------------

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


@fault("Disk full during the final HF export", "3.75 MB tmpfs, checkpoint at the end only: the "
       "checkpoint fits, the export does not; then 64 MB and rerun")
def disk_full_export(ws, d):
    return _disk_full(ws, d, "3840k", "not enough space for Hugging Face export",
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
        cmd = harness.shell([harness.sys.executable, "-c", code, *argv[1:]])
    else:
        cmd = harness.shell([harness.sys.executable, "-m", *argv])
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


@fault("gspo-convert onto a full disk", "--out on a 1 MB tmpfs (the checkpoint is ~0.6 MB + margin)")
def convert_disk_full(ws, d):
    return _tool_on_full_disk(ws, d, ["gspo_megatron.cli.convert", "--hf-dir", str(ws.model_dir),
                                      "--out", str(d / "mnt" / "ckpt")], "not enough space")


@fault("gspo-export onto a full disk", "--out on a 1 MB tmpfs")
def export_disk_full(ws, d):
    return _tool_on_full_disk(ws, d, ["gspo_megatron.cli.export", "--ckpt",
                                      str(ws.converted_checkpoint()), "--out",
                                      str(d / "mnt" / "hf")], "not enough space")


@fault("gspo-export, disk fills mid-write", "free-space check bypassed; --out on a 256 KB tmpfs "
       "(the export is ~0.5 MB), --max-shard-size 100KB")
def export_enospc(ws, d):
    return _tool_on_full_disk(ws, d, ["gspo_megatron.cli.export", "--ckpt",
                                      str(ws.converted_checkpoint()), "--out",
                                      str(d / "mnt" / "hf"), "--max-shard-size", "100KB"],
                              "no space left on", inject=True, size="256k")
