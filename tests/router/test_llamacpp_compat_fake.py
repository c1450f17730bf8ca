"""A drop-in for llama-server's clients (issue 28), each item written against what llama-server
documents and does (tools/server/README.md and server.cpp's routes table), with fake workers
in this process (tests/router/inproc.py). Waiting is on observed state only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from router.config import ConfigError, parse_config
from tests.router.inproc import InProc, chat


def config(models: str = "a", server: list[str] | None = None, extra: dict[str, list[str]] | None = None) -> str:
    lines = ["[server]", 'models_dir = "."', *(server or []), "[defaults]", "ping_interval_s = 0"]
    for m in models:
        lines += [f"[models.{m}]", 'path = "m.gguf"', *(extra or {}).get(m, [])]
    return "\n".join(lines) + "\n"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- 1. routes


def test_openai_routes_without_v1_and_chat_input_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server serves /chat/completions, /responses and /responses/input_tokens beside their
    /v1 forms, /chat/completions/input_tokens (with and without /v1) and /v1/health."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/chat/completions", json=chat("a"))
            assert r.status_code == 200, r.text
            assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["content"]
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
                r = await c.post(path, json=chat("a"))
                assert r.status_code == 200, r.text
                assert r.json() == {"object": "chat.completion.input_tokens", "input_tokens": prompt_tokens}
            longer = await c.post("/chat/completions/input_tokens", json=chat("a", "hi there, a longer one"))
            assert longer.json()["input_tokens"] > prompt_tokens
            # a bad body is the same 400 as on the generation route
            r = await c.post("/chat/completions/input_tokens", json={"model": "a", "messages": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = await c.post("/responses", json={"model": "a", "input": "hi", "max_output_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["object"] == "response" and r.json()["status"] in ("completed", "incomplete")
            r2 = await c.post("/responses/input_tokens", json={"model": "a", "input": "hi"})
            assert r2.status_code == 200 and r2.json()["input_tokens"] == r.json()["usage"]["input_tokens"]
            r = await c.get("/v1/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            # streaming works there too (the same handler)
            async with c.stream("POST", "/chat/completions", json=chat("a", stream=True)) as s:
                body = (await s.aread()).decode()
            assert s.status_code == 200 and body.rstrip().endswith("data: [DONE]")

    run(go())


def test_v1_health_is_public_like_health(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a", ['api_key = "k"'])) as (_, c):
            assert (await c.get("/v1/health")).status_code == 200
            r = await c.post("/chat/completions", json=chat("a"))
            assert r.status_code == 401
            r = await c.post("/chat/completions", json=chat("a"), headers={"Authorization": "Bearer k"})
            assert r.status_code == 200

    run(go())


# ----------------------------------------------------------------------------- 2. default model


def test_one_configured_model_serves_requests_without_model(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    no_model = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/v1/chat/completions", json=no_model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "a"
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": ""})
            assert r.status_code == 200 and r.json()["model"] == "a"
            r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "a"
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 2})
            assert r.status_code == 200 and r.json()["model"] == "a"
            r = await c.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["model"] == "a"

    run(go())


def test_several_models_need_model_unless_a_default_is_set(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    no_model = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def go() -> None:
        async with env.app(config("ab")) as (_, c):
            r = await c.post("/v1/chat/completions", json=no_model)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "available models: a, b" in r.json()["error"]["message"]
        async with env.app(config("ab", ['default_model = "bee"'], {"b": ['aliases = ["bee"]']})) as (pool, c):
            r = await c.post("/v1/chat/completions", json=no_model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "bee"
            assert pool.get("a").state.value == "unloaded"  # b served it, a was never started
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "bee"
            # a named model still wins
            r = await c.post("/v1/chat/completions", json={**no_model, "model": "a"})
            assert r.status_code == 200 and r.json()["model"] == "a"

    run(go())


def test_default_model_must_be_configured(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    import tomllib
    with pytest.raises(ConfigError) as e:
        parse_config(tomllib.loads(config("ab", ['default_model = "c"'])), base_dir=tmp_path)
    assert e.value.key == "server.default_model" and "'c'" in str(e.value)


# ----------------------------------------------------------------------------- 5. error types


def test_a_wrong_key_is_an_authentication_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server: 401 {"error": {"message": "Invalid API Key", "type": "authentication_error"}}."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a", ['api_key = "k"'])) as (_, c):
            for path, body in (("/v1/chat/completions", chat("a")), ("/completion", {"prompt": "hi"}),
                               ("/chat/completions", chat("a"))):
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    r = await c.post(path, json=body, headers=headers)
                    assert r.status_code == 401, r.text
                    err = r.json()["error"]
                    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            r = await c.post("/v1/messages", json={"model": "a", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]},
                             headers={"x-api-key": "wrong"})
            assert r.status_code == 401 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"

    run(go())


def test_an_over_long_prompt_is_exceed_context_size_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server: 400 {"error": {"type": "exceed_context_size_error", "message": "request (N tokens)
    exceeds the available context size (M tokens), try increasing it", "n_prompt_tokens": N,
    "n_ctx": M}} on its OpenAI and native routes (OpenAI's code and wording ride along)."""
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"*": {"n_ctx": 64}})
    words = " ".join(f"w{i}" for i in range(100))

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            cases = [("/v1/chat/completions", chat("a", words)), ("/chat/completions", chat("a", words, stream=True)),
                     ("/v1/completions", {"model": "a", "prompt": words}),
                     ("/completion", {"prompt": words, "n_predict": 4})]
            for path, body in cases:
                r = await c.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                err = r.json()["error"]
                assert err["type"] == "exceed_context_size_error", err
                assert err["n_ctx"] == 64 and err["n_prompt_tokens"] >= 100, err
                assert err["message"].startswith(f"request ({err['n_prompt_tokens']} tokens) exceeds the available "
                                                 "context size (64 tokens), try increasing it")
                assert "maximum context length" in err["message"] and err["code"] == "context_length_exceeded"
            # the Messages API answers in Anthropic's own shape, without llama.cpp's fields
            r = await c.post("/v1/messages", json={"model": "a", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": words}]})
            assert r.status_code == 400 and r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "invalid_request_error" and "n_ctx" not in r.json()["error"]

    run(go())


# ----------------------------------------------------------------------------- 6. metrics


def _sample(text: str, name: str, model: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for {model} not in:\n{text}")


def test_llamacpp_metric_names_and_process_start_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's /metrics families (README "GET /metrics") by their names, per model, and its
    Process-Start-Time-Unix header."""
    import time

    import psutil
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("ab")) as (_, c):
            r = await c.get("/metrics")
            t = r.text
            start = int(r.headers["Process-Start-Time-Unix"])
            # psutil derives create_time from the boot time, which moves when the VM clock is stepped
            # (31 s seen in CI): the header is read once at start, so compare within a bound
            assert abs(start - psutil.Process().create_time()) <= 120 and start <= time.time()
            for name in ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                         "tokens_predicted_seconds_total", "n_tokens_max", "prompt_tokens_seconds",
                         "predicted_tokens_seconds", "requests_processing", "requests_deferred",
                         "kv_cache_usage_ratio", "kv_cache_tokens", "n_decode_total", "n_busy_slots_per_decode"):
                assert f"# HELP llamacpp:{name} " in t, name
                assert _sample(t, f"llamacpp:{name}", "a") == 0.0
            r1 = await c.post("/v1/chat/completions", json=chat("a", "one two three", max_tokens=5))
            r2 = await c.post("/completion", json={"model": "a", "prompt": "four five", "n_predict": 3})
            assert r1.status_code == r2.status_code == 200
            t = (await c.get("/metrics")).text
            u1, u2 = r1.json()["usage"], r2.json()
            assert _sample(t, "llamacpp:prompt_tokens_total", "a") == u1["prompt_tokens"] + u2["tokens_evaluated"]
            assert _sample(t, "llamacpp:tokens_predicted_total", "a") == u1["completion_tokens"] + 3
            assert _sample(t, "llamacpp:n_tokens_max", "a") == max(u1["total_tokens"], u2["tokens_evaluated"] + 3)
            assert _sample(t, "llamacpp:prompt_seconds_total", "a") > 0
            assert _sample(t, "llamacpp:predicted_tokens_seconds", "a") > 0  # over the window since the last scrape
            assert _sample(t, "llamacpp:tokens_predicted_total", "b") == 0
            t = (await c.get("/metrics")).text  # nothing ran since: the window is empty again, totals stay
            assert _sample(t, "llamacpp:predicted_tokens_seconds", "a") == 0
            assert _sample(t, "llamacpp:tokens_predicted_total", "a") == u1["completion_tokens"] + 3

    run(go())


def test_decode_calls_and_busy_slots_per_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's ``llamacpp:n_decode_total`` (llama_decode calls) and
    ``llamacpp:n_busy_slots_per_decode`` (busy slots summed over those calls / the calls), from
    the workers' Pongs (the fake: a prefill is one call, each token one more). The counter
    goes on across a worker's restart (the new worker's totals add to the old one's)."""
    from tests.router.inproc import until
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"max_jobs": 2}})

    async def go() -> None:
        async with env.app(config("a", extra={"a": ["parallel = 2"]})) as (_, c):
            r = await c.post("/completion", json={"model": "a", "prompt": "alone [len=3]", "n_predict": 3})
            assert r.status_code == 200, r.text
            t = (await c.get("/metrics")).text
            assert _sample(t, "llamacpp:n_decode_total", "a") == 4  # the prefill and 3 tokens
            assert _sample(t, "llamacpp:n_busy_slots_per_decode", "a") == 1.0
            # two at once: both hold their slot while each waits after its first token
            with env.hold():
                reqs = [asyncio.ensure_future(c.post("/completion", json={
                    "model": "a", "prompt": f"pair {i} [len=3] [hold@1]", "n_predict": 3})) for i in range(2)]
                await until(lambda: len([ln for ln in env.fake_log.read_text().splitlines()
                                         if '"first_token"' in ln]) >= 3, "both first tokens")
            assert all(r.status_code == 200 for r in await asyncio.gather(*reqs))
            t = (await c.get("/metrics")).text
            assert _sample(t, "llamacpp:n_decode_total", "a") == 12
            per = _sample(t, "llamacpp:n_busy_slots_per_decode", "a")
            assert 1.0 < per < 2.0  # the pair's calls saw 2 busy slots, at least until one of them ended
            r = await c.post("/admin/models/unload", json={"model": "a"})
            assert r.status_code == 200, r.text
            r = await c.post("/completion", json={"model": "a", "prompt": "again [len=2]", "n_predict": 2})
            assert r.status_code == 200, r.text
            t = (await c.get("/metrics")).text
            assert _sample(t, "llamacpp:n_decode_total", "a") == 15  # 12 + the new worker's 3

    run(go())


