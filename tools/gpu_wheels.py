#!/usr/bin/env python
"""Download the wheels the GPU verification kit needs on the device image into ``.whl/``.

The device machine (docs/gpu.md) has CUDA 13, PyTorch 2.11, Python 3.12 and transformers 5.x,
and no network. What the kit imports beyond that travels as wheels in ``.whl/`` (ignored by git,
named in the ``run`` tool's ``carry``; 64 MiB in all):

- megatron-core 0.16.1 and omegaconf 2.4.0: not in the image;
- transformers 4.57.6 with tokenizers 0.22.2 and huggingface-hub 0.36.2: the project's pinned
  transformers (requirements-cpu.txt). The image's transformers 5.x keeps Qwen3-MoE experts as
  fused ``mlp.experts.gate_up_proj`` tensors in memory, so the embedded engine's load-by-HF-name
  would fail there; 4.57.6 in turn refuses to import next to the image's tokenizers 0.23 and
  huggingface-hub 1.x, hence those two.

Transformer Engine is not carried: its core wheel alone is 186-277 MB (2.9.0-2.20.2, cu13) and its
PyTorch binding is a source distribution that compiles against the local torch (docs/gpu.md).

    python tools/gpu_wheels.py            # fills .whl/, removes other versions, prints sizes
    python tools/gpu_wheels.py --dest DIR
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("megatron-core==0.16.1", "omegaconf==2.4.0", "transformers==4.57.6",
          "tokenizers==0.22.2", "huggingface-hub==0.36.2")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
CARRY_LIMIT = 64 * 1024 * 1024
"""What the device tool moves per call: the working tree and every carried path together."""


def _dist_name(requirement: str) -> str:
    """Wheel file name prefix of a requirement: ``megatron-core==0.16.1`` -> ``megatron_core-``."""
    return requirement.split("==")[0].replace("-", "_").lower() + "-"


def download(dest: Path) -> list:
    """Fetch every wheel for CPython 3.12 on x86-64 Linux; returns the wheel paths."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), "-q"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + list(WHEELS), check=True)
    keep = []
    for req in WHEELS:
        name, version = _dist_name(req), req.split("==")[1]
        for wheel in dest.glob("*.whl"):
            if wheel.name.lower().startswith(name):
                if f"-{version}-" in wheel.name:
                    keep.append(wheel)
                else:  # two versions of one package stop the whole --no-index install
                    wheel.unlink()
    return sorted(keep)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", default=str(ROOT / ".whl"), help="wheel folder (default: .whl/)")
    args = p.parse_args()
    wheels = download(Path(args.dest))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total / 2**20:7.2f} MiB  total (carry limit {CARRY_LIMIT / 2**20:.0f} MiB, shared "
          "with the working tree)")
    if len(wheels) != len(WHEELS):
        print(f"expected {len(WHEELS)} wheels, found {len(wheels)}", file=sys.stderr)
        return 1
    return 0 if total < CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
