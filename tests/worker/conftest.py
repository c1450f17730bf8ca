"""Shared fixtures for engine tests: real model paths, fixture files, GGUF files opened once.

Fixture names are prefixed (``smollm2_path``, ``gemma3_path``, ...) so they do not
clash with module-level fixtures of other test files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.paths import (  # noqa: F401  (re-exported for the test modules)
    FIXTURES_DIR,
    GEMMA3_FIXTURES,
    GEMMA3_PATH,
    MODELS_DIR,
    ROOT,
    SMOLLM2_FIXTURES,
    SMOLLM2_PATH,
)


def _need(path: Path) -> Path:
    if not path.is_file():
        pytest.fail(f"missing {path} (scripts/fetch_models.py fetches the models; the fixtures are in tests/fixtures)")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (fails if absent)."""
    return _need(SMOLLM2_PATH)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Path of the real Gemma 3 270M Q4_K_M GGUF (fails if absent)."""
    return _need(GEMMA3_PATH)


def load_fixture_file(path: Path) -> dict[str, Any]:
    """The llama.cpp reference data (see tests/fixtures/README.md); fails if absent."""
    return json.loads(_need(path).read_text())


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: Path):
    """``read_gguf`` of the SmolLM2 file, shared by the session."""
    from worker.engine.loading.gguf_loader import read_gguf

    return read_gguf(smollm2_path)


@pytest.fixture(scope="session")
def gemma3_gguf(gemma3_path: Path):
    """``read_gguf`` of the Gemma 3 file, shared by the session."""
    from worker.engine.loading.gguf_loader import read_gguf

    return read_gguf(gemma3_path)
