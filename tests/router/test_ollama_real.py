"""Ollama's native API against the real SmolLM2 worker, driven by the ``ollama`` Python client
(as tools that speak Ollama natively use it): streamed answers equal single ones, options
reach the sampler (greedy with ``temperature: 0``, ``num_predict``, ``stop``), tool calls come
back as Ollama's ``tool_calls`` with arguments matching the tool's schema, ``format`` holds the
answer to a JSON Schema, and ``/api/show`` / ``/api/ps`` / ``/api/tags`` describe the real GGUF.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from tests.router.conftest import LiveRouter, MODELS, SMOLLM2, router_fixture

pytestmark = [pytest.mark.slow]

CONFIG = f"""
[server]
models_dir = "{MODELS}"
[defaults]
n_ctx = 1024
load_timeout_s = 300
[models.SmolLM2-135M-Instruct]
path = "{SMOLLM2.name}"
aliases = ["smollm2"]
"""

GREEDY = {"temperature": 0, "num_predict": 16}
MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


router = router_fixture(CONFIG, real=True)


@pytest.fixture(scope="module")
def client(router: LiveRouter) -> ollama.Client:
    return ollama.Client(host=router.url, timeout=300)


def test_load_form_then_ps_and_show_describe_the_real_model(client: ollama.Client) -> None:
    r = client.generate(model="smollm2")  # an empty prompt loads the model
    assert r.done and r.done_reason == "load"
    ps = client.ps().models
    assert [m.model for m in ps] == ["SmolLM2-135M-Instruct:latest"]
    assert ps[0].context_length == 1024 and ps[0].size and ps[0].size > 50 * 2**20
    assert ps[0].digest == hashlib.sha256(SMOLLM2.read_bytes()).hexdigest()  # the worker's fingerprint
    s = client.show("smollm2")
    info = s.modelinfo or {}
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == 8192
    assert info["general.parameter_count"] == 134_515_008 and info["llama.block_count"] == 30
    assert s.details is not None and s.details.quantization_level == "Q4_1"
    assert s.details.parameter_size == "134.52M" and s.details.family == "llama"
    assert s.template and "<|im_start|>" in s.template
    tags = {m.model: m for m in client.list().models}
    assert set(tags) == {"SmolLM2-135M-Instruct:latest", "smollm2:latest"}
    assert tags["smollm2:latest"].size == SMOLLM2.stat().st_size


def test_chat_streamed_equals_single_answer(client: ollama.Client) -> None:
    single = client.chat(model="smollm2", messages=MSG, options=GREEDY)
    assert single.message.content and single.done_reason in ("stop", "length")
    assert single.eval_count and single.eval_count <= 16 and single.prompt_eval_count
    assert single.eval_duration and single.prompt_eval_duration and single.total_duration
    parts = list(client.chat(model="smollm2", messages=MSG, options=GREEDY, stream=True))
    assert "".join(p.message.content or "" for p in parts) == single.message.content
    assert parts[-1].done and parts[-1].eval_count == single.eval_count
    assert parts[-1].done_reason == single.done_reason


def test_generate_options_reach_the_sampler(client: ollama.Client) -> None:
    prompt = "Write one sentence about the sea."
    full = client.generate(model="smollm2", prompt=prompt, options=GREEDY)
    text = full.response or ""
    assert len(text) > 12
    short = client.generate(model="smollm2", prompt=prompt, options={**GREEDY, "num_predict": 3})
    assert short.done_reason == "length" and short.eval_count == 3 and text.startswith(short.response or "")
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.generate(model="smollm2", prompt=prompt, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop" and cut.response == text[: text.find(stop)]
    parts = list(client.generate(model="smollm2", prompt=prompt, options=GREEDY, stream=True))
    assert "".join(p.response or "" for p in parts) == text


def test_raw_generate_equals_the_openai_completion(router: LiveRouter, client: ollama.Client) -> None:
    """One generation, two dialects: the same prompt, greedy and without Ollama's default
    repeat penalty, gives /v1/completions' text."""
    prompt = "The history of the printing press"
    r = client.generate(model="smollm2", prompt=prompt, raw=True,
                        options={"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0})
    o = router.client(timeout=300).completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=8)
    assert r.response == o.choices[0].text and r.eval_count == 8


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_and_round_trip(client: ollama.Client) -> None:
    """Ollama has no tool choice (the model decides): an earlier exchange in the history shows
    SmolLM2 the call syntax, and it calls the tool for the next city."""
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in London?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "London"}}}]},
        {"role": "tool", "content": "12 C, rain", "tool_name": "get_weather"},
        {"role": "assistant", "content": "It is 12 C and raining in London."},
        {"role": "user", "content": "What is the weather in Paris?"}]
    opts = {"temperature": 0, "num_predict": 32}
    r = client.chat(model="smollm2", messages=msgs, tools=[WEATHER], options=opts)
    calls = r.message.tool_calls or []
    assert calls, f"no tool call: {r.message.content!r}"
    assert r.message.content == "" and r.done_reason == "stop"
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER["function"]["parameters"])
    parts = list(client.chat(model="smollm2", messages=msgs, tools=[WEATHER], options=opts, stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(c.function.name, dict(c.function.arguments)) for c in calls]
    msgs += [{"role": "assistant", "content": "", "tool_calls": [
                 {"function": {"name": "get_weather", "arguments": dict(calls[0].function.arguments)}}]},
             {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    answer = client.chat(model="smollm2", messages=msgs, tools=[WEATHER], options={"temperature": 0, "num_predict": 16})
    assert answer.message.content or answer.message.tool_calls


def test_format_schema_holds_the_answer(router: LiveRouter, client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.chat(model="smollm2", messages=[{"role": "user", "content": "Ada is 36. Give her name and age."}],
                    format=schema, options={"temperature": 0, "num_predict": 48})
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    loose = {**schema, "propertyNames": {"type": "string", "maxLength": 8}}  # not enforceable: set aside, visibly
    h = httpx.post(router.url + "/api/chat", timeout=300, json={
        "model": "smollm2", "stream": False, "format": loose, "options": {"temperature": 0, "num_predict": 48},
        "messages": [{"role": "user", "content": "Ada is 36. Give her name and age."}]})
    assert h.status_code == 200 and "format:propertyNames" in h.headers["x-modelyard-set-aside"]
    jsonschema.validate(json.loads(h.json()["message"]["content"]), schema)
    r2 = client.generate(model="smollm2", prompt="A JSON object with a colour.", format="json",
                         options={"temperature": 0, "num_predict": 48})
    assert isinstance(json.loads(r2.response or ""), dict)


def test_errors_reach_the_client_as_response_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2", messages=MSG, options={"mirostat": 2})
    assert e.value.status_code == 400 and "options.mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smollm2", messages=MSG, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="smollm2", prompt="word " * 1100, options=GREEDY)
    assert e.value.status_code == 400 and "context" in e.value.error


def test_unload_form(router: LiveRouter, client: ollama.Client) -> None:
    r = client.generate(model="smollm2", keep_alive=0)
    assert r.done_reason == "unload" and client.ps().models == []
