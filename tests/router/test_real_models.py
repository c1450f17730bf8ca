"""Acceptance against real workers (``python -m worker``) on SmolLM2-135M and Gemma 3 270M,
with the official ``openai`` SDK as the client and one live router for the module.

Extra config entries point at the same SmolLM2 file under other names so the
lifecycle tests start from a fresh (unloaded) model without restarting the router.
The module ends by SIGKILLing the router and checking its real workers exit by
themselves (they watch --parent-pid).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.router.conftest import GEMMA, LiveRouter, MODELS, ROOT, SMOLLM2, alive, router_fixture
from tests.router.metrics_util import delta, scrape, value
from tests.timing import report

pytestmark = [
    pytest.mark.slow,
]

CONFIG = f"""
[server]
models_dir = "{MODELS}"
[defaults]
n_ctx = 512
load_timeout_s = 300
[models.SmolLM2-135M-Instruct]
path = "{SMOLLM2.name}"
aliases = ["smollm2"]
[models.gemma-3-270m]
path = "{GEMMA.name}"
aliases = ["gemma3"]
chat_template = "gemma"
[models.smol-burst]
path = "{SMOLLM2.name}"
max_queue = 30
[models.smol-q2]
path = "{SMOLLM2.name}"
max_queue = 2
parallel = 2
[models.smol-kill]
path = "{SMOLLM2.name}"
restart_backoff_s = 2
[models.smol-kv]
path = "{SMOLLM2.name}"
kv_budget_mib = 10.0
[models.smol-stop]
path = "{SMOLLM2.name}"
ping_interval_s = 0.5
ping_timeout_s = 4.0
unresponsive_after_s = 1.0
restart_backoff_s = 0
"""

MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


router = router_fixture(CONFIG, real=True)


@pytest.fixture(scope="module")
def client(router: LiveRouter) -> openai.OpenAI:
    return router.client(timeout=300)


def test_chat_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0, max_tokens=12)  # type: ignore[arg-type]
    text = full.choices[0].message.content or ""
    assert text.strip() and full.usage is not None and full.usage.completion_tokens > 0
    assert full.model_extra and full.model_extra["timings"]["predicted_n"] == full.usage.completion_tokens
    roles, pieces = [], []
    for ch in client.chat.completions.create(model="smollm2", messages=MSG, temperature=0, max_tokens=12,  # type: ignore[arg-type]
                                             stream=True, stream_options={"include_usage": True}):
        assert ch.object == "chat.completion.chunk"
        for c in ch.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            pieces.append(c.delta.content or "")
    assert roles[:1] == ["assistant"]
    assert "".join(pieces) == text


def test_completions_streamed_and_not_on_gemma(client: openai.OpenAI) -> None:
    out = client.completions.create(model="gemma3", prompt="The capital of France is", temperature=0, max_tokens=8)
    assert out.choices[0].text.strip() and out.usage is not None and out.usage.prompt_tokens > 0
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="gemma3", prompt="The capital of France is", temperature=0, max_tokens=8, stream=True) if ch.choices)
    assert streamed == out.choices[0].text


def test_two_models_at_once(router: LiveRouter, client: openai.OpenAI) -> None:
    results: dict[str, str] = {}

    def ask(model: str) -> None:
        r = client.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=12)  # type: ignore[arg-type]
        results[model] = r.choices[0].message.content or ""

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("smollm2", "gemma3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results.get(m) for m in ("smollm2", "gemma3")), results
    pids = {router.admin(m)["pid"] for m in ("SmolLM2-135M-Instruct", "gemma-3-270m")}
    assert len(pids) == 2 and None not in pids


def test_native_completion_probabilities(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/completion", json={
        "model": "smollm2", "prompt": "Hello, my name is", "n_predict": 6, "n_probs": 3, "temperature": 0,
        "return_tokens": True}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    probs = body["completion_probabilities"]
    assert len(probs) == len(body["tokens"]) == body["timings"]["predicted_n"]
    for p, tid in zip(probs, body["tokens"]):
        assert p["id"] == tid and len(p["top_logprobs"]) == 3
        assert p["top_logprobs"][0]["id"] == tid  # greedy: the chosen token is the most likely


def test_native_completion_reports_the_end_of_generation_token(router: LiveRouter) -> None:
    # llama.cpp lists the EOG token like any other: in tokens, as one stream chunk (content ""),
    # and in completion_probabilities with its probability (raw distribution)
    eos = httpx.post(router.url + "/tokenize", json={"model": "smollm2", "content": "<|im_end|>",
                                                     "add_special": False}, timeout=300).json()["tokens"]
    assert len(eos) == 1
    body = {"model": "smollm2", "prompt": "Hello", "n_predict": 4, "n_probs": 2, "temperature": 0,
            "return_tokens": True, "logit_bias": [[eos[0], 100.0]]}  # the first token is forced to be EOG
    r = httpx.post(router.url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_type"] == "eos" and out["content"] == "" and out["tokens"] == eos
    assert out["tokens_predicted"] == 1
    (p,) = out["completion_probabilities"]
    assert p["id"] == eos[0] and p["token"] == "" and p["bytes"] == [] and len(p["top_logprobs"]) == 2
    assert p["logprob"] <= 0.0
    chunks = []
    with httpx.stream("POST", router.url + "/completion", json={**body, "stream": True}, timeout=300) as rs:
        for line in rs.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert [c["stop"] for c in chunks] == [False, True]
    assert chunks[0]["tokens"] == eos and chunks[0]["content"] == ""
    assert chunks[0]["completion_probabilities"] == out["completion_probabilities"]


def test_burst_of_20_first_requests_spawns_one_worker(router: LiveRouter) -> None:
    assert router.admin("smol-burst")["state"] == "unloaded"

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=300) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "model": "smol-burst", "prompt": f"Count: {i}", "max_tokens": 1}) for i in range(20)))

    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * 20
    st = router.admin("smol-burst")
    assert st["spawn_count"] == 1 and st["state"] == "ready"
    kids = [p for p in router.workers() if "smol-burst" in p.cmdline()]
    assert len(kids) == 1
    httpx.post(router.url + "/admin/models/unload", json={"model": "smol-burst"}, timeout=60).raise_for_status()


def test_request_beyond_parallel_plus_max_queue_gets_503(router: LiveRouter) -> None:
    """parallel = 2 slots running + max_queue = 2 waiting are admitted; the 5th gets 503 at once."""
    httpx.post(router.url + "/admin/models/load", json={"model": "smol-q2"}, timeout=300).raise_for_status()

    def occupied() -> bool:
        st = router.admin("smol-q2")
        return (len(st["in_flight"]) == 2 and st["queue_depth"] == 2
                and st["slots_total"] == 2 and st["slots_busy"] == 2)

    async def go() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=router.url, timeout=300) as c:
            # long enough that the first is still running when the 4th arrives: admission is
            # checked against the observed state (2 running + 2 waiting), never a sleep
            body = {"model": "smol-q2", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
            first = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(4)]
            await asyncio.to_thread(router.wait_for, occupied, 60, "2 running + 2 waiting")
            t0 = time.monotonic()
            fourth = await c.post("/v1/completions", json={**body, "max_tokens": 1})
            dt = time.monotonic() - t0
            # "at once": answered while the same four still hold the model, not after a slot freed
            assert await asyncio.to_thread(occupied)
            for t in first:  # the four need not run to the end; leaving cancels them
                t.cancel()
            await asyncio.gather(*first, return_exceptions=True)
            return [fourth], dt

    rs, dt = asyncio.run(go())
    assert rs[0].status_code == 503
    assert rs[0].headers["retry-after"] and rs[0].json()["error"]["code"] == "queue_full"
    report("[real] 5th request with parallel 2 + max_queue 2 -> 503", dt, 1.0)
    router.wait_for(lambda: router.admin("smol-q2")["in_flight"] == [] and router.admin("smol-q2")["queue_depth"] == 0,
                    timeout=60, what="the four cancelled requests gone")
    httpx.post(router.url + "/admin/models/unload", json={"model": "smol-q2"}, timeout=60).raise_for_status()


def test_disconnect_mid_stream_frees_the_worker(router: LiveRouter, client: openai.OpenAI) -> None:
    """The client leaving cancels the generation on the worker: the slot is freed by the
    worker's answer to Cancel, not by killing it (same pid, nothing killed as hung)."""
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=1)  # loaded
    before = router.admin("SmolLM2-135M-Instruct")
    stream = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=400, stream=True,  # type: ignore[arg-type]
                                            extra_body={"ignore_eos": True})
    got = 0
    for ch in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    t_close = time.monotonic()
    router.wait_for(lambda: router.admin("SmolLM2-135M-Instruct")["in_flight"] == [], timeout=30, what="worker free")
    freed = time.monotonic() - t_close
    t0 = time.monotonic()
    first_token_at = None
    for ch in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=2, stream=True):
        if ch.choices and ch.choices[0].delta.content and first_token_at is None:
            first_token_at = time.monotonic()
    assert first_token_at is not None
    dt = first_token_at - t0
    report("[real] client closed its stream -> worker free", freed, 1.0)
    report("[real] next request -> first token", dt, 2.0)
    after = router.admin("SmolLM2-135M-Instruct")
    assert after["in_flight"] == [] and after["state"] == "ready"
    assert after["pid"] == before["pid"] and after["spawn_count"] == before["spawn_count"]
    assert after["failures"]["count"] == before["failures"]["count"]
    assert "hung" not in router.log_path.read_text(errors="replace")  # no Cancel went unanswered


