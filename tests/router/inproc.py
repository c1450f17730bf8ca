"""The router app in this process (fake workers as subprocesses), for decisions that
need injected facts: a :class:`FakeClock` for crash backoff, :class:`FakeMemory` for
memory-aware placement. Requests go through the real ASGI app (httpx's ASGITransport);
waiting is always on observed state (:func:`until`), never on a sleep's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import parse_config
from router.workers.pool import Pool
from tests.router.conftest import ROOT, dummy_gguf, spare_off


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


async def until(cond: Callable[[], Any], what: str = "condition", timeout: float = 30.0) -> Any:
    """Poll ``cond`` on the event loop until it is true (a generous safety timeout only)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = cond()
        if v:
            return v
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class InProc:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.fake_file = tmp / "fake.json"
        self.fake_log = tmp / "fake.log"
        self.fake_file.write_text("{}")
        dummy_gguf(tmp, "m.gguf")
        monkeypatch.setenv("MODELYARD_FAKE_FILE", str(self.fake_file))
        monkeypatch.setenv("MODELYARD_FAKE_LOG", str(self.fake_log))
        monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def set_fake(self, switches: dict[str, Any]) -> None:
        self.fake_file.write_text(json.dumps(switches))

    @contextlib.contextmanager
    def hold(self) -> Any:
        hold = Path(str(self.fake_file) + ".hold")
        hold.touch()
        try:
            yield
        finally:
            hold.unlink(missing_ok=True)

    @contextlib.asynccontextmanager
    async def app(self, config: str, **pool_options: Any) -> AsyncIterator[tuple[Pool, httpx.AsyncClient]]:
        cfg = parse_config(tomllib.loads(spare_off(config)), base_dir=self.tmp)
        app = create_app(cfg, worker_module="tests.fakes.fake_worker", pool_options=pool_options)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=30) as c:
                yield app.state.pool, c


def chat(model: str, content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}
