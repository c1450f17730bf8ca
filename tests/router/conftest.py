"""A live router on loopback for tests: ``python -m router serve`` as a subprocess.

``LiveRouter`` writes a config, starts the router (with the fake worker unless
``real=True``), waits for /health, and offers an OpenAI SDK client, the fake
worker's switches and event log, and the process tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.paths import MODELS_DIR

ROOT = Path(__file__).resolve().parents[2]
MODELS = MODELS_DIR  # MODELYARD_MODELS_DIR overrides, as for the router and scripts/fetch_models.py
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"


def spare_off(config: str) -> str:
    """``config`` with ``[server] warm_spare = false`` unless it sets ``warm_spare`` itself: the
    router tests count, kill and time their workers one by one; the warm spare's own tests
    (``test_spare_fake.py``, ``test_spare_real.py``) turn it on."""
    if re.search(r"^\s*warm_spare\s*=", config, re.M):
        return config
    if re.search(r"^\[server\]\s*$", config, re.M):
        return re.sub(r"^\[server\]\s*$", "[server]\nwarm_spare = false", config, count=1, flags=re.M)
    return "[server]\nwarm_spare = false\n\n" + config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveRouter:
    """A router subprocess on loopback. Use it as a context manager (stopped, and its workers
    killed, at the end), or through :func:`router_fixture` for a module's one router."""

    def __init__(self, tmp: Path, config: str, *, real: bool = False, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.real = real
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp / "config.toml"
        self.config_path.write_text(spare_off(config))
        self.fake_file = tmp / "fake.json"
        self.fake_log = tmp / "fake.log"
        self.log_path = tmp / "router.log"
        self.set_fake({})
        e = dict(os.environ)
        e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
        e["MODELYARD_FAKE_FILE"] = str(self.fake_file)
        e["MODELYARD_FAKE_LOG"] = str(self.fake_log)
        if real:
            e.pop("MODELYARD_WORKER_MODULE", None)
        else:
            e["MODELYARD_WORKER_MODULE"] = "tests.fakes.fake_worker"
        e.update(env or {})
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(self.config_path), "--port", str(self.port)],
            cwd=ROOT, env=e, stdout=self._log, stderr=subprocess.STDOUT)
        self.seen: dict[int, psutil.Process] = {}
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"router did not come up:\n{self.log()}")
            time.sleep(0.05)

    def __enter__(self) -> LiveRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout=60 if self.real else 30)
        self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def client(self, timeout: float = 60, api_key: str = "unused") -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def http(self, timeout: float = 60, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, **kw)

    def set_fake(self, switches: dict[str, Any]) -> None:
        self.fake_file.write_text(json.dumps(switches))

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Fake workers hold ``hold_load`` loads and ``[hold]`` generations until the block ends."""
        hold = Path(str(self.fake_file) + ".hold")
        hold.touch()
        try:
            yield
        finally:
            hold.unlink(missing_ok=True)

    async def until(self, cond: Any, timeout: float = 30.0, what: str = "condition") -> Any:
        """``wait_for`` from async code without blocking the event loop (the requests must flow)."""
        return await asyncio.to_thread(self.wait_for, cond, timeout, what)

    def fake_events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        if not self.fake_log.exists():
            return []
        out = []
        for line in self.fake_log.read_text().splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (event is None or ev["event"] == event) and all(ev.get(k) == v for k, v in match.items()):
                out.append(ev)
        return out

    def admin(self, model: str) -> dict[str, Any]:
        data = httpx.get(f"{self.url}/admin/models", timeout=10).json()["data"]
        return next(m for m in data if m["id"] == model)

    def workers(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for k in kids:
            self.seen[k.pid] = k
        return kids

    def wait_for(self, cond: Any, timeout: float = 30.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            v = cond()
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.log()}")
            time.sleep(0.02)

    def stop(self, timeout: float = 30) -> int:
        self.workers()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.Error:
                pass


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def dummy_gguf(tmp: Path, *names: str) -> None:
    for n in names:
        (tmp / n).write_bytes(b"GGUF fake")


def router_fixture(config: str, *, ggufs: tuple[str, ...] = (), fake: dict[str, Any] | None = None,
                   real: bool = False) -> Any:
    """A module's one live router as a module-scoped fixture named ``router``: ``ggufs`` are
    dummy GGUF files made in the module's directory first, ``fake`` the fake workers' switches
    set once it is up; ``real`` runs the real worker.

    ``router = router_fixture(CONFIG, ggufs=("m.gguf",))`` in a test module."""

    @pytest.fixture(scope="module", name="router")
    def _router(module_tmp: Path) -> Iterator[LiveRouter]:
        dummy_gguf(module_tmp, *ggufs)
        with LiveRouter(module_tmp, config, real=real) as r:
            if fake is not None:
                r.set_fake(fake)
            yield r

    return _router


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
