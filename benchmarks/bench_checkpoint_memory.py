#!/usr/bin/env python
"""Peak owned memory, wall time and bit-exactness of the checkpoint tools at real widths.

Writes a Qwen3-30B-A3B (or -235B-A22B) checkpoint at the hub's widths with 1 layer (2 for the
pipeline layout) with ``tools/make_qwen3_assets.py``, then for every layout converts it
(``tools/convert_hf_to_megatron.py``), exports the result (``tools/export_megatron_to_hf.py``)
and compares every tensor, config.json, generation_config.json and the tokenizer files with the
source, byte for byte; two checkpoints are also resharded to another layout
(``tools/reshard.py``) and exported from there. Each tool runs in fresh processes (torchrun, one
process per rank) under :func:`owned_memory.run_measured`: the peak of RssAnon + RssShmem summed
over the tool's process tree, sampled every 0.1 s. ``ratio`` is that peak over the HF
checkpoint's tensor bytes.

``--before-repo DIR`` also runs convert and export of ``--before-layouts`` from another checkout
(e.g. ``git worktree add /tmp/before <commit>``), for a before/after table measured under the
same conditions. Before each tool the benchmark waits until ``--need-gib`` of memory is
available (the machine may be shared). ``--doc`` replaces the geometry's section of that file
(between its :func:`markers`) with the command, the conditions and the table.

    python benchmarks/bench_checkpoint_memory.py --geometry 30b --work /tmp/ckpt_mem \
        --before-repo /tmp/before --doc docs/checkpoints.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.owned_memory import run_measured  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def markers(geometry: str) -> Tuple[str, str]:
    """The doc section of one geometry is between these lines."""
    return (f"<!-- bench_checkpoint_memory {geometry}: begin (written by the benchmark; do not "
            "edit) -->", f"<!-- bench_checkpoint_memory {geometry}: end -->")


LAYOUTS: Dict[str, Tuple[List[str], int, int]] = {
    # name: (tool flags, processes, layers of the model it runs on)
    "tp1": ([], 1, 1),
    "tp2": (["--tp", "2"], 2, 1),
    "ep2": (["--ep", "2"], 2, 1),
    "tp2ep2": (["--tp", "2", "--ep", "2"], 2, 1),
    "pp2": (["--pp", "2"], 2, 2),
}
RESHARDS = [("tp2ep2", "tp1"), ("pp2", "tp2ep2")]
"""(source layout, target layout): the source's checkpoint re-saved under the target."""
COMPARED_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json")


@dataclass
class Row:
    """One tool run."""

    code: str
    """``after`` (this checkout) or ``before`` (``--before-repo``)."""
    layout: str
    tool: str
    ckpt_gib: float
    peak_gib: float
    wall_s: float
    tensors_exact: Optional[bool] = None
    """Every tensor of the export bit-identical to the source's (convert / reshard rows: of the
    export of the checkpoint they wrote)."""
    files_identical: Optional[bool] = None
    """config.json, generation_config.json and the tokenizer files byte-identical."""

    @property
    def ratio(self) -> float:
        return self.peak_gib / self.ckpt_gib


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(need_gib: float, patience_s: float) -> None:
    """Block until ``need_gib`` is available (another job may be running), or give up."""
    deadline = time.monotonic() + patience_s
    while available_gib() < need_gib:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {available_gib():.1f} GiB available, {need_gib} needed")
        time.sleep(10)


def tool_command(repo: Path, tool: str, layout: str, args: List[str]) -> List[str]:
    flags, nproc, _ = LAYOUTS[layout]
    script = [str(repo / "tools" / f"{tool}.py"), *args, *flags]
    if nproc == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *script]


def run_tool(repo: Path, tool: str, layout: str, args: List[str], opts) -> Tuple[float, float]:
    """(peak owned GiB, wall s) of one tool run; exits with its output if it fails."""
    wait_for_memory(opts.need_gib, opts.patience_s)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    result = run_measured(tool_command(repo, tool, layout, args), env=env, cwd=str(repo),
                          timeout_s=opts.timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"{tool} {layout} failed ({result.returncode}):\n{result.output[-4000:]}")
    print(f"  {tool:<24} {layout:<8} peak {result.peak_bytes / GIB:6.2f} GiB  "
          f"{result.wall_s:6.1f} s  {dict(list(result.peak_by_name.items())[:3])}", flush=True)
    return result.peak_bytes / GIB, result.wall_s


