"""The harness APIs against the real SmolLM2 worker, driven by the official SDKs at
temperature 0: Anthropic Messages (``anthropic``), OpenAI Responses and chat tools /
structured output (``openai``). Streamed answers equal non-streamed ones.

The model's config sets ``temperature = 0`` (the current anthropic SDK sends no
temperature at all), so every request here is greedy.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.router.conftest import LiveRouter, MODELS, SMOLLM2, router_fixture

pytestmark = [pytest.mark.slow]

CONFIG = f"""
[server]
models_dir = "{MODELS}"
[defaults]
n_ctx = 1024
load_timeout_s = 300
temperature = 0
[models.SmolLM2-135M-Instruct]
path = "{SMOLLM2.name}"
aliases = ["smollm2"]
"""

MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


router = router_fixture(CONFIG, real=True)


@pytest.fixture(scope="module")
def claude(router: LiveRouter) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(router: LiveRouter) -> openai.OpenAI:
    return router.client(timeout=300)


# ----------------------------------------------------------------------------- Anthropic


def test_anthropic_messages_streamed_equals_non_streamed(claude: anthropic.Anthropic) -> None:
    kw = dict(model="smollm2", max_tokens=24, system="Answer briefly.", messages=MSG)
    m = claude.messages.create(**kw)  # type: ignore[arg-type]
    assert m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    starts = []
    with claude.messages.stream(**kw) as s:  # type: ignore[arg-type]
        deltas = []
        for ev in s:
            if ev.type == "message_start":
                starts.append(ev.message.usage)
            elif ev.type == "text":
                deltas.append(ev.text)
        final = s.get_final_message()
    assert "".join(deltas) == m.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    n = claude.messages.count_tokens(model="smollm2", system="Answer briefly.", messages=MSG)  # type: ignore[arg-type]
    assert len(starts) == 1  # message_start reports the prompt up front, as Anthropic does
    for u in (m.usage, final.usage, starts[0]):
        assert u.input_tokens + (u.cache_read_input_tokens or 0) == n.input_tokens
    # the stream opens before the prefill (message_start at the worker's Accepted): how much of the
    # prompt the KV cache supplies is known only in message_delta's usage; the sum is right in both
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0  # the prefix was reused


def test_anthropic_max_tokens_and_stop_sequence(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="smollm2", max_tokens=3, messages=MSG)  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    full = claude.messages.create(model="smollm2", max_tokens=24, messages=MSG)  # type: ignore[arg-type]
    word = full.content[0].text.split()[2]  # type: ignore[union-attr]
    m = claude.messages.create(model="smollm2", max_tokens=24, stop_sequences=[word], messages=MSG)  # type: ignore[arg-type]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text  # type: ignore[union-attr]


def test_assistant_prefill_is_continued_on_every_route(router: LiveRouter, oai: openai.OpenAI,
                                                       claude: anthropic.Anthropic) -> None:
    """A last assistant message is continued, not closed (llama.cpp's prefill): chat,
    /v1/messages and /v1/responses answer what /completion gives on the rendered prompt
    (which ends with the prefill text), streamed as not."""
    pre = "The three colours are"
    msgs = MSG + [{"role": "assistant", "content": pre}]
    prompt = httpx.post(f"{router.url}/apply-template", json={"model": "smollm2", "messages": msgs},
                        timeout=60).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n" + pre)
    want = httpx.post(f"{router.url}/completion", json={"model": "smollm2", "prompt": prompt, "n_predict": 12,
                                                       "temperature": 0}, timeout=300).json()["content"]
    assert want.strip()
    chat = oai.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=12, stream=True) if c.choices)  # type: ignore[arg-type]
    assert streamed == want
    m = claude.messages.create(model="smollm2", max_tokens=12, messages=msgs)  # type: ignore[arg-type]
    assert m.content[0].text == want  # type: ignore[union-attr]
    n = claude.messages.count_tokens(model="smollm2", messages=msgs)  # type: ignore[arg-type]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n.input_tokens \
        == chat.usage.prompt_tokens  # type: ignore[union-attr]
    r = oai.responses.create(model="smollm2", max_output_tokens=12, store=False, input=[
        {"role": "user", "content": MSG[0]["content"]}, {"role": "assistant", "content": pre}])
    assert r.output_text == want


# ----------------------------------------------------------------------------- OpenAI Responses


def test_responses_streamed_equals_non_streamed(oai: openai.OpenAI) -> None:
    kw = dict(model="smollm2", instructions="Answer briefly.", input=MSG[0]["content"], max_output_tokens=24)
    r = oai.responses.create(**kw)  # type: ignore[call-overload]
    assert r.output_text.strip() and r.status in ("completed", "incomplete")
    deltas, final = [], None
    for ev in oai.responses.create(**kw, stream=True):  # type: ignore[call-overload]
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and "".join(deltas) == final.output_text == r.output_text
    assert final.status == r.status and final.usage.output_tokens == r.usage.output_tokens  # type: ignore[union-attr]
    n = oai.responses.input_tokens.count(model="smollm2", instructions="Answer briefly.", input=MSG[0]["content"])
    assert n.input_tokens == r.usage.input_tokens == final.usage.input_tokens  # type: ignore[union-attr]
    follow = oai.responses.create(model="smollm2", input="Now one more colour.", previous_response_id=r.id,
                                  max_output_tokens=16)
    assert follow.output_text.strip() and follow.usage is not None
    assert follow.usage.input_tokens > r.usage.output_tokens  # type: ignore[union-attr]  # the answer is in the prompt


# ----------------------------------------------------------------------------- tools and structured output

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                  "required": ["city"]}
CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_calls(oai: openai.OpenAI, **kw: Any) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    """Tool calls put together from stream deltas, as SDK users do: by ``index``."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for ch in oai.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            e = calls.setdefault(tc.index, {"ids": [], "names": [], "arguments": ""})
            if tc.id:
                e["ids"].append(tc.id)
            if tc.function and tc.function.name:
                e["names"].append(tc.function.name)
            if tc.function and tc.function.arguments:
                e["arguments"] += tc.function.arguments
        finish = c.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_chat_tool_calls_streamed_equals_non_streamed(oai: openai.OpenAI, tool_choice: Any) -> None:
    kw: dict[str, Any] = dict(model="smollm2", messages=ASK, tools=CHAT_TOOLS, tool_choice=tool_choice, max_tokens=80)
    r = oai.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in CHAT_TOOLS}
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
    calls, finish, content = _stream_calls(oai, **kw)
    assert finish == "tool_calls" and content == ""
    assert sorted(calls) == list(range(len(ch.message.tool_calls)))  # index 0, 1, ...
    for i, c in enumerate(ch.message.tool_calls):
        assert len(calls[i]["ids"]) == 1 and len(calls[i]["names"]) == 1  # id / name only in the first fragment
        assert calls[i]["names"][0] == c.function.name and calls[i]["arguments"] == c.function.arguments


