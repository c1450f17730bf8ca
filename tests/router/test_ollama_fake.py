"""Ollama's native API against fake workers, driven by the real ``ollama`` Python client and
raw httpx: NDJSON streams and single answers, options mapped onto the Generate (read back
from the fake worker's log), what is refused (400 naming the field) or set aside (header),
Ollama's error shape, tool calls, load / unload, and the model routes (``/api/tags``,
``/api/show`` with a tiny GGUF's real metadata, ``/api/ps``, ``/api/version``).

The fake worker answers " w100 w101 ..." (12 tokens, then EOS), and ``[reply64=...]`` makes it
answer a chosen text (tool calls, JSON).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from router.gguf_meta import tensor_infos
from tests.router.conftest import LiveRouter, dummy_gguf
from tests.worker.tiny_gguf import write_tiny_llama

CONFIG = """
[server]
models_dir = "."
api_key = "sekrit"
sse_keepalive_s = 0.2
[models.alpha]
path = "alpha.gguf"
aliases = ["al:7b"]
n_ctx = 256
max_queue = 0
[models.tiny]
path = "tiny.gguf"
idle_ttl_s = 600
"""

AUTH = {"Authorization": "Bearer sekrit"}
TEXT12 = "".join(f" w{100 + k}" for k in range(12))


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "alpha.gguf")
    write_tiny_llama(module_tmp / "tiny.gguf", qtype="Q8_0", extra_metadata={"general.file_type": 7})
    r = LiveRouter(module_tmp, CONFIG)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(router: LiveRouter) -> ollama.Client:
    return ollama.Client(host=router.url, headers=AUTH, timeout=30)


def reply(text: str) -> str:
    return "[reply64=" + base64.b64encode(text.encode()).decode() + "]"


def post(router: LiveRouter, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(router.url + path, json=body, headers=AUTH, timeout=30)


def ndjson(router: LiveRouter, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[dict[str, Any]]]:
    with httpx.stream("POST", router.url + path, json=body, headers=AUTH, timeout=30) as r:
        r.read()
    lines = [json.loads(ln) for ln in r.text.splitlines() if ln.strip()]
    return r, lines


def state(router: LiveRouter, model: str) -> str:
    return str(admin(router, model)["state"])


def admin(router: LiveRouter, model: str) -> dict[str, Any]:
    data = httpx.get(router.url + "/admin/models", headers=AUTH, timeout=10).json()["data"]
    return dict(next(m for m in data if m["id"] == model))


def last_generate(router: LiveRouter) -> dict[str, Any]:
    evs = router.fake_events("generate")
    assert evs, "no Generate reached the worker"
    return evs[-1]


STATS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
         "eval_duration")


# ----------------------------------------------------------------------------- chat / generate


def test_chat_non_streaming_with_the_client(router: LiveRouter, client: ollama.Client) -> None:
    r = client.chat(model="alpha", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert r.message.role == "assistant" and r.message.content == TEXT12
    assert r.done is True and r.done_reason == "stop" and r.model == "alpha"
    assert r.eval_count == 12 and r.prompt_eval_count and r.prompt_eval_count > 0
    assert all(isinstance(r[k], int) and r[k] >= 0 for k in STATS)
    assert r.eval_duration and r.eval_duration > 1_000_000  # nanoseconds: 12 tokens at 5 ms each
    assert r.total_duration and r.total_duration >= r.eval_duration
    assert r.created_at and r.created_at.endswith("Z")
    raw = post(router, "/api/chat", {"model": "alpha", "stream": False, "messages": [{"role": "user", "content": "hi"}]})
    assert "prompt_eval_cached_count" not in raw.json()  # nothing reused from the KV cache


def test_cached_prompt_tokens_are_counted(router: LiveRouter) -> None:
    """prompt_eval_count is the whole prompt; prompt_eval_cached_count what the KV cache held."""
    router.set_fake({"*": {"cache_n": 3}})
    try:
        r = post(router, "/api/chat", {"model": "tiny", "stream": False,
                                       "messages": [{"role": "user", "content": "hi there"}]}).json()
    finally:
        router.set_fake({})
        post(router, "/api/chat", {"model": "tiny", "messages": [], "keep_alive": 0})  # the switch is read at spawn
    assert r["prompt_eval_cached_count"] == 3 and r["prompt_eval_count"] > 3


def test_chat_stream_is_ndjson_and_equals_the_single_answer(router: LiveRouter, client: ollama.Client) -> None:
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}  # stream: true by default
    r, lines = ndjson(router, "/api/chat", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert all(ln["done"] is False for ln in lines[:-1]) and lines[-1]["done"] is True
    assert "".join(ln["message"]["content"] for ln in lines) == TEXT12
    final = lines[-1]
    assert final["done_reason"] == "stop" and final["message"] == {"role": "assistant", "content": ""}
    assert all(isinstance(final[k], int) for k in STATS) and final["eval_count"] == 12
    parts = list(client.chat(model="alpha", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(p.message.content or "" for p in parts) == TEXT12 and parts[-1].done


def test_generate_templated_raw_and_streamed(router: LiveRouter, client: ollama.Client) -> None:
    r = client.generate(model="alpha", prompt="why?", system="Be brief.")
    assert r.response == TEXT12 and r.done and r.done_reason == "stop"
    g = last_generate(router)
    assert g["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "why?"}]
    assert g["prompt"] is None
    r = client.generate(model="alpha", prompt="<|im_start|>user\nx<|im_end|>\n", raw=True)
    assert r.response == TEXT12
    g = last_generate(router)
    assert g["prompt"] == "<|im_start|>user\nx<|im_end|>\n" and g["messages"] is None
    parts = list(client.generate(model="alpha", prompt="why?", stream=True))
    assert "".join(p.response or "" for p in parts) == TEXT12 and parts[-1].done_reason == "stop"
    resp = post(router, "/api/generate", {"model": "alpha", "prompt": "x", "raw": True, "system": "s"})
    assert resp.status_code == 400 and "'system'" in resp.json()["error"]


def test_options_are_mapped_onto_the_generation(router: LiveRouter, client: ollama.Client) -> None:
    client.chat(model="alpha", messages=[{"role": "user", "content": "hi"}])
    g = last_generate(router)  # Ollama's defaults
    assert (g["temperature"], g["top_k"], g["top_p"], g["min_p"], g["repeat_penalty"], g["repeat_last_n"]) == \
        (0.8, 40, 0.9, 0.0, 1.1, 64)
    assert g["seed"] is None and g["max_tokens"] is None and g["stop"] == []
    opts = {"temperature": 0.2, "top_k": 7, "top_p": 0.5, "min_p": 0.1, "seed": 42, "num_predict": 3,
            "stop": ["w105"], "repeat_penalty": 1.3, "repeat_last_n": 16, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "num_ctx": 128, "mirostat": 0, "typical_p": 1.0}
    r = client.chat(model="alpha", messages=[{"role": "user", "content": "hi"}], options=opts)
    g = last_generate(router)
    assert (g["temperature"], g["top_k"], g["top_p"], g["min_p"], g["seed"], g["max_tokens"], g["stop"]) == \
        (0.2, 7, 0.5, 0.1, 42, 3, ["w105"])
    assert (g["repeat_penalty"], g["repeat_last_n"], g["presence_penalty"], g["frequency_penalty"]) == \
        (1.3, 16, 0.5, 0.25)
    assert r.done_reason == "length" and r.eval_count == 3 and r.message.content == " w100 w101 w102"
    for n in (-1, -2, 0):  # Ollama: no limit
        client.generate(model="alpha", prompt="hi", options={"num_predict": n})
        assert last_generate(router)["max_tokens"] is None
    r = client.generate(model="alpha", prompt="hi", options={"stop": [" w103"]})
    assert r.response == " w100 w101 w102" and r.done_reason == "stop"


@pytest.mark.parametrize("options, param", [
    ({"foo": 1}, "options.foo"),
    ({"typical_p": 0.5}, "options.typical_p"),
    ({"mirostat": 2}, "options.mirostat"),
    ({"tfs_z": 0.9}, "options.tfs_z"),
    ({"temperature": "hot"}, "options.temperature"),
    ({"top_p": 2}, "options.top_p"),
    ({"stop": 5}, "options.stop"),
])
def test_options_that_would_change_the_answer_are_refused(router: LiveRouter, options: dict[str, Any],
                                                          param: str) -> None:
    n = len(router.fake_events("generate"))
    r = post(router, "/api/chat", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                                   "options": options})
    assert r.status_code == 400 and set(r.json()) == {"error"} and f"'{param}'" in r.json()["error"]
    assert len(router.fake_events("generate")) == n  # refused before the worker


def test_options_without_effect_are_set_aside_visibly(router: LiveRouter) -> None:
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_thread": 4, "num_gpu": 99, "use_mmap": True, "num_ctx": 100000},
            "keep_alive": "10m"}
    r = post(router, "/api/chat", body)
    assert r.status_code == 200 and r.json()["message"]["content"] == TEXT12
    # keep_alive is honoured (router.serving.keep_alive, issue 27), not set aside
    assert r.headers["x-modelyard-set-aside"] == \
        "options:num_thread, options:num_gpu, options:use_mmap, options:num_ctx"
    log = router.log()
    assert "set aside" in log and "n_ctx=256" in log
    r, lines = ndjson(router, "/api/chat", {**body, "stream": True})
    assert r.headers["x-modelyard-set-aside"].startswith("options:num_thread") and lines[-1]["done"]
    assert admin(router, "alpha")["keep_alive_s"] == 600
    r = post(router, "/api/generate", {"model": "alpha", "prompt": "hi", "stream": False, "keep_alive": 0})
    assert r.status_code == 200 and "x-modelyard-set-aside" not in r.headers  # unloaded after it
    router.wait_for(lambda: state(router, "alpha") == "unloaded", what="alpha unloaded after keep_alive 0")
    body = {"model": "alpha", "prompt": "hi", "stream": False, "options": {"num_ctx": 256}, "keep_alive": -1}
    r = post(router, "/api/generate", body)  # fits n_ctx; loaded again, never unloaded for idleness
    assert r.status_code == 200 and "x-modelyard-set-aside" not in r.headers
    assert admin(router, "alpha")["keep_alive_s"] == -1 and admin(router, "alpha")["expires_at"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "messages[0].images"),
    ("/api/chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "think": True}, "think"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, "max_tokens"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}, "temperature"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "format": "yaml"}, "format"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}, "keep_alive"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": [1]}, "options"),
    ("/api/generate", {"prompt": "hi", "images": ["aGk="]}, "images"),
    ("/api/generate", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/api/generate", {"prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"prompt": "hi", "context": [1, 2, 3]}, "context"),
    ("/api/generate", {"prompt": "hi", "think": "high"}, "think"),
    ("/api/generate", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(router: LiveRouter, path: str, body: dict[str, Any],
                                                           param: str) -> None:
    r = post(router, path, {"model": "alpha", **body})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and f"'{param}'" in r.json()["error"] or param == "think"
    if param == "think":
        assert r.json()["error"] == '"alpha" does not support thinking'


def test_errors_have_ollama_shape_and_status(router: LiveRouter, client: ollama.Client) -> None:
    r = post(router, "/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"].startswith("model 'nope' not found")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "model 'nope' not found" in e.value.error
    r = httpx.post(router.url + "/api/chat", json={"model": "alpha", "messages": []}, timeout=30)
    assert r.status_code == 401 and set(r.json()) == {"error"}  # the api_key rule, in Ollama's shape
    r = httpx.post(router.url + "/api/chat", content=b"{", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(router.url + "/api/chat", content=b'{"model": "alpha"}', timeout=30,
                   headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})  # curl -d
    assert r.status_code == 415 and set(r.json()) == {"error"}
    r = httpx.post(router.url + "/api/generate", json={"model": "alpha", "prompt": "hi"}, timeout=30,
                   headers={**AUTH, "Origin": "https://evil.example"})
    assert r.status_code == 403 and "Origin" in r.json()["error"]
    r = httpx.post(router.url + "/api/embed", json={"model": "alpha", "input": "hi"}, headers=AUTH, timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    too_long = "x " * 300  # alpha's n_ctx is 256
    r = post(router, "/api/generate", {"model": "alpha", "prompt": too_long, "raw": True})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]


@pytest.mark.parametrize("path, body, key", [
    ("/api/chat", {"messages": [{"role": "user", "content": "hi [prefill=1.5] [len=2]"}]}, "message"),
    ("/api/generate", {"prompt": "hi [prefill=1.5] [len=2]", "raw": True}, "response"),
])
def test_stream_opens_before_the_prefill_and_stays_alive(router: LiveRouter, client: ollama.Client, path: str,
                                                          body: dict[str, Any], key: str) -> None:
    """The stream's first line comes once the worker accepted the prompt, before its prefill;
    while it is prefilled, lines that add nothing keep it alive (sse_keepalive_s = 0.2 here);
    the client reads them as empty chunks."""
    seen: list[tuple[int, dict[str, Any]]] = []  # (first tokens generated by then, line)
    base = len(router.fake_events("first_token"))
    with httpx.stream("POST", router.url + path, json={"model": "alpha", **body}, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        for ln in r.iter_lines():
            seen.append((len(router.fake_events("first_token")) - base, json.loads(ln)))
    early = [obj for n, obj in seen if n == 0]
    assert len(early) >= 2 and all(obj["done"] is False for obj in early)
    assert all((obj[key]["content"] if key == "message" else obj[key]) == "" for obj in early)
    text = "".join(obj[key]["content"] if key == "message" else obj[key] for _, obj in seen)
    assert text == " w100 w101" and seen[-1][1]["done"] is True
    parts = list(client.chat(model="alpha", messages=body["messages"], stream=True) if key == "message"
                 else client.generate(model="alpha", prompt=body["prompt"], raw=True, stream=True))
    assert parts[-1].done and len(parts) >= 4


def test_model_tag_latest_and_aliases_resolve(client: ollama.Client) -> None:
    assert client.chat(model="alpha:latest", messages=[{"role": "user", "content": "hi"}]).model == "alpha:latest"
    assert client.generate(model="al:7b", prompt="hi").response == TEXT12


def test_mid_stream_error_is_a_last_ndjson_line(router: LiveRouter, client: ollama.Client) -> None:
    r, lines = ndjson(router, "/api/generate", {"model": "alpha", "prompt": "[crash]", "raw": True})
    assert r.status_code == 200 and lines[0]["done"] is False
    assert set(lines[-1]) == {"error"} and "worker" in lines[-1]["error"]
    with pytest.raises(ollama.ResponseError):
        list(client.generate(model="alpha", prompt="[crash]", raw=True, stream=True))
    # the worker starts again once its crash backoff has passed
    router.wait_for(lambda: post(router, "/api/generate", {"model": "alpha", "prompt": "hi", "stream": False})
                    .status_code == 200, what="alpha restarted")


def test_client_disconnect_cancels_and_full_queue_is_503(router: LiveRouter) -> None:
    """alpha has max_queue 0: one request runs, the next gets 503 + Retry-After at once;
    a client that leaves cancels its request on the worker."""
    with httpx.stream("POST", router.url + "/api/generate", headers=AUTH, timeout=30,
                      json={"model": "alpha", "prompt": "[slow=0.2] [len=200]", "raw": True}) as r:
        it = r.iter_lines()
        first = json.loads(next(it))
        assert first["done"] is False
        busy = post(router, "/api/chat", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]})
        assert busy.status_code == 503 and busy.headers["retry-after"] and set(busy.json()) == {"error"}
        rid = last_generate(router)["id"]
    router.wait_for(lambda: router.fake_events("cancel", id=rid), what="cancel frame")
    router.wait_for(lambda: router.fake_events("done", id=rid), what="worker freed")
    assert router.fake_events("done", id=rid)[-1]["finish_reason"] == "cancelled"


# ----------------------------------------------------------------------------- tools and format

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_single_and_streamed(router: LiveRouter, client: ollama.Client) -> None:
    msgs = [{"role": "user", "content": "weather in Paris? " + reply(CALL)}]
    r = client.chat(model="alpha", messages=msgs, tools=TOOLS)
    assert r.message.content == "" and r.done_reason == "stop"
    assert r.message.tool_calls is not None and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    g = last_generate(router)
    assert g["grammar"] and "get_weather" in g["grammar"]  # the calls are constrained
    assert "get_weather" in g["messages"][0]["content"]  # generic tool syntax: described in the system text
    parts = list(client.chat(model="alpha", messages=msgs, tools=TOOLS, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert parts[-1].done and "".join(p.message.content or "" for p in parts) == ""
    raw = post(router, "/api/chat", {"model": "alpha", "messages": msgs, "tools": TOOLS, "stream": False}).json()
    tc = raw["message"]["tool_calls"][0]
    assert tc["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert tc["id"].startswith("call_")


def get_weather(city: str) -> str:
    """Get the current weather of a city.

    Args:
      city: the city's name
    """
    return "18 C"


def test_python_function_as_a_tool(router: LiveRouter, client: ollama.Client) -> None:
    """The client turns a Python function into a tool schema (its docstring and annotations)."""
    msgs = [{"role": "user", "content": "weather in Paris? " + reply(CALL)}]
    r = client.chat(model="alpha", messages=msgs, tools=[get_weather])
    calls = r.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    system = last_generate(router)["messages"][0]["content"]
    assert "Get the current weather of a city." in system and "the city's name" in system


def test_tool_history_is_rendered(router: LiveRouter, client: ollama.Client) -> None:
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    r = client.chat(model="alpha", messages=msgs, tools=TOOLS)
    assert r.message.content == TEXT12
    rendered = last_generate(router)["messages"]
    assert rendered[-2]["role"] == "assistant" and '"city": "Paris"' in rendered[-2]["content"]
    assert rendered[-1]["role"] == "user" and "The tool get_weather returned:\n18 C, sunny" in rendered[-1]["content"]


def test_format_json_and_schema(router: LiveRouter, client: ollama.Client) -> None:
    r = client.chat(model="alpha", messages=[{"role": "user", "content": "x " + reply('{"a": 1}')}], format="json")
    assert json.loads(r.message.content or "") == {"a": 1}
    assert json.loads(last_generate(router)["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    client.generate(model="alpha", prompt="x", format=schema)
    assert json.loads(last_generate(router)["json_schema"]) == schema


def test_logprobs(router: LiveRouter) -> None:
    r = post(router, "/api/generate", {"model": "alpha", "prompt": "x", "stream": False, "logprobs": True,
                                       "top_logprobs": 2, "options": {"num_predict": 3}}).json()
    assert [lp["token"] for lp in r["logprobs"]] == [" w100", " w101", " w102"]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] == -0.5 for lp in r["logprobs"])
    _, lines = ndjson(router, "/api/generate", {"model": "alpha", "prompt": "x", "logprobs": True,
                                                "options": {"num_predict": 3}})
    assert [lp["token"] for ln in lines for lp in ln.get("logprobs", [])] == [" w100", " w101", " w102"]


# ----------------------------------------------------------------------------- load / unload, model routes


def test_tags_show_version(router: LiveRouter, client: ollama.Client, module_tmp: Path) -> None:
    names = [m.model for m in client.list().models]
    assert names == ["alpha:latest", "al:7b", "tiny:latest"]
    tiny = next(m for m in client.list().models if m.model == "tiny:latest")
    infos = tensor_infos(module_tmp / "tiny.gguf")
    assert infos is not None
    n_params = sum(math.prod(t.dims) for t in infos)
    assert tiny.size == (module_tmp / "tiny.gguf").stat().st_size
    assert tiny.details is not None and tiny.details.quantization_level == "Q8_0"
    assert tiny.details.family == "llama" and tiny.details.format == "gguf"
    # not loaded yet: hashed by the router (a loaded model's is its worker's fingerprint, the same sha256)
    assert state(router, "tiny") == "unloaded"
    assert tiny.digest == hashlib.sha256((module_tmp / "tiny.gguf").read_bytes()).hexdigest()
    s = client.show("tiny")
    assert s.modelinfo is not None
    assert s.modelinfo["general.architecture"] == "llama" and s.modelinfo["llama.context_length"] == 256
    assert s.modelinfo["general.parameter_count"] == n_params and s.modelinfo["general.file_type"] == 7
    assert s.modelinfo["llama.attention.layer_norm_rms_epsilon"] == 1e-5  # float32 shown as written
    assert s.modelinfo["tokenizer.ggml.tokens"] == []  # arrays only with verbose
    assert s.template and "<|im_start|>" in s.template and s.capabilities == ["completion", "tools"]
    verbose = post(router, "/api/show", {"model": "tiny", "verbose": True}).json()
    assert len(verbose["model_info"]["tokenizer.ggml.tokens"]) == verbose["model_info"]["llama.vocab_size"]
    r = post(router, "/api/show", {"model": "nope"})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    v = httpx.get(router.url + "/api/version", headers=AUTH, timeout=30).json()
    assert v["version"].count(".") == 2
    assert httpx.head(router.url + "/api/tags", headers=AUTH, timeout=30).status_code == 200


def test_empty_request_loads_and_keep_alive_zero_unloads(router: LiveRouter, client: ollama.Client) -> None:
    r = post(router, "/api/generate", {"model": "tiny"})
    assert r.status_code == 200 and r.json()["done"] is True and r.json()["done_reason"] == "load"
    assert state(router, "tiny") == "ready"
    ps = client.ps()
    entry = next(m for m in ps.models if m.model == "tiny:latest")
    assert entry.context_length == 256 and entry.size and entry.details and entry.details.family == "llama"
    assert entry.expires_at is not None and entry.expires_at.timestamp() > time.time() + 500  # idle_ttl_s 600
    r = post(router, "/api/chat", {"model": "tiny", "messages": [], "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and r.json()["message"] == {"role": "assistant", "content": ""}
    assert state(router, "tiny") == "unloaded"
    assert all(m.model != "tiny:latest" for m in client.ps().models)
    r = client.chat(model="tiny", messages=[])  # the client's own load form
    assert r.done_reason == "load"


def test_concurrent_streams_across_models(router: LiveRouter, client: ollama.Client) -> None:
    """Two models stream at once (separate workers), each answer whole."""
    out: dict[str, str] = {}

    def go(model: str) -> None:
        out[model] = "".join(p.response or "" for p in client.generate(model=model, prompt="hi", stream=True))

    ts = [threading.Thread(target=go, args=(m,)) for m in ("alpha", "tiny")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out == {"alpha": TEXT12, "tiny": TEXT12}


def test_tool_messages_find_their_calls_by_id_name_or_age() -> None:
    """A tool message answers the open call with its tool_call_id, else its tool_name, else
    (naming neither) the oldest open one — found without a scan per message (that was quadratic
    on the event loop: 20,000 calls answered in reverse held every client 50 s, 0.2 s now)."""
    from router.dialects.ollama_request import chat_turns

    def answered(msgs: list[dict[str, Any]]) -> list[tuple[str | None, str | None]]:
        return [(t.tool_call_id, t.name) for t in chat_turns({"messages": msgs}) if t.role == "tool"]

    calls = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "function": {"name": "f", "arguments": {}}}, {"function": {"name": "g", "arguments": {}}},
        {"id": "x", "function": {"name": "h", "arguments": {}}}]}
    assert answered([calls, {"role": "tool", "content": "1"}, {"role": "tool", "content": "2", "tool_name": "h"},
                     {"role": "tool", "content": "3", "tool_call_id": "x"},
                     {"role": "tool", "content": "4", "tool_call_id": "zz"},
                     {"role": "tool", "content": "5", "tool_name": "nope"}]) == [
        ("x", "f"), ("x", "h"), ("call_0_1", "g"), ("zz", None), (None, "nope")]
    n = 20000
    many = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "function": {"name": "f", "arguments": {}}} for i in range(n)]}]
    many += [{"role": "tool", "tool_call_id": f"c{i}", "content": "1"} for i in reversed(range(n))]
    got = answered(many)
    assert got[0] == (f"c{n - 1}", "f") and got[-1] == ("c0", "f") and len(got) == n