@pytest.mark.reliability
def test_sigkill_worker_mid_stream(router: LiveRouter) -> None:
    httpx.post(router.url + "/admin/models/load", json={"model": "smol-kill"}, timeout=300).raise_for_status()
    pid = router.admin("smol-kill")["pid"]
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=300, json={
            "model": "smol-kill", "messages": MSG, "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    os.kill(pid, signal.SIGKILL)
    assert "error" in events[-1] and events[-1]["error"]["code"] == "worker_crashed"
    st = router.admin("smol-kill")
    assert st["condition"] == "crashed" and st["failures"]["last"]["signal"] == "SIGKILL"
    assert st["failures"]["last"]["exit_code"] == -9 and st["failures"]["crashes"] == 1
    # crash backoff: 503 with the remaining wait (restart_backoff_s = 2) until it has passed
    r = httpx.post(router.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smol-kill", "messages": MSG, "max_tokens": 2})
    if r.status_code == 503:  # (a very slow machine may already be past the 2 s)
        assert r.json()["error"]["code"] == "restart_backoff" and 1 <= int(r.headers["retry-after"]) <= 2
    router.wait_for(lambda: router.admin("smol-kill")["failures"]["restart_in_s"] == 0, what="backoff over")
    assert router.admin("smol-kill")["pid"] is None  # nothing restarted it meanwhile
    out = router.client(timeout=300).chat.completions.create(model="smol-kill", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    assert out.choices[0].message.content
    assert router.admin("smol-kill")["pid"] != pid
    httpx.post(router.url + "/admin/models/unload", json={"model": "smol-kill"}, timeout=60).raise_for_status()


def test_unload_while_running_lets_it_finish(router: LiveRouter) -> None:
    httpx.post(router.url + "/admin/models/load", json={"model": "gemma3"}, timeout=300).raise_for_status()
    result: dict[str, httpx.Response] = {}

    def unload() -> None:
        result["unload"] = httpx.post(router.url + "/admin/models/unload", json={"model": "gemma3"}, timeout=300)

    texts, finish, n = [], None, 0
    with httpx.stream("POST", router.url + "/v1/completions", timeout=300, json={
            "model": "gemma3", "prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True,
            "stream": True}) as r:
        t = threading.Thread(target=unload)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                assert "error" not in d, d
                n += 1
                if n == 2:
                    t.start()
                texts.append(d["choices"][0]["text"])
                finish = d["choices"][0]["finish_reason"] or finish
    t.join()
    assert finish == "length" and "".join(texts)
    assert result["unload"].status_code == 200 and router.admin("gemma-3-270m")["state"] == "unloaded"


def test_malformed_bodies_and_context_overflow(router: LiveRouter, client: openai.OpenAI) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "smollm2", "messages": "hi"}, timeout=30)
    assert r.status_code == 400
    # a max_tokens beyond the room the prompt leaves is clamped to it (llama.cpp's behaviour) ...
    out = client.completions.create(model="smollm2", prompt=[28] * 506, max_tokens=5000, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage is not None
    assert out.usage.completion_tokens == 512 - 506
    # ... while a prompt that does not fit by itself stays a 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="word " * 2000, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 600}],
                                       max_tokens=5000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_huge_seed_is_400_and_the_real_worker_keeps_serving(router: LiveRouter) -> None:
    body = {"model": "smollm2", "messages": MSG, "max_tokens": 2}
    r = httpx.post(router.url + "/v1/chat/completions", json={**body, "seed": 2**64 - 1}, timeout=300)
    assert r.status_code == 200, r.text  # the largest seed the protocol carries works end to end
    pid = router.admin("SmolLM2-135M-Instruct")["pid"]
    for bad in ({**body, "seed": 2**64}, {**body, "top_k": 2**64}, {**body, "stream": True, "seed": 2**64}):
        r = httpx.post(router.url + "/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("seed", "top_k"), r.text
    r = httpx.post(router.url + "/detokenize", json={"model": "smollm2", "tokens": [18446744073709551616000]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert router.admin("SmolLM2-135M-Instruct")["pid"] == pid


def test_props_slots_and_metrics_after_real_requests(router: LiveRouter) -> None:
    """A llama-server client's reads (props, slots) and /metrics against the real worker:
    counters move by exactly what the answers report."""
    props = httpx.get(router.url + "/props", params={"model": "smollm2"}, timeout=300).json()
    assert props["total_slots"] >= 1 and props["default_generation_settings"]["n_ctx"] == 512
    assert props["model_path"] == f".../{SMOLLM2.name}"
    assert "<|im_start|>" in props["chat_template"]  # the GGUF's own, read from its header
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    slots = httpx.get(router.url + "/slots", params={"model": "smollm2"}, timeout=60).json()
    assert len(slots) == props["total_slots"] and not any(s["is_processing"] for s in slots)

    with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=300, json={
            "model": "smollm2", "messages": MSG, "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        # The opening chunk (role only) is sent as soon as the worker accepts the request, which
        # can be before the scheduler has given it a slot; a token chunk proves the slot is busy.
        chunks = (json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: "))
        first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
        busy = httpx.get(router.url + "/slots", params={"model": "smollm2"}, timeout=60).json()
        assert [s["id_task"] for s in busy if s["is_processing"]] == [first["id"]]
    router.wait_for(lambda: not any(s["is_processing"] for s in httpx.get(
        router.url + "/slots", params={"model": "smollm2"}, timeout=60).json()), what="slot idle")

    before = scrape(router.url)
    outs = [httpx.post(router.url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "messages": MSG, "temperature": 0, "max_tokens": n}).json() for n in (5, 9, 9)]
    native = httpx.post(router.url + "/completion", timeout=300, json={
        "model": "smollm2", "prompt": "The sky is", "n_predict": 6, "temperature": 0}).json()
    after = scrape(router.url)
    prompt = sum(o["usage"]["prompt_tokens"] for o in outs) + native["tokens_evaluated"]
    cached = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs) + native["timings"]["cache_n"]
    generated = sum(o["usage"]["completion_tokens"] for o in outs) + native["tokens_predicted"]
    model = "SmolLM2-135M-Instruct"
    assert delta(before, after, "modelyard_prompt_tokens_total", model=model) == prompt
    assert delta(before, after, "modelyard_prompt_tokens_cached_total", model=model) == cached
    assert cached > 0  # the same conversation again: its prefix comes from the KV cache
    assert delta(before, after, "modelyard_generation_tokens_total", model=model) == generated
    assert delta(before, after, "modelyard_requests_total", model=model, route="/v1/chat/completions",
                 status="200") == 3
    assert delta(before, after, "modelyard_requests_total", model=model, route="/completion", status="200") == 1
    assert delta(before, after, "modelyard_time_to_first_token_seconds_count", model=model) == 4
    assert delta(before, after, "modelyard_e2e_request_latency_seconds_count", model=model) == 4
    assert delta(before, after, "modelyard_inter_token_latency_seconds_count", model=model) == generated - 4
    assert value(after, "modelyard_model_state", model=model, state="ready") == 1
    assert value(after, "modelyard_slots_total", model=model) == props["total_slots"]
    assert value(after, "modelyard_request_cancellations_total", model=model, stage="decode") >= 1


def test_tcp_transport_with_curve_gives_the_same_answer(router: LiveRouter, tmp_path: Path) -> None:
    """transport = "tcp": the real worker takes its CURVE keys and secret from the pipe, connects,
    and answers exactly as over ipc (temperature 0)."""
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    want = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
    assert want.status_code == 200, want.text
    cfg = CONFIG.replace("[server]\n", '[server]\ntransport = "tcp"\n', 1)
    r = LiveRouter(tmp_path, cfg, real=True)
    try:
        got = httpx.post(r.url + "/v1/completions", json=body, timeout=300)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        info = r.admin("SmolLM2-135M-Instruct")
        assert info["state"] == "ready" and info["refused_peers"] == 0
    finally:
        r.stop(timeout=60)
        r.kill()


def test_request_beyond_the_kv_budget_is_a_400_and_the_model_serves_on(router: LiveRouter) -> None:
    """kv_budget_mib = 10 holds ~227 SmolLM2 tokens: prompt + max_tokens beyond it is a clear 400
    before any token; the same worker then serves a request that fits."""
    body = {"model": "smol-kv", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_budget_exceeded" and "KV budget" in err["message"]
    pid = router.admin("smol-kv")["pid"]
    ok = httpx.post(router.url + "/v1/completions", json={**body, "max_tokens": 8}, timeout=300)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert router.admin("smol-kv")["pid"] == pid  # the same worker: nothing crashed
    httpx.post(router.url + "/admin/models/unload", json={"model": "smol-kv"}, timeout=60).raise_for_status()


def test_n_choices_through_the_sdk_streamed_and_not(client: openai.OpenAI) -> None:
    """n = 3 at temperature 0: three choices (index 0..2) from one prefilled prompt, each equal to
    the n = 1 answer, streamed == non-streamed; usage counts every choice's tokens."""
    one = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    three = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0, n=3)  # type: ignore[arg-type]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)
    assert all(c.finish_reason == one.choices[0].finish_reason for c in three.choices)
    assert three.usage is not None and one.usage is not None
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    texts = {0: "", 1: "", 2: ""}
    finish = {}
    for ch in client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                             n=3, stream=True):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {i: three.choices[i].message.content for i in range(3)}
    assert finish == {i: three.choices[i].finish_reason for i in range(3)}
    seeded = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, n=2,
                                       temperature=1.0, seed=11)
    assert [c.index for c in seeded.choices] == [0, 1] and seeded.usage is not None
    assert seeded.usage.completion_tokens == 16
    streamed = {0: "", 1: ""}
    for ch in client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, n=2,
                                        temperature=1.0, seed=11, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == {0: seeded.choices[0].text, 1: seeded.choices[1].text}


@pytest.mark.reliability
def test_count_tokens_beyond_the_context_is_a_count(router: LiveRouter) -> None:
    """Issue 23: count_tokens with 500 tools (~31k tokens, n_ctx 512) was a 400
    context_length_exceeded; a count is bounded by the body limit, not the context. Within the
    context the count is the generation's own (exact); beyond it, the worker renders the same
    template with the same tools and tokenizes it — so the counts grow with the tools."""
    def count(n_tools: int) -> int:
        tools = [{"name": f"tool_{i}", "description": f"does thing {i} with some words",
                  "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}
                 for i in range(n_tools)]
        r = httpx.post(router.url + "/v1/messages/count_tokens", timeout=300,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": tools})
        assert r.status_code == 200, r.text
        return int(r.json()["input_tokens"])

    one, fifty, five_hundred = count(1), count(50), count(500)
    assert one < 512 < fifty < five_hundred
    per_tool = (five_hundred - fifty) / 450  # counted by rendering + tokenizing (beyond the context)
    assert abs((fifty - one) / 49 - per_tool) < 0.1 * per_tool  # as the generation path counts a tool


# ----------------------------------------------------------------------------- reliability (issue 11)


def _rss(pid: int | None) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss) if pid else 0
    except psutil.Error:
        return 0


@pytest.mark.reliability
def test_three_7mb_tokenize_calls_never_pause_a_stream_on_the_same_model(router: LiveRouter) -> None:
    """Tokenizing happens off the worker's socket thread: a stream on the same model keeps
    flowing (the largest gap between its tokens is reported; the probe saw 26 s) and the
    worker is neither killed nor marked unresponsive."""
    name = "SmolLM2-135M-Instruct"
    httpx.post(router.url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1},
               timeout=300).raise_for_status()
    before = router.admin(name)
    rss0 = (_rss(before["pid"]), _rss(router.proc.pid))
    text = ("The quick brown fox jumps over the lazy dog; 12345 tokens, s'il vous plaît. " * 100_000)[:7_000_000]
    done = threading.Event()
    gaps: list[float] = []
    streams = [0]

    def stream_until_done() -> None:
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}
        while not done.is_set():
            last = None
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=600) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    assert "error" not in line, line
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if done.is_set():
                        break
            streams[0] += 1

    streamer = threading.Thread(target=stream_until_done, daemon=True)
    streamer.start()
    router.wait_for(lambda: router.admin(name)["in_flight"], what="the stream running")
    lag0 = scrape(router.url)

    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=900) as c:
            return list(await asyncio.gather(*(c.post("/tokenize", json={"model": name, "content": text})
                                               for _ in range(3))))

    t0 = time.monotonic()
    try:
        rs = asyncio.run(three())
    finally:
        took = time.monotonic() - t0
        done.set()
        streamer.join(600)
    lag1 = scrape(router.url)
    assert all(r.status_code == 200 for r in rs), [r.text[:200] for r in rs]
    n = [len(r.json()["tokens"]) for r in rs]
    assert n[0] > 1_000_000 and n == [n[0]] * 3
    del rs
    after = router.admin(name)
    assert after["pid"] == before["pid"] and after["state"] == "ready"
    assert after["failures"]["count"] == before["failures"]["count"]
    assert gaps, "the stream produced tokens while the tokenize calls ran"
    rss1 = (_rss(after["pid"]), _rss(router.proc.pid))
    print(f"\n[real] 3 x 7 MB /tokenize took {took:.1f} s; stream gaps: max {max(gaps) * 1000:.0f} ms over "
          f"{len(gaps)} tokens in {streams[0]} stream(s); RSS worker {rss0[0] >> 20} -> {rss1[0] >> 20} MiB, "
          f"router {rss0[1] >> 20} -> {rss1[1] >> 20} MiB")
    report("[real] largest pause of a stream during 3 x 7 MB /tokenize", max(gaps), 1.0)
    # the router's event loop: the smallest lag-histogram bound that holds every lag seen meanwhile
    n_lags = delta(lag0, lag1, "modelyard_event_loop_lag_seconds_count")
    bounds = sorted((float(le), le) for k in lag1 if k[0] == "modelyard_event_loop_lag_seconds_bucket"
                    for le in (dict(k[1])["le"],))
    worst = next(b for b, le in bounds if delta(lag0, lag1, "modelyard_event_loop_lag_seconds_bucket", le=le) >= n_lags)
    assert n_lags > 0, "the loop-lag probe ran during the calls"
    report(f"[real] longest router event-loop lag during 3 x 7 MB /tokenize (upper bound, {n_lags:.0f} probes)",
           worst, 0.05)


