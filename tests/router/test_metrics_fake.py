"""``GET /metrics`` against fake workers (one live router, with an API key and an
admin key): every scrape parses with prometheus-client's own parser, counters move
by exactly what was sent, gauges follow the observed state.

Every wait is on observed state (the hold file keeps a generation going; the
metrics themselves are polled until they show an event), never on a sleep.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from router.metrics import Metrics
from tests.router.conftest import LiveRouter, router_fixture
from tests.router.metrics_util import Samples, delta, scrape, value

KEY, ADMIN = "sk-test", "sk-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}

CONFIG = f"""
[server]
models_dir = "."
api_key = "{KEY}"
admin_key = "{ADMIN}"
[defaults]
max_queue = 1
ping_interval_s = 0.2
restart_backoff_s = 0  # restarts at once here (the backoff: test_backoff_fake.py)
max_crashes = 1000
[models.alpha]
path = "m.gguf"
[models.crashy]
path = "m.gguf"
[models.broken]
path = "m.gguf"
[models.tight]
path = "m.gguf"
max_queue = 0
"""

SWITCHES: dict[str, Any] = {
    "alpha": {"cache_n": 2, "length": 6},
    "crashy": {"token_delay_s": 0.01},
    "broken": {"load_error": True},
}


router = router_fixture(CONFIG, ggufs=("m.gguf",), fake=SWITCHES)


def m(router: LiveRouter) -> Samples:
    return scrape(router.url, headers=AUTH)


def admin(router: LiveRouter, model: str) -> dict[str, Any]:
    data = httpx.get(f"{router.url}/admin/models", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=10).json()["data"]
    return next(x for x in data if x["id"] == model)


def chat(model: str, content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


def test_metrics_needs_the_api_key_and_uses_an_own_registry(router: LiveRouter) -> None:
    assert httpx.get(router.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200  # still open
    assert httpx.get(router.url + "/health", params={"model": "alpha"}, timeout=10).status_code == 401
    r = httpx.post(router.url + "/models/load", json={"model": "alpha"}, headers=AUTH, timeout=10)
    assert r.status_code == 401  # an operator action: the admin key
    after = m(router)
    assert value(after, "modelyard_requests_total", model="", route="/metrics", status="401") == 1
    assert value(after, "modelyard_requests_total", model="", route="/health", status="200") >= 1
    # two registries side by side (two apps in one process) do not collide; the global one is untouched
    a, b = Metrics(["x"]), Metrics(["x"])
    a.loads.labels("x").inc()
    assert b"modelyard_model_loads_total{model=\"x\"} 0.0" in b.render()
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("modelyard")]


def test_counters_move_by_exactly_what_was_sent(router: LiveRouter) -> None:
    before = m(router)
    outs = [httpx.post(router.url + "/v1/chat/completions", json=chat("alpha", f"q {i} [len={3 + i}]"),
                       headers=AUTH, timeout=30).json() for i in range(3)]
    streamed = httpx.post(router.url + "/completion", json={"model": "alpha", "prompt": "one two", "n_predict": 4},
                          headers=AUTH, timeout=30).json()
    after = m(router)
    prompt = sum(o["usage"]["prompt_tokens"] for o in outs) + streamed["tokens_evaluated"]
    completion = sum(o["usage"]["completion_tokens"] for o in outs) + streamed["tokens_predicted"]
    assert completion == 3 + 4 + 5 + 4
    assert delta(before, after, "modelyard_requests_total", model="alpha", route="/v1/chat/completions",
                 status="200") == 3
    assert delta(before, after, "modelyard_requests_total", model="alpha", route="/completion", status="200") == 1
    assert delta(before, after, "modelyard_prompt_tokens_total", model="alpha") == prompt
    assert delta(before, after, "modelyard_generation_tokens_total", model="alpha") == completion
    assert delta(before, after, "modelyard_prompt_tokens_cached_total", model="alpha") == 2 * 4
    assert delta(before, after, "modelyard_time_to_first_token_seconds_count", model="alpha") == 4
    assert delta(before, after, "modelyard_inter_token_latency_seconds_count", model="alpha") == completion - 4
    assert delta(before, after, "modelyard_e2e_request_latency_seconds_count", model="alpha") == 4
    assert delta(before, after, "modelyard_request_queue_time_seconds_count", model="alpha") == 4
    assert value(after, "modelyard_model_loads_total", model="alpha") == 1
    assert value(after, "modelyard_model_load_seconds_count", model="alpha") == 1
    assert value(after, "modelyard_model_state", model="alpha", state="ready") == 1
    assert value(after, "modelyard_model_state", model="alpha", state="unloaded") == 0
    assert value(after, "modelyard_model_loaded", model="alpha") == 1
    assert value(after, "modelyard_slots_total", model="alpha") == 1
    assert value(after, "modelyard_kv_cache_budget_tokens", model="alpha") == 256
    # KV held after the last request: its prompt + generated tokens (the fake's slot keeps them)
    assert value(after, "modelyard_kv_cache_tokens", model="alpha") == \
        streamed["tokens_evaluated"] + streamed["tokens_predicted"]
    # unknown routes share one label
    httpx.get(router.url + "/no/such/route/123", headers=AUTH, timeout=10)
    assert value(m(router), "modelyard_requests_total", model="", route="other", status="404") == 1


def test_gauges_rejections_and_cancellations(router: LiveRouter) -> None:
    """tight: max_queue 0. A held stream runs; a second request is refused (queue_full);
    the stream is dropped mid-decode (a decode cancellation)."""
    before = m(router)

    async def go() -> Samples:
        async with httpx.AsyncClient(base_url=router.url, timeout=30, headers=AUTH) as c:
            with router.hold():
                async with c.stream("POST", "/v1/completions",
                                    json={"model": "tight", "prompt": "x [hold@1]", "stream": True}) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()  # kept: a dropped iterator closes the stream
                    await anext(lines)
                    during = await asyncio.to_thread(m, router)
                    refused = await c.post("/v1/completions", json={"model": "tight", "prompt": "y"})
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
                # dropped: held until the router has seen it go (released sooner, on a busy machine
                # the generation could end before the router noticed, and nothing was cancelled)
                await asyncio.to_thread(router.wait_for, lambda: delta(
                    before, m(router), "modelyard_request_cancellations_total", model="tight", stage="decode") == 1,
                    what="decode cancellation")
            return during

    during = asyncio.run(go())
    assert value(during, "modelyard_num_requests_running", model="tight") == 1
    assert value(during, "modelyard_num_requests_waiting", model="tight") == 0
    assert value(during, "modelyard_slots_busy", model="tight") == 1
    assert value(during, "modelyard_model_state", model="tight", state="ready") == 1
    after = m(router)
    assert delta(before, after, "modelyard_rejections_total", model="tight", reason="queue_full") == 1
    assert delta(before, after, "modelyard_requests_total", model="tight", route="/v1/completions",
                 status="503") == 1
    assert delta(before, after, "modelyard_request_cancellations_total", model="tight", stage="queue") == 0
    router.wait_for(lambda: value(m(router), "modelyard_slots_busy", model="tight") == 0, what="slot free")


def test_cancellation_in_queue_and_in_prefill(router: LiveRouter) -> None:
    before = m(router)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=30, headers=AUTH) as c:
            with router.hold():
                # runs, held before its first token (prefill), and one waits behind it (max_queue 1)
                running = asyncio.create_task(c.post("/v1/completions", json={"model": "alpha", "prompt": "p [hold]"}))
                await router.until(lambda: len(admin(router, "alpha")["in_flight"]) == 1, what="running")
                waiting = asyncio.create_task(c.post("/v1/completions", json={"model": "alpha", "prompt": "w"}))
                await router.until(lambda: admin(router, "alpha")["queue_depth"] == 1, what="waiting")
                waiting.cancel()
                running.cancel()
                for t in (waiting, running):
                    with pytest.raises(asyncio.CancelledError):
                        await t

    asyncio.run(go())
    router.wait_for(lambda: (a := m(router)) and
                    delta(before, a, "modelyard_request_cancellations_total", model="alpha", stage="queue") == 1
                    and delta(before, a, "modelyard_request_cancellations_total", model="alpha",
                              stage="prefill") == 1, what="two cancellations")
    after = m(router)
    assert delta(before, after, "modelyard_request_cancellations_total", model="alpha", stage="decode") == 0
    assert delta(before, after, "modelyard_time_to_first_token_seconds_count", model="alpha") == 0


def test_crash_restart_and_load_failure_counters(router: LiveRouter) -> None:
    before = m(router)
    ok = httpx.post(router.url + "/v1/completions", json={"model": "crashy", "prompt": "a"}, headers=AUTH,
                    timeout=30)
    assert ok.status_code == 200
    crashed = httpx.post(router.url + "/v1/completions", json={"model": "crashy", "prompt": "a [crash]"},
                         headers=AUTH, timeout=30)
    assert crashed.status_code == 502
    router.wait_for(lambda: admin(router, "crashy")["state"] == "failed", what="crashy failed")
    mid = m(router)
    assert delta(before, mid, "modelyard_worker_crashes_total", model="crashy") == 1
    assert value(mid, "modelyard_model_state", model="crashy", state="failed") == 1
    assert value(mid, "modelyard_model_loaded", model="crashy") == 0
    again = httpx.post(router.url + "/v1/completions", json={"model": "crashy", "prompt": "b"}, headers=AUTH,
                       timeout=30)
    assert again.status_code == 200
    after = m(router)
    assert delta(before, after, "modelyard_worker_restarts_total", model="crashy") == 1
    assert delta(before, after, "modelyard_model_loads_total", model="crashy") == 2
    assert delta(before, after, "modelyard_requests_total", model="crashy", route="/v1/completions",
                 status="502") == 1

    r = httpx.post(router.url + "/v1/completions", json={"model": "broken", "prompt": "a"}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    after = m(router)
    assert delta(before, after, "modelyard_model_load_failures_total", model="broken") == 1
    assert delta(before, after, "modelyard_rejections_total", model="broken", reason="model_load_failed") == 1
    assert value(after, "modelyard_model_load_seconds_count", model="broken") == 0
