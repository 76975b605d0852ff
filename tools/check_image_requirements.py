"""Check the GPU image's pinned Python requirements the way the image build meets them: on top of
SGLang's release image, for CPython 3.12 / manylinux x86_64; and check that they form one stack.

    python tools/check_image_requirements.py [--requirements requirements-gpu.txt] [--report out.json]
                                             [--base-lock out.txt]

Needs only the package index (no GPU, no container registry, no Docker). Three steps:

1. **The base.** ``lmsysorg/sglang:v0.5.23`` holds ``sglang==0.5.23`` and its dependencies as they
   resolved when the image was published. A pinned ``uv`` (``UV_SPEC``, fetched into a temporary
   folder) models that set: ``uv pip compile`` of ``BASE_REQUIREMENT`` for Python 3.12 /
   ``x86_64-manylinux_2_34`` with ``--exclude-newer BASE_IMAGE_DATE`` (nothing uploaded after the
   image). The sglang 0.5.23 wheels were uploaded on 2026-10-30 01:34 UTC.
2. **No pin on what the base decides.** The Dockerfile installs the file with the base's
   ``pip list --format=freeze`` as constraints, so a pin of a package the base holds is either
   redundant or, at another version, ResolutionImpossible at the image's first ``RUN``. Every such
   pin is reported, naming the base's version; nothing else runs until there are none.
3. **The image's resolution.** A pinned modern pip (``PIP_SPEC``; pip >= 24 answers ``--dry-run``
   from the index's metadata files, and ``--use-feature=fast-deps`` reads a wheel's metadata
   with HTTP range requests where the index has no metadata file: PyPI has none for
   ``nvidia-cudnn-cu13`` 9.24.0.43, whose whole 553 MB wheel pip fetched otherwise, and a cut
   download failed the check) runs ``pip install --dry-run
   --report --only-binary=:all: --python-version 3.12 --platform manylinux_2_17..2_35_x86_64
   -c BASE_LOCK -r FILE BASE_REQUIREMENT``: the same constraints the Dockerfile applies, with this
   machine's pip configuration ignored. The report's metadata then has to show:

   - exactly one torch, at the version sglang pins (its ``Requires-Dist: torch==``);
   - exactly one NCCL wheel, the one torch requires (an ``nvidia-nccl-cu12`` next to ``-cu13``
     would be two NCCLs, which cannot form the weight-update group);
   - transformer-engine and its core wheel at one version, inside megatron-core's tested range
     (its ``dev`` extra), built for torch's CUDA major;
   - every pin of the file resolved to itself (nothing floats);
   - transformer-engine-torch (an sdist, built in the image) published at that version.

Exit codes: 0 consistent, 1 a check failed or a resolver could not resolve (its message is
printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
PIP_SPEC = "pip==26.3"
UV_SPEC = "uv==0.13.9"
PYTHON_VERSION = "3.12"
BASE_REQUIREMENT = "sglang==0.5.23"
"""What the base image is built around (``ARG SGLANG_IMAGE`` in the Dockerfile)."""
BASE_IMAGE_DATE = "2026-10-31"
"""``--exclude-newer`` for the base: the day after the sglang 0.5.23 wheels' upload."""
UV_PLATFORM = "x86_64-manylinux_2_34"
MAX_GLIBC_MINOR = 35  # Ubuntu 22.04's glibc; the SGLang images are at least that new


def platforms(max_glibc_minor: int = MAX_GLIBC_MINOR) -> List[str]:
    """``--platform`` values: pip does not widen a PEP 600 tag to older glibc versions itself."""
    return ["manylinux2014_x86_64"] + [f"manylinux_2_{m}_x86_64" for m in range(17, max_glibc_minor + 1)]


