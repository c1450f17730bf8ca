"""Placement with real workers: ``max_loaded = 2`` and a burst of first requests to a
third model while one loaded model is generating — the idle least-recently-used one is
evicted, the third loads once, the running generation is never cut, and
/admin/models reports the workers' measured RSS and the estimate it refines; then a
SIGHUP reload (a changed model reloads with its new n_ctx, a removed one stops, an
added one serves)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.router.conftest import GEMMA, LiveRouter, MODELS, SMOLLM2, router_fixture

pytestmark = [pytest.mark.slow]

CONFIG = f"""
[server]
models_dir = "{MODELS}"
max_loaded = 2
[defaults]
n_ctx = 512
load_timeout_s = 300
kv_budget_mib = 256
[models.smollm2]
path = "{SMOLLM2.name}"
[models.gemma3]
path = "{GEMMA.name}"
chat_template = "gemma"
[models.smol-third]
path = "{SMOLLM2.name}"
max_queue = 16
"""

MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


router = router_fixture(CONFIG, real=True)


def test_burst_to_a_third_model_evicts_the_idle_lru_one_and_loads_once(router: LiveRouter) -> None:
    for m in ("smollm2", "gemma3"):
        httpx.post(router.url + "/admin/models/load", json={"model": m}, timeout=300).raise_for_status()
    # smollm2 is used first, then gemma3: smollm2 is the least recently used
    r = httpx.post(router.url + "/v1/completions", timeout=300, headers={"X-Request-Id": "trace-real-1"},
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-real-1"
    # the id reaches the real worker's log line (its stderr goes to the router's log here)
    router.wait_for(lambda: "accepted (X-Request-Id trace-real-1)" in router.log_path.read_text(errors="replace"),
                    what="the worker's log line with the request id")
    st = router.admin("smollm2")
    assert st["placement"]["rss_after_load_bytes"] > 0 and st["placement"]["rss_peak_bytes"] >= st["rss_bytes"] > 0

    async def go() -> tuple[list[str], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=300) as c:
            events: list[str] = []

            async def stream() -> None:
                async with c.stream("POST", "/v1/completions", json={
                        "model": "gemma3", "prompt": "Once upon a time", "max_tokens": 48, "stream": True,
                        "ignore_eos": True, "temperature": 0}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])

            s = asyncio.create_task(stream())
            # its first token pays the first touch of the memory-mapped weights (1 GiB of float32
            # for Gemma, from disk when the page cache has dropped them): wait as long as the request may
            await router.until(lambda: len(events) >= 1, timeout=300, what="gemma3 streaming")
            burst = await asyncio.gather(*(c.post("/v1/chat/completions", json={
                "model": "smol-third", "messages": MSG, "max_tokens": 4, "temperature": 0}) for _ in range(8)))
            await s
            return events, burst

    events, burst = asyncio.run(go())
    assert [r.status_code for r in burst] == [200] * 8
    texts = {r.json()["choices"][0]["message"]["content"] for r in burst}
    assert len(texts) == 1  # greedy: the same answer from the one worker
    assert events[-1] == "[DONE]"  # gemma3's generation ran to its end
    done = [json.loads(e) for e in events[:-1] if json.loads(e).get("choices")]
    assert done[-1]["choices"][0]["finish_reason"] == "length" and not any("error" in json.loads(e) for e in events[:-1])
    third = router.admin("smol-third")
    assert third["state"] == "ready" and third["spawn_count"] == 1
    evicted = router.admin("smollm2")
    assert evicted["state"] == "unloaded" and "evicted to make room for 'smol-third'" in evicted["unload_reason"]
    assert router.admin("gemma3")["state"] == "ready"
    # the measured RSS refines the estimate (the weights are mapped lazily: only ever upwards)
    est = evicted["placement"]["estimate"]
    assert est["kv_budget_bytes"] == 256 * 1024 * 1024 and est["source"] in ("gguf", "measured")
    peak = evicted["placement"]["rss_peak_bytes"]
    if est["source"] == "measured":
        assert est["weights_bytes"] == peak
    else:
        assert est["weights_bytes"] >= peak
    print(f"\nRSS smollm2: after load {evicted['placement']['rss_after_load_bytes'] / 2**20:.0f} MiB, "
          f"peak {peak / 2**20:.0f} MiB; estimate {est['total_bytes'] / 2**20:.0f} MiB ({est['source']})")


def test_sighup_reload_with_real_workers(router: LiveRouter) -> None:
    import signal

    httpx.post(router.url + "/admin/models/load", json={"model": "smollm2"}, timeout=300).raise_for_status()
    old_pid = router.admin("smollm2")["pid"]
    new = (CONFIG.replace("[models.gemma3]\npath = \"" + GEMMA.name + "\"\nchat_template = \"gemma\"\n", "")
           .replace("[models.smollm2]\npath = \"" + SMOLLM2.name + "\"\n",
                    "[models.smollm2]\npath = \"" + SMOLLM2.name + "\"\nn_ctx = 256\n"))
    assert "gemma3" not in new and "n_ctx = 256" in new
    router.config_path.write_text(new + f'[models.smol-new]\npath = "{SMOLLM2.name}"\n')
    router.proc.send_signal(signal.SIGHUP)
    router.wait_for(lambda: "config reloaded" in router.log(), what="the reload")
    router.wait_for(lambda: router.admin("smollm2")["state"] in ("unloaded", "ready") and
                    router.admin("smollm2")["pid"] != old_pid, what="smollm2's old worker gone", timeout=120)
    props = httpx.get(router.url + "/props", params={"model": "smollm2"}, timeout=300).json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert httpx.post(router.url + "/v1/completions", timeout=300, json={
        "model": "smol-new", "prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert httpx.post(router.url + "/v1/completions", timeout=60, json={
        "model": "gemma3", "prompt": "Hi", "max_tokens": 2}).status_code == 404
    router.wait_for(lambda: all(m["id"] != "gemma3" for m in
                                httpx.get(router.url + "/admin/models", timeout=10).json()["data"]),
                    what="gemma3 stopped and forgotten", timeout=120)