@pytest.mark.reliability
def test_concurrent_clients_across_both_models_lose_and_mix_nothing(router: LiveRouter) -> None:
    """N clients at once on both real models, half of them streaming: every request is
    answered (0 lost, 0 hung: each within its timeout), each temperature-0 text equals the
    same request run alone (0 mixed), and every overflow is a 503 queue_full with Retry-After.

    The references run alone with ``cache_prompt: false`` (evaluated from position 0); the
    concurrent requests keep the default ``cache_prompt: true``, so they also reuse one another's
    prefixes as they come: a repeat re-evaluates from where llama-server would (Gemma, a
    sliding-window model: from its context checkpoint 5 tokens before the end, as 1 + 4 rows;
    SmolLM2: the last token), which gives these prompts the same bits as a fresh evaluation."""
    models = ["SmolLM2-135M-Instruct", "gemma-3-270m"]
    prompts = [f"Item {i}: the colour of the sky is" for i in range(4)]
    solo: dict[tuple[str, str], str] = {}
    for m in models:
        for p in prompts:
            r = httpx.post(router.url + "/v1/completions", timeout=300,
                           json={"model": m, "prompt": p, "max_tokens": 5, "temperature": 0, "cache_prompt": False})
            assert r.status_code == 200, r.text
            solo[(m, p)] = r.json()["choices"][0]["text"]

    async def one(c: httpx.AsyncClient, m: str, p: str, stream: bool) -> tuple[str, str, int, str, str | None]:
        body = {"model": m, "prompt": p, "max_tokens": 5, "temperature": 0, "stream": stream}
        if not stream:
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                return m, p, r.status_code, r.text, r.headers.get("retry-after")
            return m, p, 200, r.json()["choices"][0]["text"], None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return m, p, r.status_code, r.text, r.headers.get("retry-after")
            out = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    out += ev["choices"][0]["text"]
            return m, p, 200, out, None

    async def load() -> list[tuple[str, str, int, str, str | None]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as c:
            jobs = [one(c, m, p, stream=(k % 2 == 1)) for k in range(2) for m in models for p in prompts
                    for _ in range(2)]
            return list(await asyncio.gather(*jobs))

    results = asyncio.run(load())
    assert len(results) == 32
    mixed = [(m, p, text) for m, p, code, text, _ in results if code == 200 and text != solo[(m, p)]]
    assert mixed == []
    overflow = [(code, text, ra) for _, _, code, text, ra in results if code != 200]
    for code, text, ra in overflow:
        assert code == 503 and json.loads(text)["error"]["code"] == "queue_full" and ra, (code, text, ra)
    print(f"\n[real] 32 concurrent clients on 2 models: {32 - len(overflow)} answered identically to alone, "
          f"{len(overflow)} overflow 503 with Retry-After, 0 lost")
    for m in models:
        router.wait_for(lambda m=m: router.admin(m)["in_flight"] == [] and router.admin(m)["queue_depth"] == 0,
                        timeout=60, what=f"{m} idle")


@pytest.mark.reliability
def test_sigstop_of_a_real_worker_mid_stream(router: LiveRouter) -> None:
    """SIGSTOP mid-stream: unresponsive within unresponsive_after_s of its last token (the
    blackout is reported), the waiting request waits, the worker is killed at ping_timeout_s
    (the stream gets the error event) and the waiting request runs on the restarted worker."""
    httpx.post(router.url + "/admin/models/load", json={"model": "smol-stop"}, timeout=300).raise_for_status()
    pid = router.admin("smol-stop")["pid"]
    events: list[dict[str, Any]] = []
    stopped_at = [0.0]

    def run() -> None:
        with httpx.stream("POST", router.url + "/v1/completions", timeout=300, json={
                "model": "smol-stop", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        os.kill(pid, signal.SIGSTOP)
                        stopped_at[0] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    router.wait_for(lambda: stopped_at[0], what="SIGSTOP sent")
    router.wait_for(lambda: router.admin("smol-stop")["state"] == "unresponsive", what="unresponsive")
    blackout = time.monotonic() - stopped_at[0]
    # a request arriving now is not handed to the silent worker (it has free slots): it waits
    waiting: list[httpx.Response] = []
    w = threading.Thread(target=lambda: waiting.append(httpx.post(router.url + "/v1/completions", timeout=300, json={
        "model": "smol-stop", "prompt": "Hello", "max_tokens": 3, "temperature": 0})), daemon=True)
    w.start()
    router.wait_for(lambda: router.admin("smol-stop")["queue_depth"] == 1, what="the request waiting")
    t.join(120)
    w.join(300)
    assert events[-1]["error"]["code"] == "worker_crashed" and "hung" in events[-1]["error"]["message"]
    assert waiting and waiting[0].status_code == 200, waiting[0].text if waiting else "no answer"
    assert router.admin("smol-stop")["pid"] not in (None, pid)
    print(f"\n[real] SIGSTOP -> unresponsive in {blackout:.2f} s (unresponsive_after_s = 1)")
    httpx.post(router.url + "/admin/models/unload", json={"model": "smol-stop"}, timeout=60).raise_for_status()


@pytest.mark.reliability
def test_router_sigkill_leaves_no_orphan_workers(router: LiveRouter) -> None:
    client = router.client(timeout=300)
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=1)
    workers = router.workers()
    assert workers
    os.kill(router.proc.pid, signal.SIGKILL)
    router.proc.wait(10)
    t0 = time.monotonic()
    while alive(workers) and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert alive(workers) == [], [p.cmdline() for p in alive(workers)]
    print(f"\n[real] workers exited {time.monotonic() - t0:.2f} s after the router was SIGKILLed")
    assert not psutil.pid_exists(router.proc.pid)
