"""Session set-up shared by every test package.

The suite never writes into the user's own caches: ``XDG_CACHE_HOME`` points at a temporary
directory for the session (the engine's weight caches — gigabytes of f32 arrays for the real
models — and the file-hash cache go there, and so do the router's and workers' subprocesses,
which inherit the environment); it is removed when the session ends. The user's cache stays
readable as ``MODELYARD_USER_CACHE_HOME`` (the downloaded model packages, which tests only
read). ``MODELYARD_TEST_CACHE_HOME=DIR`` uses (and keeps) DIR instead, e.g. to keep the weight
caches warm across runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_made: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if "MODELYARD_USER_CACHE_HOME" not in os.environ:
        os.environ["MODELYARD_USER_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    keep = os.environ.get("MODELYARD_TEST_CACHE_HOME")
    if keep:
        os.environ["XDG_CACHE_HOME"] = keep
        return
    d = tempfile.mkdtemp(prefix="modelyard-test-cache-")
    _made.append(d)
    os.environ["XDG_CACHE_HOME"] = d


def pytest_unconfigure(config: pytest.Config) -> None:
    for d in _made:
        shutil.rmtree(d, ignore_errors=True)
    _made.clear()