# ----------------------------------------------------------------------------- 4. /completion's answer


def _generates(env: InProc) -> list[dict[str, Any]]:
    import json
    if not env.fake_log.exists():  # nothing generated yet
        return []
    return [e for e in map(json.loads, env.fake_log.read_text().splitlines()) if e["event"] == "generate"]


def test_completion_answers_its_generation_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's /completion answer (and its last stream chunk) carries ``generation_settings``:
    the parameters the request ran with, by llama.cpp's names."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a", extra={"a": ["top_p = 0.5"]})) as (_, c):
            body = {"prompt": "one two", "n_predict": 3, "temperature": 0.25, "top_k": 7, "seed": 42,
                    "stop": ["zz"], "logit_bias": [[15, False]], "n_probs": 2}
            r = await c.post("/completion", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            gs = out["generation_settings"]
            assert gs["n_predict"] == gs["max_tokens"] == 3 and gs["temperature"] == 0.25 and gs["top_k"] == 7
            assert gs["seed"] == 42 and gs["stop"] == ["zz"] and gs["n_probs"] == 2 and gs["stream"] is False
            assert gs["top_p"] == 0.5 and gs["min_p"] == 0.05  # the model's config, then llama.cpp's default
            assert gs["logit_bias"] == [[15, False]] and gs["ignore_eos"] is False
            assert out["prompt"] == "one two" and out["model"] == "a"
            r = await c.post("/completion", json={"prompt": "one", "stream": True})
            last = [ln for ln in r.text.splitlines() if ln.startswith("data: ")][-1]
            import json
            gs = json.loads(last[6:])["generation_settings"]
            assert gs["stream"] is True and gs["n_predict"] == -1 and gs["seed"] == 0xFFFFFFFF  # unseeded: random

    run(go())


def test_completion_takes_prompt_objects_and_mixed_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's prompt shapes: ``{"prompt_string": ...}``, and a list mixing strings and token ids
    (each string tokenized; the model's BOS only when the first element is a string)."""
    from tests.fakes.fake_worker import tokenize
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/completion", json={"prompt": {"prompt_string": "alpha beta"}, "n_predict": 1})
            assert r.status_code == 200, r.text
            assert _generates(env)[-1]["prompt"] == "alpha beta"
            r = await c.post("/completion", json={"prompt": ["alpha beta", 77, "gamma"], "n_predict": 1})
            assert r.status_code == 200, r.text
            assert _generates(env)[-1]["prompt"] == tokenize("alpha beta", True) + [77] + tokenize("gamma", False)
            assert r.json()["tokens_evaluated"] == len(tokenize("alpha beta", True)) + 2
            r = await c.post("/completion", json={"prompt": [77, "gamma delta"], "n_predict": 1})
            assert _generates(env)[-1]["prompt"] == [77] + tokenize("gamma delta", False)
            for bad, param in (({"prompt_string": "x", "multimodal_data": ["aGk="]}, "prompt.multimodal_data"),
                               ({"prompt_str": "x"}, "prompt.prompt_string"), ([1, -3, "a"], "prompt"),
                               (["a", {"prompt_str": "x"}], "prompt[1].prompt_string"), (["a", 5.5], "prompt[1]")):
                r = await c.post("/completion", json={"prompt": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)

    run(go())


def _chunks(text: str) -> list[dict[str, Any]]:
    import json
    return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]


def test_completion_answers_several_prompts_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server (``tokenize_input_prompts``): a ``prompt`` list holding no number is several
    prompts, each a string, token ids, a mixed list or a prompt object; the answer is the list of
    their results in the prompts' order, each with its ``index`` (one prompt: one object); a
    stream interleaves their chunks, each naming its prompt's ``index``, and ends each with its
    own ``stop`` chunk."""
    from tests.fakes.fake_worker import tokenize
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"max_jobs": 2}})
    prompts = ["alpha [len=2]", {"prompt_string": "beta [len=4]"}, [77, "gamma [len=3]"]]

    async def go() -> None:
        async with env.app(config("a", extra={"a": ["parallel = 2"]})) as (pool, c):
            r = await c.post("/completion", json={"prompt": prompts, "n_predict": 6, "return_tokens": True})
            assert r.status_code == 200, r.text
            out = r.json()
            assert isinstance(out, list) and [o["index"] for o in out] == [0, 1, 2]
            assert [o["tokens_predicted"] for o in out] == [2, 4, 6]  # token ids: the fake reads no [len=]
            assert [o.get("prompt") for o in out] == ["alpha [len=2]", "beta [len=4]", None]
            assert all(o["stop"] and o["generation_settings"]["n_predict"] == 6 for o in out)
            assert all(len(o["tokens"]) >= o["tokens_predicted"] for o in out)
            sent = sorted((g["prompt"] for g in _generates(env)[-3:]), key=str)
            assert sent == sorted(["alpha [len=2]", "beta [len=4]", [77] + tokenize("gamma [len=3]", False)], key=str)
            # one prompt, in a list or not: one object, index 0
            for one in (["alpha [len=2]"], "alpha [len=2]", [["alpha [len=2]"]]):
                r = await c.post("/completion", json={"prompt": one, "n_predict": 6})
                assert r.status_code == 200 and r.json()["index"] == 0 and r.json()["tokens_predicted"] == 2, one
            r = await c.post("/completion", json={"prompt": prompts, "n_predict": 6, "stream": True})
            assert r.status_code == 200, r.text
            chunks = _chunks(r.text)
            for i, o in enumerate(out):
                mine = [ch for ch in chunks if ch["index"] == i]
                assert mine[-1]["stop"] is True and not any(ch["stop"] for ch in mine[:-1])
                assert "".join(ch["content"] for ch in mine) == o["content"]
                assert mine[-1]["tokens_predicted"] == o["tokens_predicted"]
            assert {ch["index"] for ch in chunks} == {0, 1, 2}
            assert pool.get("a").gauges().running == 0

    run(go())


def test_several_prompts_are_bounded_and_fail_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several prompts are one request's work: at most parallel + max_queue of them, their
    n_predict together within the model's request ceiling (issue 23's n x max_tokens bound, naming
    ``prompt``), each an equal share of it without n_predict; one prompt refused fails the request
    and leaves nothing running."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a", extra={"a": ["parallel = 1", "max_queue = 2", "n_ctx = 256",
                                                    "n_predict = -1"]})) as (pool, c):
            r = await c.post("/completion", json={"prompt": ["a", "b", "c", "d"], "n_predict": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert "at most 3" in r.json()["error"]["message"]
            r = await c.post("/completion", json={"prompt": ["a", "b"], "n_predict": 200})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "prompt" and err["code"] == "request_too_large_for_model" and "400" in err["message"]
            n = len(_generates(env))
            r = await c.post("/completion", json={"prompt": ["a [len=300]", "b [len=300]"]})
            assert r.status_code == 200, r.text
            assert [g["max_tokens"] for g in _generates(env)[n:]] == [128, 128]
            # the second prompt's token id is outside the vocabulary: the worker refuses it, the request fails
            n = len(_generates(env))
            r = await c.post("/completion", json={"prompt": ["fine [len=3]", [5, 10_000_000]], "n_predict": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "prompt[1]"), r.text
            assert pool.get("a").gauges().running == 0 and pool.get("a").queue_depth == 0
            # streaming, one slot: the first prompt's stream is under way when the second is refused,
            # so the refusal is the stream's error event and its end
            r = await c.post("/completion", json={"prompt": ["fine [len=3]", [5, 10_000_000]], "n_predict": 3,
                                                  "stream": True})
            assert r.status_code == 200, r.text
            chunks = _chunks(r.text)
            assert [ch["index"] for ch in chunks[:-1]] == [0, 0, 0, 0] and chunks[-2]["stop"] is True
            assert chunks[-1]["error"]["code"] == "invalid_token", chunks[-1]
            assert pool.get("a").gauges().running == 0 and pool.get("a").queue_depth == 0

    run(go())


def test_completion_text_keyed_logit_bias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server: a ``logit_bias`` key that is text biases every token of that text."""
    from tests.fakes.fake_worker import tokenize
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            hello = tokenize("Hello world", False)
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1,
                                                  "logit_bias": {"Hello world": -2, "15": 1}})
            assert r.status_code == 200, r.text
            assert _generates(env)[-1]["logit_bias"] == [[hello[0], -2.0], [hello[1], -2.0], [15, 1.0]]
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1, "logit_bias": [["Hello", False]]})
            assert r.status_code == 200
            assert _generates(env)[-1]["logit_bias"] == [[tokenize("Hello", False)[0], float("-inf")]]

    run(go())


