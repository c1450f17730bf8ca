"""CPU sharing (Pool.share_cores) against fake workers: a worker without ``n_threads``
gets all the cores while it is the only busy one, an equal share when others are busy,
and the cores a busy model with its own ``n_threads`` takes are left to it; workers with
``n_threads`` never get a share. (The decode rates: scripts/bench_models_at_once.py.)"""

from __future__ import annotations

import asyncio
import os

import httpx

from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0
[models.x]
path = "m.gguf"
[models.y]
path = "m.gguf"
[models.z]
path = "m.gguf"
n_threads = 1
"""

CORES = len(os.sched_getaffinity(0))


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def last_threads(r: LiveRouter, model: str) -> int | None:
    pid = r.admin(model)["pid"]
    evs = [e["n"] for e in r.fake_events("threads") if e["pid"] == pid]
    return evs[-1] if evs else None


async def aask(c: httpx.AsyncClient, model: str, content: str) -> httpx.Response:
    return await c.post("/v1/chat/completions",
                        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3})


def test_busy_workers_share_the_cores(router: LiveRouter) -> None:
    for m in "xyz":
        httpx.post(router.url + "/admin/models/load", json={"model": m}, timeout=30).raise_for_status()

    async def go() -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as c:
            with router.hold():
                xr = asyncio.create_task(aask(c, "x", "[hold@1] a"))
                await router.until(lambda: last_threads(router, "x") == CORES, what="x alone: every core")
                assert router.admin("x")["blas_threads"] == CORES
                yr = asyncio.create_task(aask(c, "y", "[hold@1] b"))
                half = max(1, CORES // 2)
                await router.until(lambda: last_threads(router, "x") == half and last_threads(router, "y") == half,
                                   what="x and y busy: half each")
                assert router.admin("y")["blas_threads"] == half
            assert (await yr).status_code == 200 and (await xr).status_code == 200
            await router.until(lambda: last_threads(router, "x") == CORES, what="idle again: every core")
            with router.hold():
                zr = asyncio.create_task(aask(c, "z", "[hold@1] c"))
                await router.until(lambda: len(router.admin("z")["in_flight"]) == 1, what="z busy")
                xr = asyncio.create_task(aask(c, "x", "[hold@1] d"))
                await router.until(lambda: last_threads(router, "x") == max(1, CORES - 1),
                                   what="x shares what z's n_threads leaves")
            assert (await zr).status_code == 200 and (await xr).status_code == 200
            assert last_threads(router, "z") is None and router.admin("z")["blas_threads"] == 1

    asyncio.run(go())