def same_checkpoint(source: Path, exported: Path) -> Tuple[bool, bool]:
    """(every tensor identical in dtype, shape and bytes, read one at a time; the compared files
    byte-identical)."""
    import torch
    from safetensors import safe_open

    index = "model.safetensors.index.json"
    a = json.loads((source / index).read_text())["weight_map"]
    b = json.loads((exported / index).read_text())["weight_map"]
    if set(a) != set(b):
        print(f"  tensor names differ: {sorted(set(a) ^ set(b))[:5]}")
        return False, False
    for name in sorted(a):
        with safe_open(str(source / a[name]), "pt") as fa:
            x = fa.get_tensor(name)
        with safe_open(str(exported / b[name]), "pt") as fb:
            y = fb.get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            print(f"  tensor {name} differs")
            return False, False
    files = [f for f in COMPARED_FILES if (source / f).is_file()]
    differ = [f for f in files if (source / f).read_bytes() != (exported / f).read_bytes()]
    if differ or not files:
        print(f"  files differ: {differ or 'none compared'}")
    return True, not differ and bool(files)


def make_source(work: Path, geometry: str, num_layers: int) -> Path:
    out = work / f"src_{geometry}_l{num_layers}"
    if not (out / "model").is_dir():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_qwen3_assets.py"), str(out),
                        "--geometry", geometry, "--num-layers", str(num_layers), "--overwrite"],
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return out / "model"


def tensor_gib(hf_dir: Path) -> float:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    return index["metadata"]["total_size"] / GIB


def round_trip(code: str, repo: Path, layout: str, src: Path, work: Path, opts) -> List[Row]:
    """Convert at ``layout``, export at ``layout``, compare; rows for both tools."""
    size = tensor_gib(src)
    ckpt, out = work / f"{code}_{layout}_ckpt", work / f"{code}_{layout}_hf"
    peak, wall = run_tool(repo, "convert_hf_to_megatron", layout,
                          ["--hf-dir", str(src), "--out", str(ckpt), "--overwrite"], opts)
    convert = Row(code, layout, "convert", size, peak, wall)
    peak, wall = run_tool(repo, "export_megatron_to_hf", layout,
                          ["--ckpt", str(ckpt), "--out", str(out), "--overwrite"], opts)
    exact = same_checkpoint(src, out)
    shutil.rmtree(out)
    convert.tensors_exact, convert.files_identical = exact
    return [convert, Row(code, layout, "export", size, peak, wall, *exact)]


def reshard_trip(source: str, target: str, src: Path, work: Path, opts) -> List[Row]:
    """Reshard the ``after`` checkpoint of ``source`` to ``target``, export it there, compare."""
    size = tensor_gib(src)
    ckpt, out = work / f"reshard_{source}_{target}", work / f"reshard_{source}_{target}_hf"
    peak, wall = run_tool(REPO, "reshard", target, ["--ckpt", str(work / f"after_{source}_ckpt"),
                                                    "--out", str(ckpt), "--overwrite"], opts)
    reshard = Row("after", f"{source}->{target}", "reshard", size, peak, wall)
    peak, wall = run_tool(REPO, "export_megatron_to_hf", target,
                          ["--ckpt", str(ckpt), "--out", str(out), "--overwrite"], opts)
    exact = same_checkpoint(src, out)
    reshard.tensors_exact, reshard.files_identical = exact
    shutil.rmtree(out)
    shutil.rmtree(ckpt)
    return [reshard, Row("after", f"{source}->{target}", "export", size, peak, wall, *exact)]


def run_all(opts) -> List[Row]:
    work = Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    rows: List[Row] = []
    for layout in opts.layouts:
        src = make_source(work, opts.geometry, LAYOUTS[layout][2])
        print(f"{layout}: {src} ({tensor_gib(src):.2f} GiB of tensors)", flush=True)
        if opts.before_repo and layout in opts.before_layouts:
            rows += round_trip("before", Path(opts.before_repo), layout, src, work, opts)
            shutil.rmtree(work / f"before_{layout}_ckpt")
        rows += round_trip("after", REPO, layout, src, work, opts)
    for source, target in RESHARDS:  # the target's flags only: the model keeps its layers
        if source in opts.layouts:
            rows += reshard_trip(source, target, make_source(work, opts.geometry,
                                                             LAYOUTS[source][2]), work, opts)
    for layout in opts.layouts:
        shutil.rmtree(work / f"after_{layout}_ckpt", ignore_errors=True)
    return rows


