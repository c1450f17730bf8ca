"""The harness cache outlives a test session: it is under the user's cache, not the
session's temporary XDG_CACHE_HOME (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harnesses.install import cache_dir


def test_cache_is_the_users_not_the_sessions_temp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MODELYARD_HARNESS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "session-temp"))
    monkeypatch.setenv("MODELYARD_USER_CACHE_HOME", str(tmp_path / "user"))
    assert cache_dir() == tmp_path / "user" / "modelyard" / "harnesses"
    monkeypatch.delenv("MODELYARD_USER_CACHE_HOME")
    assert cache_dir() == tmp_path / "session-temp" / "modelyard" / "harnesses"
    monkeypatch.setenv("MODELYARD_HARNESS_CACHE", str(tmp_path / "pinned"))
    assert cache_dir() == tmp_path / "pinned"