def clean_pip_env() -> Dict[str, str]:
    """Our environment without pip settings (this machine's constraints and local wheel folders
    must not shape the answer); the index URL, certificates and proxies are kept."""
    keep = {"PIP_INDEX_URL", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_TRUSTED_HOST"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _download(spec: str, folder: Path) -> Path:
    """Download the wheel of ``spec`` into ``folder`` (with the caller's own pip and settings)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "-d", str(folder), spec], capture_output=True, text=True)
    wheels = sorted(folder.glob(spec.split("==")[0] + "-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {spec}: {proc.stderr.strip()[-2000:]}")
    return wheels[0]


def fetch_pip(folder: Path) -> Path:
    """The pinned pip wheel (run from the wheel file itself)."""
    return _download(PIP_SPEC, folder)


def fetch_uv(folder: Path) -> Path:
    """Download the pinned uv wheel into ``folder`` and return its executable."""
    wheel_path = _download(UV_SPEC, folder)
    with zipfile.ZipFile(wheel_path) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(".data/scripts/uv")), None)
        if member is None:
            raise RuntimeError(f"{wheel_path.name} holds no uv executable")
        binary = Path(wheel.extract(member, folder / "uv"))
    binary.chmod(0o755)
    return binary


def resolve_base(uv: Path, workdir: Path) -> Path:
    """The base image's package set as a lock file (``name==version`` lines), modelled by uv."""
    request = workdir / "base.in"
    request.write_text(BASE_REQUIREMENT + "\n")
    lock = workdir / "base-lock.txt"
    cmd = [str(uv), "pip", "compile", str(request), "--python-version", PYTHON_VERSION,
           "--python-platform", UV_PLATFORM, "--exclude-newer", BASE_IMAGE_DATE, "--no-config",
           "--no-header", "--no-annotate", "--quiet", "-o", str(lock)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"uv could not resolve the base image's set ({BASE_REQUIREMENT} as of "
                           f"{BASE_IMAGE_DATE}):\n{proc.stderr.strip()[-4000:]}")
    return lock


def read_lock(lock: Path) -> Dict[str, str]:
    """``name -> version`` of a lock file's ``name==version`` lines."""
    out = {}
    for raw in lock.read_text().splitlines():
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name.split("[", 1)[0])] = version.strip()
    return out


def pins_the_base_decides(pins: Dict[str, str], base: Dict[str, str]) -> List[str]:
    """One problem for each pin of a package the base image already holds, contradictions first."""
    where = f"the base image ({BASE_REQUIREMENT} as of {BASE_IMAGE_DATE})"
    contradictions, redundant = [], []
    for name, version in sorted(pins.items()):
        held = base.get(name)
        if held is None:
            continue
        if Version(held) != Version(version):
            contradictions.append(f"{name}=={version} contradicts {where}, which holds "
                                  f"{name}=={held}: the image build fails (ResolutionImpossible); "
                                  f"remove the pin, the base decides it")
        else:
            redundant.append(f"{name}=={version} is already in {where}: remove the pin, so that the "
                             f"base alone decides it")
    return contradictions + redundant


def resolve(requirements: Path, pip_wheel: Path, workdir: Path, base_lock: Optional[Path] = None) -> dict:
    """The ``--report`` of a dry-run install of ``requirements`` (and the base's own requirement,
    constrained by its lock, as the Dockerfile does) for the image's Python."""
    report = workdir / "report.json"
    cmd = [sys.executable, str(pip_wheel / "pip"), "install", "--dry-run", "--quiet", "--ignore-installed",
           "--report", str(report), "--use-feature=fast-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION,
           "--implementation", "cp", "--abi", "cp" + PYTHON_VERSION.replace(".", ""),
           *[f"--platform={p}" for p in platforms()], "--target", str(workdir / "target"),
           "-r", str(requirements)]
    if base_lock is not None:
        cmd += ["-c", str(base_lock), BASE_REQUIREMENT]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_pip_env())
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not resolve {requirements.name} on the base image's set for "
                           f"CPython {PYTHON_VERSION} manylinux x86_64:\n{proc.stderr.strip()[-4000:]}")
    return json.loads(report.read_text())


def published_versions(pip_wheel: Path, name: str) -> List[str]:
    """Versions of ``name`` on the index, any file type (``pip index versions``)."""
    proc = subprocess.run([sys.executable, str(pip_wheel / "pip"), "index", "versions", name],
                          capture_output=True, text=True, env=clean_pip_env())
    match = re.search(r"Available versions: (.*)", proc.stdout)
    return [v.strip() for v in match.group(1).split(",")] if match else []


def read_pins(requirements: Path) -> Dict[str, str]:
    """``name -> version`` of every ``name==version`` line (comments allowed)."""
    pins = {}
    for raw in requirements.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            raise ValueError(f"{requirements}: '{line}' is not pinned with ==")
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