def _git_commit(repo: Path) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def section(rows: List[Row], opts, conditions: Dict[str, str]) -> str:
    begin, end = markers(opts.geometry)
    lines = [begin, "", "```bash", shlex.join(["python", "benchmarks/bench_checkpoint_memory.py",
                                                *opts.argv]), "```", "",
             "Conditions: " + "; ".join(f"{k} {v}" for k, v in conditions.items()) + ".", "",
             "| code | layout | tool | checkpoint GiB | peak owned GiB | ratio | wall s | "
             "tensors bit-exact | json + tokenizer identical |", "|---" * 9 + "|"]
    word = {True: "yes", False: "**no**", None: "-"}
    for r in rows:
        lines.append(f"| {r.code} | {r.layout} | {r.tool} | {r.ckpt_gib:.2f} | "
                     f"{r.peak_gib:.2f} | {r.ratio:.2f}x | {r.wall_s:.1f} | "
                     f"{word[r.tensors_exact]} | {word[r.files_identical]} |")
    lines += ["", end]
    return "\n".join(lines)


def write_doc(path: Path, text: str, geometry: str) -> None:
    """Replace the geometry's section between its markers (``text`` carries them)."""
    begin, end = markers(geometry)
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no section marked {begin!r} ... {end!r}")
    head, rest = doc.split(begin, 1)
    path.write_text(head + text + rest.split(end, 1)[1])


def _conditions(opts, load_before: float) -> Dict[str, str]:
    import megatron.core
    import torch

    return {"date": datetime.date.today().isoformat(),
            "CPUs": str(os.cpu_count()),
            "load average (1 min) at start / end": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}",
            "geometry": f"Qwen3-{opts.geometry.upper()} real widths",
            "code": f"after = {_git_commit(REPO)}"
                    + (f", before = {opts.before_label}" if opts.before_repo else ""),
            "versions": f"torch {torch.__version__}, megatron-core {megatron.core.__version__}",
            "memory": "RssAnon + RssShmem summed over the tool's processes (torchrun and its "
                      "ranks, and any process they start), sampled every 0.1 s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=["30b", "235b"], default="30b")
    parser.add_argument("--work", default="/tmp/bench_checkpoint_memory")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--before-repo", default=None, help="another checkout to compare with")
    parser.add_argument("--before-layouts", default="tp2ep2")
    parser.add_argument("--before-label", default=None,
                        help="what --before-repo is, for the doc (default: its git commit)")
    parser.add_argument("--need-gib", type=float, default=14.0,
                        help="wait before each tool until this much memory is available")
    parser.add_argument("--patience-s", type=float, default=1800.0)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per tool run")
    parser.add_argument("--doc", default=None, help="markdown file whose marked section to replace")
    parser.add_argument("--keep", action="store_true", help="keep the source checkpoints")
    opts = parser.parse_args()
    opts.argv = sys.argv[1:]
    opts.layouts = [x for x in opts.layouts.split(",") if x]
    opts.before_layouts = [x for x in opts.before_layouts.split(",") if x]
    unknown = sorted(set(opts.layouts + opts.before_layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layouts {unknown}")
    if opts.before_repo and not opts.before_label:
        opts.before_label = _git_commit(Path(opts.before_repo))
    load_before = os.getloadavg()[0]
    rows = run_all(opts)
    (Path(opts.work) / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    text = section(rows, opts, _conditions(opts, load_before))
    print("\n" + text)
    if opts.doc:
        write_doc(Path(opts.doc), text, opts.geometry)
    if not opts.keep:
        shutil.rmtree(opts.work, ignore_errors=True)
    if not all(r.tensors_exact and r.files_identical for r in rows if r.code == "after"):
        raise SystemExit("not every round trip came back identical")


if __name__ == "__main__":
    main()
