"""The launcher seam (router.workers.launchers): everything the router knows of where a worker
runs comes through one interface. A launcher standing for another host (its workers still run
here, as fake workers, but its host name, cores, memory figures and handles are its own) is
injected into the pool: the requests are served, and the router's figures are that launcher's —
the pool's cores, placement's memory, the admin view's host and RSS, the command it reports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from protocol import WorkerCredentials
from router.config import ModelConfig, ServerConfig
from router.workers.launchers import Launched, Launcher, WorkerHandle
from router.workers.launchers.local import LocalLauncher
from tests.router.inproc import InProc, chat

MiB = 2**20


class ElsewhereHandle(WorkerHandle):
    host = "host-b"

    def __init__(self, inner: WorkerHandle) -> None:
        self.inner = inner
        self.killed = 0

    @property
    def pid(self) -> int | None:
        return self.inner.pid

    def alive(self) -> bool:
        return self.inner.alive()

    def kill(self) -> None:
        self.killed += 1
        self.inner.kill()

    def on_exit(self, callback: Callable[[int], None]) -> None:
        self.inner.on_exit(callback)

    def rss_bytes(self) -> int | None:
        return 42 * MiB if self.inner.alive() else None

    def is_own(self, pid: int) -> bool:
        return self.inner.is_own(pid)


class ElsewhereLauncher(Launcher):
    host = "host-b"

    def __init__(self, inner: LocalLauncher) -> None:
        self.inner = inner
        self.started: list[str | None] = []
        self.handles: list[ElsewhereHandle] = []
        self.closed = False

    def endpoint(self) -> str:
        return self.inner.endpoint()

    async def start(self, model: ModelConfig | None, endpoint: str, credentials: WorkerCredentials) -> Launched:
        launched = await self.inner.start(model, endpoint, credentials)
        self.started.append(model.name if model is not None else None)
        handle = ElsewhereHandle(launched.handle)
        self.handles.append(handle)
        return Launched(launched.endpoint, credentials, handle, ("ray-actor", *launched.command[1:]))

    def cores(self) -> int:
        return 3

    def available(self) -> int:
        return 64 * 1024 * MiB

    def rss(self, pid: int | None, model: str) -> int | None:
        return 42 * MiB if pid is not None else None

    async def close(self) -> None:
        self.closed = True
        await self.inner.close()


def test_a_launcher_for_another_host_is_all_the_router_knows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    cfg = '[server]\nmodels_dir = "."\n[defaults]\nping_interval_s = 0\n[models.a]\npath = "m.gguf"\n'

    async def go() -> None:
        ctx = zmq.asyncio.Context()
        inner = LocalLauncher(ServerConfig(warm_spare=False), ctx=ctx, module="tests.fakes.fake_worker")
        launcher = ElsewhereLauncher(inner)
        try:
            async with env.app(cfg, launcher=launcher) as (pool, c):
                assert pool.launcher is launcher and pool.cores == 3 and pool.memory is launcher
                r = await c.post("/v1/chat/completions", json=chat("a"))
                assert r.status_code == 200, r.text
                assert launcher.started == ["a"]
                row = next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "a")
                assert row["host"] == "host-b" and row["rss_bytes"] == 42 * MiB and row["from_spare"] is False
                assert row["pid"] == launcher.handles[0].pid
                assert pool.slots["a"].worker is not None and pool.slots["a"].worker.command[0] == "ray-actor"
                assert (await c.get("/admin/models")).json()["spare"] is None  # this launcher keeps none
                r = await c.post("/admin/models/unload", json={"model": "a"})
                assert r.status_code == 200, r.text
            assert launcher.closed
        finally:
            ctx.destroy(linger=0)

    asyncio.run(go())
