"""ipc socket directories (one parent, named after the router, stale ones swept at
start) and ``MODELYARD_MODELS_DIR`` as the default ``models_dir`` (fake workers)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from router.config import ConfigError, load_config
from router.workers.sockdir import make_socket_dir, owner_alive, socket_parent, sweep_stale
from tests.router.conftest import LiveRouter, dummy_gguf

# ----------------------------------------------------------------------------- socket directories


@pytest.fixture()
def runtime() -> Iterator[Path]:
    """A short XDG_RUNTIME_DIR (socket paths must fit in 108 bytes; tmp_path is too long)."""
    d = Path(tempfile.mkdtemp(prefix="myrt-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _stamp(pid: int) -> int:
    return round(psutil.Process(pid).create_time() * 100)


def test_socket_parent_prefers_xdg_runtime_dir(tmp_path: Path) -> None:
    assert socket_parent({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "modelyard"
    assert (tmp_path / "modelyard").stat().st_mode & 0o777 == 0o700
    fallback = socket_parent({"XDG_RUNTIME_DIR": str(tmp_path / "missing")})
    assert fallback is not None and fallback.name == f"modelyard-{os.getuid()}"


def test_sweep_removes_only_directories_of_dead_routers(tmp_path: Path) -> None:
    parent = tmp_path / "modelyard"
    parent.mkdir()
    me = os.getpid()
    dead = _dead_pid()
    live = parent / f"{me}-{_stamp(me)}-abc123"        # this process: kept
    reused = parent / f"{me}-{_stamp(me) - 500}-abc123"  # same pid, other start time (pid reuse): removed
    gone = parent / f"{dead}-{_stamp(me)}-xyz_9"         # no such process: removed
    other = parent / "not-a-router-dir"                  # not ours to judge: kept
    for d in (live, reused, gone, other):
        d.mkdir()
        (d / "w1.sock").write_text("")
    assert owner_alive(me, _stamp(me)) and not owner_alive(me, _stamp(me) - 500) and not owner_alive(dead, 1)
    assert sorted(sweep_stale(parent)) == sorted([reused, gone])
    assert live.is_dir() and other.is_dir() and not reused.exists() and not gone.exists()


def test_make_socket_dir_is_named_after_this_router_and_sweeps(runtime: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    stale = runtime / "modelyard" / f"{_dead_pid()}-12345-old"
    stale.mkdir(parents=True)
    d = make_socket_dir(env)
    assert d.parent == runtime / "modelyard" and d.name.startswith(f"{os.getpid()}-{_stamp(os.getpid())}-")
    assert d.stat().st_mode & 0o777 == 0o700
    assert not stale.exists()
    assert len(str(d / "w99999.sock")) < 104


def test_a_parent_too_long_for_socket_paths_falls_back_to_a_short_one(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 80)
    deep.mkdir()
    d = make_socket_dir({"XDG_RUNTIME_DIR": str(deep)})
    try:
        assert len(str(d / "w99999.sock")) < 104 and d.name.startswith(f"{os.getpid()}-")
    finally:
        shutil.rmtree(d, ignore_errors=True)


MINI = """
[server]
models_dir = "."
[models.one]
path = "m.gguf"
"""


def _socket_dirs(runtime: Path) -> list[Path]:
    return sorted((runtime / "modelyard").iterdir()) if (runtime / "modelyard").exists() else []


def test_sigkilled_routers_socket_dir_is_removed_by_the_next_router(tmp_path: Path, runtime: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        dummy_gguf(tmp_path / sub, "m.gguf")
    first = LiveRouter(tmp_path / "a", MINI, env=env)
    try:
        r = httpx.post(first.url + "/v1/completions", json={"model": "one", "prompt": "hi", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200
        dirs = _socket_dirs(runtime)
        assert len(dirs) == 1 and dirs[0].name.startswith(f"{first.proc.pid}-")
        assert list(dirs[0].glob("*.sock"))
        first.workers()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        assert _socket_dirs(runtime) == dirs  # a SIGKILLed router cannot clean up
    finally:
        first.kill()
    second = LiveRouter(tmp_path / "b", MINI, env=env)
    try:
        now = _socket_dirs(runtime)
        assert len(now) == 1 and now[0].name.startswith(f"{second.proc.pid}-") and not dirs[0].exists()
    finally:
        assert second.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    assert _socket_dirs(runtime) == []  # a clean stop removes its own directory


# ----------------------------------------------------------------------------- MODELYARD_MODELS_DIR


def test_models_dir_defaults_to_the_env_var_and_the_config_wins(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dummy_gguf(elsewhere, "m.gguf")
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    no_dir = cfg_dir / "no_dir.toml"
    no_dir.write_text('[models.one]\npath = "m.gguf"\n')
    monkeypatch.setenv("MODELYARD_MODELS_DIR", str(elsewhere))
    cfg = load_config(no_dir)
    assert cfg.server.models_dir == elsewhere and cfg.models["one"].path == (elsewhere / "m.gguf").resolve()
    # relative to the current directory, as for scripts/fetch_models.py
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODELYARD_MODELS_DIR", "elsewhere")
    assert load_config(no_dir).models["one"].path == (elsewhere / "m.gguf").resolve()
    # [server].models_dir set: the config wins
    dummy_gguf(cfg_dir, "m.gguf")
    with_dir = cfg_dir / "with_dir.toml"
    with_dir.write_text('[server]\nmodels_dir = "."\n[models.one]\npath = "m.gguf"\n')
    assert load_config(with_dir).models["one"].path == (cfg_dir / "m.gguf").resolve()
    # unset or empty: "models" next to the config file
    monkeypatch.setenv("MODELYARD_MODELS_DIR", "")
    assert load_config(with_dir).server.models_dir == cfg_dir
    monkeypatch.delenv("MODELYARD_MODELS_DIR")
    with pytest.raises(ConfigError) as e:
        load_config(no_dir)
    assert e.value.key == "models.one.path" and str(cfg_dir / "models" / "m.gguf") in str(e.value)


def test_router_serves_from_the_env_models_dir(tmp_path: Path) -> None:
    models = tmp_path / "downloaded"
    models.mkdir()
    dummy_gguf(models, "m.gguf")
    r = LiveRouter(tmp_path, '[models.one]\npath = "m.gguf"\n', env={"MODELYARD_MODELS_DIR": str(models)})
    try:
        ans = httpx.post(r.url + "/v1/completions", json={"model": "one", "prompt": "hi", "max_tokens": 1},
                         timeout=30)
        assert ans.status_code == 200, ans.text
        assert r.admin("one")["path"] == str((models / "m.gguf").resolve())
    finally:
        r.stop()
