"""The router as a process: config validation, CLI exit codes, auth, and no orphan workers
after SIGTERM or even SIGKILL of the router (fake workers)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from router.config import ConfigError, load_config
from tests.router.conftest import ROOT, LiveRouter, alive, dummy_gguf

MINI = """
[server]
models_dir = "."
[models.one]
path = "m.gguf"
[models.two]
path = "m.gguf"
"""


def write(tmp: Path, text: str) -> Path:
    dummy_gguf(tmp, "m.gguf")
    p = tmp / "c.toml"
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_paths(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINI + '[defaults]\nmax_queue = 3\ntemperature = 0.5\n'))
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8080
    one = cfg.models["one"]
    assert one.path == (tmp_path / "m.gguf").resolve()
    assert one.max_queue == 3 and one.sampling == {"temperature": 0.5} and one.n_ctx is None
    assert one.idle_ttl_s == 0.0  # never unloaded for idleness unless asked
    assert one.n_threads is None  # the environment decides unless asked


def test_n_threads_reaches_the_worker_command(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINI + '[defaults]\nn_threads = 1\n'))
    from router.workers.launchers.local import worker_command

    cmd = worker_command(cfg.models["one"], "ipc:///x.sock")
    assert cmd[cmd.index("--threads") + 1] == "1"
    assert "--threads" not in worker_command(load_config(write(tmp_path, MINI)).models["one"], "ipc:///x.sock")


def test_n_ubatch_reaches_the_worker_command(tmp_path: Path) -> None:
    from router.workers.launchers.local import worker_command

    cfg = load_config(write(tmp_path, MINI + '[defaults]\nn_ubatch = 256\n'))
    cmd = worker_command(cfg.models["one"], "ipc:///x.sock")
    assert cmd[cmd.index("--n-ubatch") + 1] == "256"
    assert "--n-ubatch" not in worker_command(load_config(write(tmp_path, MINI)).models["one"], "ipc:///x.sock")


def test_kv_state_keys_reach_the_worker_command(tmp_path: Path) -> None:
    from router.workers.launchers.local import worker_command

    text = MINI.replace('[models.two]\npath = "m.gguf"\n', '[models.two]\npath = "m.gguf"\nslot_save_path = "s"\n'
                        'prefill_model = "one"\n') + '[defaults]\nslot_save_path = "s"\nkv_cache_dir = "kv"\n'
    cfg = load_config(write(tmp_path, text))
    one, two = cfg.models["one"], cfg.models["two"]
    assert two.prefill_model == "one" and one.prefill_model is None and two.kv_transfer == "wire"
    cmd = worker_command(two, "ipc:///x.sock")
    assert cmd[cmd.index("--slot-save-path") + 1] == str((tmp_path / "s").resolve())
    assert cmd[cmd.index("--kv-cache-dir") + 1] == str((tmp_path / "kv").resolve() / "two")
    assert cmd[cmd.index("--kv-cache-mib") + 1] == "1024.0"
    assert "--slot-save-path" not in worker_command(load_config(write(tmp_path, MINI)).models["one"], "ipc:///x.sock")


@pytest.mark.parametrize("extra,key", [
    ("[server]\nport = 'x'\n", "server.port"),
    ("[server]\nwarm_spare = 'yes'\n", "server.warm_spare"),
    ("[models.one]\nmax_queue = -1\n", "models.one.max_queue"),
    ("[models.one]\nmax_qeue = 1\n", "models.one.max_qeue"),
    ("[defaults]\ntemperature = 'hot'\n", "defaults.temperature"),
    ("[models.three]\naliases = ['x']\n", "models.three.path"),
    ("[models.three]\npath = 'missing.gguf'\n", "models.three.path"),
    ("[models.three]\npath = 'm.gguf'\naliases = ['one']\n", "models.three.aliases"),
    ("[server]\nhost = '0.0.0.0'\n", "server.api_key"),
    ("[server]\ntransport = 'udp'\n", "server.transport"),
    ("[models.one]\nidle_ttl_s = -1\n", "models.one.idle_ttl_s"),
    ("[defaults]\nidle_ttl_s = 'never'\n", "defaults.idle_ttl_s"),
    ("[models.one]\nn_threads = 0\n", "models.one.n_threads"),
    ("[models.one]\nn_ubatch = 0\n", "models.one.n_ubatch"),
    ("[defaults]\nn_ubatch = 'big'\n", "defaults.n_ubatch"),
    ("[models.one]\nn_ubatch = 1.5\n", "models.one.n_ubatch"),
    ("[defaults]\nrepeat_penalty = 0\n", "defaults.repeat_penalty"),  # the worker needs > 0 (protocol.limits)
    ("[models.one]\nprefill_model = 'nope'\n", "models.one.prefill_model"),
    ("[models.one]\nprefill_model = 'two'\nkv_transfer = 'file'\n", "models.one.prefill_model"),  # no common slot_save_path
    ("[models.one]\nprefill_model = 'two'\nkv_transfer = 'pigeon'\n", "models.one.kv_transfer"),
    ("[models.one]\nkv_transfer = 'file'\n", "models.one.kv_transfer"),  # not split
    ("[defaults]\nkv_transfer = 'file'\n", "defaults.kv_transfer"),
    ("[models.one]\nprefill_model = 'one'\nslot_save_path = 's'\n", "models.one.prefill_model"),
    ("[defaults]\nprefill_model = 'two'\n", "defaults.prefill_model"),
    ("[models.one]\nkv_cache_mib = -1\n", "models.one.kv_cache_mib"),
    ("[models.one]\nslot_save_path = 'm.gguf'\n", "models.one.slot_save_path"),  # a file, not a directory
])
def test_config_errors_name_the_key(tmp_path: Path, extra: str, key: str) -> None:
    base = MINI.replace("[server]\nmodels_dir = \".\"\n", "")
    server = 'models_dir = "."\n'
    if extra.startswith("[server]"):
        text = "[server]\n" + server + extra[len("[server]\n"):] + base
    elif extra.startswith("[models.one]"):
        text = "[server]\n" + server + base.replace('[models.one]\npath = "m.gguf"\n',
                                                    '[models.one]\npath = "m.gguf"\n' + extra[len("[models.one]\n"):])
    else:
        text = "[server]\n" + server + base + extra
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert e.value.key == key and str(e.value).startswith(key)


def test_cli_config_error_exits_1_naming_the_key(tmp_path: Path) -> None:
    p = write(tmp_path, MINI + "[defaults]\nmax_queue = 'many'\n")
    r = subprocess.run([sys.executable, "-m", "router", "serve", "--config", str(p)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "defaults.max_queue" in r.stderr
    r = subprocess.run([sys.executable, "-m", "router", "--config", str(tmp_path / "nope.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "nope.toml" in r.stderr


def test_cli_refuses_public_host_without_api_key(tmp_path: Path) -> None:
    p = write(tmp_path, MINI)
    r = subprocess.run([sys.executable, "-m", "router", "serve", "--config", str(p), "--host", "0.0.0.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "server.api_key" in r.stderr


# ----------------------------------------------------------------------------- auth


def test_api_key_and_admin_key(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, MINI.replace('models_dir = "."', 'models_dir = "."\napi_key = "k1"\nadmin_key = "k2"'))
    try:
        assert httpx.get(r.url + "/health").status_code == 200
        res = httpx.get(r.url + "/v1/models")
        assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            r.client(api_key="wrong").models.list()
        assert [m.id for m in r.client(api_key="k1").models.list().data] == ["one", "two"]
        assert httpx.get(r.url + "/admin/models", headers={"Authorization": "Bearer k1"}).status_code == 401
        assert httpx.get(r.url + "/admin/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        out = r.client(api_key="k1").completions.create(model="one", prompt="x", max_tokens=1)
        assert out.choices[0].text == " w100"
    finally:
        r.stop()


# ----------------------------------------------------------------------------- no orphans


def _router_with_two_workers(tmp_path: Path) -> tuple[LiveRouter, list[psutil.Process]]:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, MINI)
    for m in ("one", "two"):
        httpx.post(r.url + "/v1/completions", json={"model": m, "prompt": "x", "max_tokens": 1}, timeout=30)
    workers = r.workers()
    assert len(workers) == 2
    return r, workers


def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    r, workers = _router_with_two_workers(tmp_path)
    assert r.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    deadline = time.monotonic() + 10
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(workers) == []
    assert len(r.fake_events("shutdown")) == 2  # asked politely first


@pytest.mark.reliability
def test_sigkill_of_the_router_leaves_no_orphans(tmp_path: Path) -> None:
    r, workers = _router_with_two_workers(tmp_path)
    os.kill(r.proc.pid, signal.SIGKILL)
    r.proc.wait(10)
    t0 = time.monotonic()
    while alive(workers) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert alive(workers) == []
    print(f"\nworkers gone {time.monotonic() - t0:.2f} s after the router was SIGKILLed")
    r.stop()


def test_router_never_imports_numpy_or_the_worker() -> None:
    code = ("import sys, router.app, router.cli; "
            "bad = [m for m in sys.modules if m == 'numpy' or m.split('.')[0] == 'worker']; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_sigterm_ends_running_requests_cleanly_and_refuses_waiting_ones(tmp_path: Path) -> None:
    """SIGTERM: the waiting request gets 503 server_shutting_down at once; the running ones
    (held) get shutdown_timeout_s, then a streamed one ends with an SSE error event and a
    non-streamed one with a 503 body — never uvicorn's bare 500 or a cut stream."""
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, MINI.replace('models_dir = "."', 'models_dir = "."\nshutdown_timeout_s = 1.0'))
    async def go() -> tuple[httpx.Response, list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=r.url, timeout=60) as c:
            lines: list[str] = []

            async def stream() -> None:
                async with c.stream("POST", "/v1/chat/completions", json={
                        "model": "one", "stream": True, "messages": [{"role": "user", "content": "[hold@2]"}]}) as s:
                    assert s.status_code == 200
                    async for line in s.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])

            with r.hold():  # never released: only the shutdown can end these two
                streamed = asyncio.create_task(stream())
                plain = asyncio.create_task(c.post("/v1/completions", json={
                    "model": "two", "prompt": "[hold]", "max_tokens": 5}))
                await r.until(lambda: r.admin("one")["in_flight"] and r.admin("two")["in_flight"], what="running")
                waiting = asyncio.create_task(c.post("/v1/completions", json={
                    "model": "two", "prompt": "x", "max_tokens": 1}))
                await r.until(lambda: r.admin("two")["queue_depth"] == 1, what="waiting")
                await r.until(lambda: len(lines) >= 3, what="role chunk and two tokens streamed")
                r.proc.send_signal(signal.SIGTERM)
                refused = await waiting
                await streamed
                return refused, lines, await plain

    refused, lines, plain = asyncio.run(go())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert "retry-after" in refused.headers
    assert "".join(json.loads(x)["choices"][0]["delta"].get("content") or "" for x in lines[:-1]) == " w100 w101"
    last = json.loads(lines[-1])
    assert last["error"]["code"] == "server_shutting_down" and "shutdown_timeout_s" in last["error"]["message"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    workers = r.workers() + list(r.seen.values())
    assert r.proc.wait(30) in (0, -signal.SIGTERM)
    r.wait_for(lambda: alive(workers) == [], what="workers gone")
    assert "timeout graceful shutdown exceeded" not in r.log()  # uvicorn never had to cancel a task
    r.stop()