def test_one_token_answer_has_no_generation_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1})
            t = r.json()["timings"]
            assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 3})
            assert r.json()["timings"]["predicted_per_second"] > 0

    run(go())


def test_json_object_with_a_schema_constrains_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server: ``response_format: {"type": "json_object", "schema": S}`` constrains to S."""
    import json
    env = InProc(tmp_path, monkeypatch)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/v1/chat/completions", json=chat("a", response_format={"type": "json_object",
                                                                                    "schema": schema}))
            assert r.status_code == 200, r.text
            assert json.loads(_generates(env)[-1]["json_schema"]) == schema
            r = await c.post("/v1/chat/completions", json=chat("a", response_format={"type": "json_object"}))
            assert json.loads(_generates(env)[-1]["json_schema"]) == {"type": "object"}

    run(go())


# ----------------------------------------------------------------------------- 9. router queue


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize", "/props"])
def test_waiters_for_a_load_are_served_before_a_later_request_evicts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """llama-server's router keeps FIFO: two requests wait for model b's load (max_loaded = 1); a
    later request for c waits until they are served, and never makes them a 503."""
    from router.workers.lifecycle import WorkerState
    from tests.router.inproc import until
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"b": {"hold_load": True}})

    async def ask_b() -> Any:
        if route == "/v1/chat/completions":
            return await c.post(route, json=chat("b"))
        if route == "/tokenize":
            return await c.post(route, json={"model": "b", "content": "x y"})
        return await c.get(route, params={"model": "b"})

    async def go() -> None:
        nonlocal c
        async with env.app(config("abc", ["max_loaded = 1"])) as (pool, c):
            assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
            with env.hold():
                bs = [asyncio.create_task(ask_b()) for _ in range(2)]
                await until(lambda: pool.get("b").state is WorkerState.LOADING, "b loading")
                later = asyncio.create_task(c.post("/v1/chat/completions", json=chat("c")))
                await until(lambda: pool.get("c").placing.waiting_for, "c waiting for room")
                assert "b to become idle" in (pool.get("c").placing.waiting_for or "")
            rs = await asyncio.gather(*bs)
            assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
            r = await later
            assert r.status_code == 200, r.text
            assert pool.get("c").state is WorkerState.READY and pool.get("b").state is WorkerState.UNLOADED

    c: Any = None
    run(go())


def test_a_client_leaving_while_its_model_loads_evicts_nothing_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_loaded = 2 with a and c loaded: a request for b evicts the least recently used (a) and b
    loads; its client leaving meanwhile evicts nothing else (c stays), b's load completes."""
    from router.workers.lifecycle import WorkerState
    from tests.router.inproc import until
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"b": {"hold_load": True}})

    async def go() -> None:
        async with env.app(config("abc", ["max_loaded = 2"])) as (pool, c):
            for m in "ac":
                assert (await c.post("/v1/chat/completions", json=chat(m))).status_code == 200
            with env.hold():
                b = pool.get("b")
                for make, waiting in ((lambda: c.post("/v1/chat/completions", json=chat("b")), lambda: b.queue_depth),
                                      (lambda: c.post("/tokenize", json={"model": "b", "content": "x"}),
                                       lambda: b.users)):
                    t = asyncio.create_task(make())
                    await until(lambda: b.state is WorkerState.LOADING and waiting(), "b loading for the request")
                    t.cancel()
                    await until(lambda: pool.get("b").queue_depth == 0 and pool.get("b").users == 0, "b left")
                    assert pool.get("c").state is WorkerState.READY
            await until(lambda: pool.get("b").state is WorkerState.READY, "b loaded")
            assert pool.get("c").state is WorkerState.READY and pool.get("a").state is WorkerState.UNLOADED

    run(go())


