"""The operator's first minutes (issue 10, item 9), with fake workers: ``--version``, the
start-up banner, a taken port as one clear line, ``./scripts/serve --help`` before any
set-up, and a second Ctrl-C that ends running streams with their error event."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from router.cli_args import version
from tests.router.conftest import ROOT, LiveRouter, dummy_gguf

CONFIG = """
[server]
models_dir = "."
shutdown_timeout_s = 60
[models.m]
path = "m.gguf"
aliases = ["em", "m:latest"]
[models.p]
path = "m.gguf"
pinned = true
weights = "f32"
"""


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["MODELYARD_WORKER_MODULE"] = "tests.fakes.fake_worker"
    return e


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "router", "--version"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"modelyard {version()}" and version() != "unknown"


def test_banner(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, CONFIG)
    try:
        log = r.log()
        assert f"modelyard {version()} listening on http://127.0.0.1:{r.port}" in log
        assert f"models directory: {tmp_path}" in log
        assert "  m — unloaded — m.gguf (weights: quantized; aliases: em, m:latest)" in log  # the default
        assert "  p — unloaded — m.gguf (weights: f32; pinned)" in log                      # configured
        assert "caches: weights " in log and "/modelyard/npy" in log
        # the banner comes before uvicorn's own start-up lines
        assert log.index("listening on") < log.index("Application startup complete")
    finally:
        r.stop()


def test_a_taken_port_is_one_clear_line(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    (tmp_path / "c.toml").write_text(CONFIG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "router", "serve", "--config", str(tmp_path / "c.toml"),
                              "--port", str(port)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"modelyard: port {port} on 127.0.0.1 is already in use (another modelyard?); "
        f"pick another with --port N (or set [server].port)"]
    assert "startup complete" not in out.stdout + out.stderr


def test_scripts_serve_help_needs_no_set_up(tmp_path: Path) -> None:
    # a copy of the checkout's entry points, without .venv: --help must not start the set-up
    (tmp_path / "scripts").mkdir()
    (tmp_path / "router").mkdir()
    for rel in ("scripts/serve", "scripts/_bootstrap.sh", "router/__init__.py", "router/cli_args.py", "pyproject.toml"):
        shutil.copy2(ROOT / rel, tmp_path / rel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHON"] = sys.executable
    for args, expect in ((["--help"], "usage: modelyard serve"), (["--port", "9000", "-h"], "--port PORT"),
                         (["--version"], f"modelyard {version()}")):
        out = subprocess.run(["bash", str(tmp_path / "scripts" / "serve"), *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert expect in out.stdout and "[setup]" not in out.stdout + out.stderr
    assert not (tmp_path / ".venv").exists()


def test_second_ctrl_c_ends_streams_with_their_error_event(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, CONFIG)
    events: list[str] = []
    got_first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", r.url + "/v1/chat/completions", timeout=60, json={
                "model": "m", "stream": True, "messages": [{"role": "user", "content": "[slow=0.1] [len=500] hi"}]}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    got_first.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert got_first.wait(30)
        r.proc.send_signal(signal.SIGINT)
        r.wait_for(lambda: "Ctrl-C again to end them now" in r.log(), what="the first Ctrl-C's shutdown")
        r.proc.send_signal(signal.SIGINT)
        t.join(30)
        assert not t.is_alive()
        assert r.proc.wait(30) == 0
    finally:
        r.kill()
    last = json.loads(events[-1])
    assert last["error"]["code"] == "server_shutting_down" and "interrupted" in last["error"]["message"]
    log = r.log_path.read_text()
    assert "Traceback" not in log and "ended 1 running generation(s)" in log
