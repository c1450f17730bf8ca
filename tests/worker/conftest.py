"""Shared fixtures for engine tests: real model paths, fixture files, GGUF files opened once.

Fixture names are prefixed (``smollm2_path``, ``gemma3_path``, ...) so they do not
clash with module-level fixtures of other test files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = ROOT / "models"
SMOLLM2_PATH = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PATH = MODELS_DIR / "gemma-3-270m-q4_k_m.gguf"
FIXTURES_DIR = Path("/work/shared/fixtures")
SMOLLM2_FIXTURES = FIXTURES_DIR / "smollm2-135m-instruct-q4_1.shared.json"
GEMMA3_FIXTURES = FIXTURES_DIR / "gemma-3-270m-q4_k_m.shared.json"


def _need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"missing {path} (run scripts/fetch_models.py)")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (skips if absent)."""
    return _need(SMOLLM2_PATH)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Path of the real Gemma 3 270M Q4_K_M GGUF (skips if absent)."""
    return _need(GEMMA3_PATH)


def load_fixture_file(path: Path) -> dict[str, Any]:
    """The llama.cpp reference data (see /work/shared/fixtures/README.md); skips if absent."""
    return json.loads(_need(path).read_text())


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: Path):
    """``read_gguf`` of the SmolLM2 file, shared by the session."""
    from worker.engine.gguf_loader import read_gguf

    return read_gguf(smollm2_path)


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_path: Path):
    """``read_gguf`` of the Gemma 3 file, shared by the session."""
    from worker.engine.gguf_loader import read_gguf

    return read_gguf(gemma3_path)