class Resolved:
    """The report's packages by canonical name: version and requirements."""

    def __init__(self, report: dict) -> None:
        self.meta = {canonicalize_name(item["metadata"]["name"]): item["metadata"]
                     for item in report["install"]}

    def version(self, name: str) -> Optional[str]:
        meta = self.meta.get(canonicalize_name(name))
        return meta["version"] if meta else None

    def requires(self, name: str, extra: Optional[str] = None) -> List[Requirement]:
        """Requirements of ``name`` that apply on Linux x86_64 (and in ``extra`` when given)."""
        env = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
               "python_version": PYTHON_VERSION, "extra": extra or ""}
        out = []
        for text in self.meta[canonicalize_name(name)].get("requires_dist", []):
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                if extra is None or (req.marker is not None and "extra" in str(req.marker)):
                    out.append(req)
        return out

    def names(self, pattern: str) -> List[str]:
        return sorted(n for n in self.meta if re.fullmatch(pattern, n))


def check_stack(resolved: Resolved, pins: Dict[str, str], te_torch_versions: Sequence[str]) -> List[str]:
    """Every inconsistency found (empty when the stack is one)."""
    problems: List[str] = []
    for name, version in pins.items():
        got = resolved.version(name)
        if got is None or Version(got) != Version(version):
            problems.append(f"{name}: pinned {version}, resolved {got}")
    torch = resolved.version("torch")
    wanted = [r for r in resolved.requires("sglang") if canonicalize_name(r.name) == "torch"]
    if not wanted or torch is None or not wanted[0].specifier.contains(torch):
        problems.append(f"torch {torch} is not the torch sglang {resolved.version('sglang')} requires "
                        f"({[str(r) for r in wanted]})")
    nccl = resolved.names(r"nvidia-nccl-cu\d+")
    torch_nccl = [canonicalize_name(r.name) for r in resolved.requires("torch") if "nccl" in r.name]
    if len(nccl) != 1 or nccl != torch_nccl:
        problems.append(f"NCCL wheels {nccl}; torch requires {torch_nccl}: there must be exactly that one")
    cuda_major = next((n.rsplit("cu", 1)[1] for n in torch_nccl), None)
    te = resolved.version("transformer-engine")
    te_core = resolved.names(r"transformer-engine-cu\d+")
    if te is None or te_core != [f"transformer-engine-cu{cuda_major}"] or resolved.version(te_core[0]) != te:
        problems.append(f"transformer-engine {te} needs its core wheel transformer-engine-cu{cuda_major} "
                        f"at the same version (torch is CUDA {cuda_major}); resolved {te_core}")
    te_range = [r for r in resolved.requires("megatron-core", extra="dev")
                if canonicalize_name(r.name) == "transformer-engine"]
    if te is not None and (not te_range or not te_range[0].specifier.contains(te, prereleases=True)):
        problems.append(f"transformer-engine {te} is outside megatron-core "
                        f"{resolved.version('megatron-core')}'s tested range "
                        f"{[str(r.specifier) for r in te_range]}")
    if te is not None and te not in te_torch_versions:
        problems.append(f"transformer-engine-torch {te} (the sdist the image builds) is not on the index")
    return problems


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requirements", type=Path, default=REPO / "requirements-gpu.txt")
    parser.add_argument("--report", type=Path, help="also write pip's report here")
    parser.add_argument("--base-lock", type=Path, help="also write the modelled base image's set here")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        pins = read_pins(args.requirements)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gspo-image-check-") as tmp:
        try:
            lock = resolve_base(fetch_uv(Path(tmp)), Path(tmp))
            base = read_lock(lock)
            if args.base_lock:
                args.base_lock.write_text(lock.read_text())
            print(f"base image modelled: {len(base)} packages ({BASE_REQUIREMENT} as of {BASE_IMAGE_DATE}, "
                  f"CPython {PYTHON_VERSION} {UV_PLATFORM}, {UV_SPEC})")
            clashes = pins_the_base_decides(pins, base)
            if clashes:
                for problem in clashes:
                    print(f"FAILED: {args.requirements.name}: {problem}", file=sys.stderr)
                return 1
            pip_wheel = fetch_pip(Path(tmp))
            report = resolve(args.requirements, pip_wheel, Path(tmp), base_lock=lock)
            te_torch = published_versions(pip_wheel, "transformer-engine-torch")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    resolved = Resolved(report)
    problems = check_stack(resolved, pins, te_torch)
    print(f"resolved {len(resolved.meta)} packages for CPython {PYTHON_VERSION} manylinux x86_64 "
          f"(pip {report.get('pip_version')}), the base's set as constraints")
    for name in ("sglang", "torch", "nvidia-nccl-cu13", "megatron-core", "transformer-engine",
                 "transformer-engine-cu13", "transformers", "numpy"):
        print(f"  {name:<24} {resolved.version(name)}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