# ----------------------------------------------------------------------------- 7. sleeping


def test_a_model_unloaded_for_idleness_is_sleeping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server --sleep-idle-seconds (here idle_ttl_s): once asleep /health is 200 and /props is 200
    with ``is_sleeping: true`` without waking it; a generation wakes it, and /props says so."""
    from router.workers.lifecycle import WorkerState
    from tests.router.inproc import until
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a", extra={"a": ["idle_ttl_s = 0.2"]})) as (pool, c):
            slot = pool.get("a")
            r = await c.get("/props", params={"model": "a"})  # never loaded: not asleep, /props loads it
            assert r.status_code == 200 and r.json()["is_sleeping"] is False and slot.state is WorkerState.READY
            assert (await c.post("/v1/chat/completions", json=chat("a"))).status_code == 200
            await until(lambda: slot.sleeping, "asleep after idle_ttl_s")
            for _ in range(2):
                r = await c.get("/props", params={"model": "a"})
                assert r.status_code == 200 and r.json()["is_sleeping"] is True, r.text
                assert r.json()["default_generation_settings"]["n_ctx"] == 256 and r.json()["total_slots"] == 1
                r = await c.get("/health", params={"model": "a"})
                assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["is_sleeping"] is True
                m = next(m for m in (await c.get("/models")).json()["data"] if m["id"] == "a")
                assert m["status"]["value"] == "unloaded" and m["status"]["is_sleeping"] is True
                assert slot.state is WorkerState.UNLOADED  # none of them woke it
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 1})
            assert r.status_code == 200
            r = await c.get("/props", params={"model": "a"})
            assert r.json()["is_sleeping"] is False and slot.state is WorkerState.READY

    run(go())


def test_an_empty_anthropic_conversation_is_answered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server renders an empty ``messages`` (the system prompt and the generation prompt) and
    answers; OpenAI's chat route still needs a message."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            for body in ({"model": "a", "max_tokens": 3, "messages": []},
                         {"model": "a", "max_tokens": 3, "system": "be brief", "messages": []}):
                r = await c.post("/v1/messages", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["type"] == "message" and r.json()["content"][0]["type"] == "text"
                msgs = _generates(env)[-1]["messages"]
                assert msgs == ([{"role": "system", "content": "be brief"}] if "system" in body else [])
                r = await c.post("/v1/messages/count_tokens", json=body)
                assert r.status_code == 200 and r.json()["input_tokens"] > 0
            r = await c.post("/v1/chat/completions", json={"model": "a", "messages": []})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"

    run(go())


def test_return_progress_streams_prompt_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's ``return_progress`` (tools/server README): in a stream, ``prompt_progress``
    chunks ``{"total", "cache", "processed", "time_ms"}`` while the prompt is processed — its start
    (processed == cache) and one per batch, the last with processed == total — before the first
    token; each names its prompt's ``index``. Not streaming, or not asked: no progress, nothing set aside."""
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"cache_n": 3, "max_jobs": 2}})
    words = " ".join(f"w{i}" for i in range(20))  # 21 tokens with BOS: the fake's chunks of 8 end at 11, 19, 21

    async def go() -> None:
        async with env.app(config("a", extra={"a": ["parallel = 2"]})) as (_, c):
            r = await c.post("/completion", json={"prompt": words + " [len=2]", "n_predict": 4, "stream": True,
                                                  "return_progress": True})
            assert r.status_code == 200, r.text
            assert "X-Modelyard-Set-Aside" not in r.headers and _generates(env)[-1]["return_progress"] is True
            chunks = _chunks(r.text)
            progress = [ch for ch in chunks if "prompt_progress" in ch]
            assert [tuple(p["prompt_progress"][k] for k in ("total", "cache", "processed")) for p in progress] == [
                (22, 3, 3), (22, 3, 11), (22, 3, 19), (22, 3, 22)]
            assert all(isinstance(p["prompt_progress"]["time_ms"], int) for p in progress)
            assert progress[0]["prompt_progress"]["time_ms"] == 0
            assert all(p["content"] == "" and p["tokens"] == [] and p["stop"] is False and p["tokens_predicted"] == 0
                       and p["tokens_evaluated"] == 22 and p["index"] == 0 for p in progress)
            assert chunks[:len(progress)] == progress  # all of them before the first token
            assert chunks[-1]["stop"] is True and chunks[-1]["tokens_predicted"] == 2
            # several prompts: each reports its own, under its index
            r = await c.post("/completion", json={"prompt": ["one two [len=1]", "three [len=1]"], "n_predict": 2,
                                                  "stream": True, "return_progress": True})
            assert r.status_code == 200, r.text
            by_index = {i: [ch["prompt_progress"]["processed"] for ch in _chunks(r.text)
                            if "prompt_progress" in ch and ch["index"] == i] for i in (0, 1)}
            assert by_index == {0: [3, 4], 1: [2, 3]}  # 4 and 3 tokens; the cache holds all but the last
            # not streamed: llama-server sends no progress and ignores the field
            r = await c.post("/completion", json={"prompt": "hi [len=2]", "n_predict": 2, "return_progress": True})
            assert r.status_code == 200 and "prompt_progress" not in r.json()
            assert "X-Modelyard-Set-Aside" not in r.headers and _generates(env)[-1]["return_progress"] is False
            # not asked: none
            r = await c.post("/completion", json={"prompt": words, "n_predict": 2, "stream": True})
            assert r.status_code == 200 and not any("prompt_progress" in ch for ch in _chunks(r.text))
            assert _generates(env)[-1]["return_progress"] is False

    run(go())