def test_chat_tool_round_trip_history_rendered(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="smollm2", messages=ASK, tools=CHAT_TOOLS, tool_choice="required",
                                    max_tokens=80)
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    kw: dict[str, Any] = dict(model="smollm2", messages=history, tools=CHAT_TOOLS, max_tokens=40)
    r2 = oai.chat.completions.create(**kw)
    # the history reached the prompt: more tokens than the question alone with the tools
    alone = oai.chat.completions.create(model="smollm2", messages=ASK, tools=CHAT_TOOLS, max_tokens=1)
    assert r2.usage is not None and alone.usage is not None and r2.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    c2 = r2.choices[0]
    if c2.message.tool_calls is None:  # auto: text, and no tool markup in it
        assert c2.finish_reason in ("stop", "length") and "<tool" not in (c2.message.content or "")
    calls, finish, content = _stream_calls(oai, **kw)
    assert finish == c2.finish_reason and (content or None) == c2.message.content
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.function.arguments for c in c2.message.tool_calls or []]


class Person(BaseModel):
    name: str
    age: int
    colours: list[str]


def test_chat_parse_with_a_pydantic_model_and_json_schema(oai: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Ann is 31 and likes red and blue. Describe her as JSON."}]
    p = oai.chat.completions.parse(model="smollm2", messages=msgs, response_format=Person, max_tokens=80)  # type: ignore[arg-type]
    person = p.choices[0].message.parsed
    assert isinstance(person, Person) and p.choices[0].finish_reason == "stop"
    schema = Person.model_json_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema, "strict": True}}
    r = oai.chat.completions.create(model="smollm2", messages=msgs, response_format=rf, max_tokens=80)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in oai.chat.completions.create(
        model="smollm2", messages=msgs, response_format=rf, max_tokens=80, stream=True) if ch.choices)  # type: ignore[arg-type]
    assert streamed == r.choices[0].message.content
    r = oai.chat.completions.create(model="smollm2", messages=msgs, response_format={"type": "json_object"},
                                    max_tokens=40)
    text = r.choices[0].message.content or ""
    assert text.startswith("{")  # any object; this small model may not close it within 40 tokens
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)