def test_return_progress_on_the_openai_routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's chat route with ``return_progress`` (its tests/unit/test_chat_completion.py):
    chunks carrying the role delta and ``prompt_progress``, the first with processed == cache,
    processed growing, the last == total, all before the content; not streamed: nothing. Its
    /v1/completions: chunks with empty text carry it."""
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"cache_n": 2}})
    words = " ".join(f"w{i}" for i in range(20))

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/v1/chat/completions", json=chat("a", words, stream=True, return_progress=True))
            assert r.status_code == 200, r.text
            chunks = _chunks(r.text)
            progress = [ch for ch in chunks if "prompt_progress" in ch]
            done = [p["prompt_progress"]["processed"] for p in progress]
            total = progress[0]["prompt_progress"]["total"]
            assert done[0] == progress[0]["prompt_progress"]["cache"] == 2 and done[-1] == total > 16
            assert done == sorted(set(done)) and len(done) >= 3
            assert all(p["choices"][0]["delta"] == {"role": "assistant", "content": None}
                       and p["object"] == "chat.completion.chunk" for p in progress)
            first_content = next(i for i, ch in enumerate(chunks)
                                 if ch["choices"] and ch["choices"][0]["delta"].get("content"))
            assert chunks.index(progress[-1]) < first_content
            r = await c.post("/v1/chat/completions", json=chat("a", words, return_progress=True))
            assert r.status_code == 200 and "prompt_progress" not in r.json()
            assert _generates(env)[-1]["return_progress"] is False
            # /v1/completions: text chunks with no text carry it
            r = await c.post("/v1/completions", json={"model": "a", "prompt": words, "max_tokens": 2, "stream": True,
                                                      "return_progress": True})
            progress = [ch for ch in _chunks(r.text) if "prompt_progress" in ch]
            assert [p["prompt_progress"]["processed"] for p in progress] == [2, 10, 18, 21]  # BOS + 20 words
            assert all(p["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]
                       and p["object"] == "text_completion" for p in progress)

    run(go())


# ----------------------------------------------------------------------------- 8. templates


def test_enable_thinking_per_model_and_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp renders with enable_thinking (true unless reasoning is off); a request's
    chat_template_kwargs win; what the renderer sets itself cannot be overridden."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("ab", extra={"b": ['reasoning = "off"']})) as (_, c):
            for model, want in (("a", True), ("b", False)):
                assert (await c.post("/v1/chat/completions", json=chat(model))).status_code == 200
                assert _generates(env)[-1]["template_kwargs"] == {"enable_thinking": want}
            body = chat("b", chat_template_kwargs={"enable_thinking": True, "custom_flag": 3})
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert _generates(env)[-1]["template_kwargs"] == {"enable_thinking": True, "custom_flag": 3}
            r = await c.post("/chat/completions/input_tokens", json=chat("a", chat_template_kwargs={"x": 1}))
            assert r.status_code == 200 and _generates(env)[-1]["template_kwargs"] == {"enable_thinking": True, "x": 1}
            r = await c.post("/v1/messages", json={"model": "b", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and _generates(env)[-1]["template_kwargs"] == {"enable_thinking": False}
            for bad, param in (({"messages": []}, "chat_template_kwargs"), ("x", "chat_template_kwargs"),
                               ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking")):
                r = await c.post("/v1/chat/completions", json=chat("a", chat_template_kwargs=bad))
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

    run(go())


def test_reasoning_config_is_checked(tmp_path: Path) -> None:
    import tomllib
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    with pytest.raises(ConfigError) as e:
        parse_config(tomllib.loads(config("a", extra={"a": ['reasoning = "maybe"']})), base_dir=tmp_path)
    assert e.value.key == "models.a.reasoning"


def test_reasoning_is_kept_in_the_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server hands an assistant turn's reasoning to the template as ``reasoning_content``:
    OpenAI's ``reasoning_content`` and Anthropic's ``thinking`` blocks."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            msgs = [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": "thought 1"},
                    {"role": "user", "content": "q2"}]
            r = await c.post("/v1/chat/completions", json={"model": "a", "max_tokens": 2, "messages": msgs})
            assert r.status_code == 200, r.text
            sent = _generates(env)[-1]["messages"]
            assert sent[1] == {"role": "assistant", "content": "a", "reasoning_content": "thought 1"}
            r = await c.post("/v1/messages", json={"model": "a", "max_tokens": 2, "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "thought 2", "signature": "s"},
                                                  {"type": "redacted_thinking", "data": "xx"},
                                                  {"type": "text", "text": "a"}]},
                {"role": "user", "content": "q2"}]})
            assert r.status_code == 200, r.text
            sent = _generates(env)[-1]["messages"]
            assert sent[1] == {"role": "assistant", "content": "a", "reasoning_content": "thought 2"}

    run(go())


def test_completion_post_sampling_probs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's ``post_sampling_probs``: ``prob`` / ``top_probs`` (probabilities of the sampler
    chain) instead of ``logprob`` / ``top_logprobs``; the worker is asked for them."""
    import math
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config("a")) as (_, c):
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 2, "n_probs": 2,
                                                  "post_sampling_probs": True})
            assert r.status_code == 200, r.text
            e = r.json()["completion_probabilities"][0]
            assert set(e) == {"id", "token", "bytes", "prob", "top_probs"}
            assert math.isclose(e["prob"], math.exp(-0.5)) and len(e["top_probs"]) == 2
            assert math.isclose(e["top_probs"][1]["prob"], math.exp(-1.5)) and "logprob" not in e["top_probs"][0]
            r = await c.post("/completion", json={"prompt": "hi", "n_predict": 2, "n_probs": 2})
            assert "logprob" in r.json()["completion_probabilities"][0]
            r = await c.post("/v1/chat/completions", json=chat("a", post_sampling_probs=True))
            assert r.status_code == 400 and r.json()["error"]["param"] == "post_sampling_probs"

    run(go())