def test_invalid_schema_or_grammar_is_400_before_any_token(router: LiveRouter, oai: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            res = oai.chat.completions.create(model="smollm2", messages=MSG, response_format=bad, max_tokens=5,  # type: ignore[arg-type]
                                              stream=stream)
            list(res) if stream else None  # type: ignore[call-overload]
        assert e.value.code == "invalid_grammar" and e.value.param == "response_format" and "no-such" in str(e.value)
    r = httpx.post(router.url + "/completion", json={"model": "smollm2", "prompt": "x", "grammar": "start: (",
                                                     "stream": True}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
    r = httpx.post(router.url + "/v1/messages", json={"model": "smollm2", "max_tokens": 5, "messages": MSG, "tools": [
        {"name": "t", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}],
        "tool_choice": {"type": "any"}}, timeout=300)
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:  # a custom tool's grammar on /v1/responses
        oai.responses.create(model="smollm2", input="x", max_output_tokens=5, tool_choice="required", tools=[
            {"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}])
    assert e.value.code == "invalid_grammar" and e.value.param == "tools"


def test_unenforceable_schema_keywords_are_set_aside_visibly(router: LiveRouter, claude: anthropic.Anthropic,
                                                             oai: openai.OpenAI) -> None:
    """Zod-made schemas (Claude Code's tools) carry keywords no grammar enforces: the request
    is served with the grammar loosened, and the header names each keyword set aside."""
    tools = [{"name": "task", "description": "Create a task",
              "input_schema": {"type": "object", "properties": {
                  "title": {"type": "string"},
                  "meta": {"type": "object", "propertyNames": {"type": "string"},
                           "additionalProperties": {"type": "string"}}}, "required": ["title"]}}]
    raw = claude.messages.with_raw_response.create(model="smollm2", max_tokens=40, tools=tools,  # type: ignore[arg-type]
                                                   tool_choice={"type": "any"}, messages=MSG)
    assert raw.headers["x-modelyard-set-aside"] == "tools:propertyNames"
    msg = raw.parse()
    assert msg.stop_reason in ("tool_use", "max_tokens")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such"}, "b": {"not": {"type": "null"}}},
        "required": ["a"]}}}
    raw2 = oai.chat.completions.with_raw_response.create(model="smollm2", messages=MSG, response_format=fmt,  # type: ignore[arg-type]
                                                         max_tokens=20)
    assert "response_format:not" in raw2.headers["x-modelyard-set-aside"]
    raw3 = oai.chat.completions.with_raw_response.create(model="smollm2", messages=MSG, max_tokens=2)
    assert "x-modelyard-set-aside" not in raw3.headers


def test_models_list_the_gguf_context_before_any_load(router: LiveRouter) -> None:
    m = httpx.get(router.url + "/v1/models/smollm2", timeout=30).json()
    assert m["context_length"] == m["max_model_len"] == 1024  # the configured n_ctx
    assert m["meta"]["n_ctx_train"] == 8192  # SmolLM2's GGUF header


def test_completion_json_schema_and_lark_grammar(router: LiveRouter) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    body = {"model": "smollm2", "prompt": "A JSON object about a colour:", "n_predict": 40, "temperature": 0,
            "json_schema": schema}
    out = httpx.post(router.url + "/completion", json=body, timeout=300).json()
    jsonschema.validate(json.loads(out["content"]), schema)
    assert out["stop_type"] == "eos"
    with httpx.stream("POST", router.url + "/completion", json={**body, "stream": True}, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(c["content"] for c in chunks) == out["content"]
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"\n'
    out = httpx.post(router.url + "/completion", json={"model": "smollm2", "prompt": "Is the sky blue?",
                                                       "n_predict": 20, "temperature": 0, "grammar": lark},
                     timeout=300).json()
    assert out["content"] in ("The answer is yes.", "The answer is no.")


def test_cancelled_constrained_stream_leaves_the_worker_clean(router: LiveRouter, oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="smollm2", messages=MSG, response_format={"type": "json_object"}, max_tokens=60)
    fresh = oai.chat.completions.create(**kw).choices[0].message.content
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**kw, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # leave after the first text: the request is cancelled
    for _ in range(2):
        assert oai.chat.completions.create(**kw).choices[0].message.content == fresh


# ----------------------------------------------------------------------------- tools: Anthropic and Responses


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools: list[Any] = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": WEATHER_PARAMS}]
    kw: dict[str, Any] = dict(model="smollm2", max_tokens=80, tools=tools, tool_choice={"type": "any"}, messages=ASK)
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    tu = m.content[0]
    assert tu.type == "tool_use" and tu.name == "get_weather" and tu.id.startswith("toolu_")
    jsonschema.validate(tu.input, WEATHER_PARAMS)
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(tu.name, tu.input)]  # type: ignore[union-attr]
    after = claude.messages.create(model="smollm2", max_tokens=40, tools=tools, messages=[
        *ASK, {"role": "assistant", "content": [tu.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "18 C and sunny"}]}])
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    if after.stop_reason != "tool_use":
        assert after.content[0].type == "text" and "<tool" not in after.content[0].text
    n = claude.messages.count_tokens(model="smollm2", tools=tools, messages=ASK)
    assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_responses_function_call_streamed_equals_non_streamed(oai: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
                         "parameters": WEATHER_PARAMS}]
    kw: dict[str, Any] = dict(model="smollm2", input=ASK[0]["content"], tools=tools, tool_choice="required",
                              max_output_tokens=80)
    r = oai.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER_PARAMS)
    final = None
    done_args = []
    for ev in oai.responses.create(**kw, stream=True):
        if ev.type == "response.function_call_arguments.done":
            done_args.append((ev.name, ev.arguments))
        elif ev.type == "response.completed":
            final = ev.response
    assert done_args == [(c.name, c.arguments) for c in calls]
    assert final is not None and [o.arguments for o in final.output if o.type == "function_call"] == \
        [c.arguments for c in calls]
    n = oai.responses.input_tokens.count(model="smollm2", input=ASK[0]["content"], tools=tools,  # type: ignore[arg-type]
                                         tool_choice="required")
    assert n.input_tokens == r.usage.input_tokens == final.usage.input_tokens  # type: ignore[union-attr]
    after = oai.responses.create(model="smollm2", tools=tools, max_output_tokens=40, input=[
        ASK[0], {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                 "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}])
    assert after.status in ("completed", "incomplete") and "<tool" not in after.output_text


def test_responses_custom_tool_with_a_lark_or_regex_grammar(oai: openai.OpenAI) -> None:
    """Codex-style custom tools: the call's free-text input follows the tool's grammar."""
    lark = {"type": "grammar", "syntax": "lark", "definition": 'start: WORD (" " WORD)*\nWORD: /[A-Z]{1,10}/\n'}
    regex = {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,8} [0-9]{2}"}
    for fmt, pattern in ((lark, r"[A-Z]{1,10}( [A-Z]{1,10})*"), (regex, r"[a-z]{1,8} [0-9]{2}")):
        tools: list[Any] = [{"type": "custom", "name": "shout", "description": "Shout words", "format": fmt}]
        kw: dict[str, Any] = dict(model="smollm2", input="Shout hello world.", tools=tools,
                                  tool_choice={"type": "custom", "name": "shout"}, max_output_tokens=40)
        r = oai.responses.create(**kw)
        assert [o.type for o in r.output] == ["custom_tool_call"] and r.status == "completed"
        call = r.output[0]
        assert call.name == "shout" and re.fullmatch(pattern, call.input), call.input  # type: ignore[union-attr]
        done = [e.input for e in oai.responses.create(**kw, stream=True)
                if e.type == "response.custom_tool_call_input.done"]
        assert done == [call.input]  # type: ignore[union-attr]


def test_chat_custom_tool_with_a_grammar(oai: openai.OpenAI) -> None:
    """OpenAI chat custom tools: the input follows the tool's grammar, streamed == not."""
    fmt = {"type": "grammar", "grammar": {"syntax": "regex", "definition": "[a-z]{1,8} [0-9]{2}"}}
    kw: dict[str, Any] = dict(model="smollm2", messages=[{"role": "user", "content": "Shout hello."}], max_tokens=40,
                              tools=[{"type": "custom", "custom": {"name": "shout", "format": fmt}}],
                              tool_choice={"type": "custom", "custom": {"name": "shout"}})
    r = oai.chat.completions.create(**kw)
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert r.choices[0].finish_reason == "tool_calls" and call.type == "custom" and call.custom.name == "shout"  # type: ignore[union-attr]
    assert re.fullmatch(r"[a-z]{1,8} [0-9]{2}", call.custom.input)  # type: ignore[union-attr]
    streamed = [d.model_extra["custom"]["input"] for ch in oai.chat.completions.create(**kw, stream=True)  # type: ignore[index]
                if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert streamed == [call.custom.input]  # type: ignore[union-attr]


def test_structured_output_on_responses_and_messages(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    schema = Person.model_json_schema()
    prompt = "Ann is 31 and likes red and blue. Describe her as JSON."
    kw: dict[str, Any] = dict(model="smollm2", input=prompt, max_output_tokens=80,
                              text={"format": {"type": "json_schema", "name": "Person", "schema": schema,
                                               "strict": True}})
    r = oai.responses.create(**kw)
    jsonschema.validate(json.loads(r.output_text), schema)
    streamed = "".join(e.delta for e in oai.responses.create(**kw, stream=True) if e.type == "response.output_text.delta")
    assert streamed == r.output_text
    m = claude.messages.create(model="smollm2", max_tokens=80, messages=[{"role": "user", "content": prompt}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})  # type: ignore[typeddict-item]
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)  # type: ignore[union-attr]
