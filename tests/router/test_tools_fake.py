"""Tools and structured output on the OpenAI chat and llama.cpp routes against fake
workers: what reaches the worker (the constraint, the rendered prompt), tool calls parsed
from the generic tool format into OpenAI's shape (streamed deltas with index), and the
400s that name the field."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import openai
import pytest

from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[models.alpha]
path = "alpha.gguf"
"""

TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


router = router_fixture(CONFIG, ggufs=("alpha.gguf",))


def reply(text: str) -> str:
    return "[reply64=" + base64.b64encode(text.encode()).decode() + "]"


def last_generate(router: LiveRouter) -> dict[str, Any]:
    return router.fake_events("generate")[-1]


def test_tool_choice_becomes_a_grammar(router: LiveRouter) -> None:
    c = router.client()
    c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}], tools=TOOLS, max_tokens=2)
    g = last_generate(router)
    assert g["grammar"].startswith("start: calls | TEXT") and g["json_schema"] is None
    assert "You can call these tools" in g["messages"][0]["content"]
    c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}], tools=TOOLS, max_tokens=2,
                              tool_choice="required", parallel_tool_calls=False)
    g = last_generate(router)["grammar"]
    assert g.startswith("start: calls\ncalls: call\n") and '"additionalProperties": false' in g
    c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}], tools=TOOLS, max_tokens=2,
                              tool_choice="none")
    g = last_generate(router)
    assert g["grammar"] is None and "tools" not in g["messages"][0]["content"]
    rf = {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                 "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}], response_format=rf,  # type: ignore[arg-type]
                              max_tokens=2)
    assert json.loads(last_generate(router)["json_schema"]) == {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
    httpx.post(router.url + "/completion", json={"prompt": "x", "n_predict": 2, "grammar": 'start: "a"'}, timeout=30)
    assert last_generate(router)["grammar"] == 'start: "a"'
    httpx.post(router.url + "/completion", json={"prompt": "x", "n_predict": 2, "json_schema": {"type": "integer"}},
               timeout=30)
    assert last_generate(router)["json_schema"] == '{"type": "integer"}'


def test_tool_calls_parsed_streamed_and_not(router: LiveRouter) -> None:
    c = router.client()
    kw: dict[str, Any] = dict(model="alpha", tools=TOOLS, messages=[{"role": "user", "content": reply(CALL + CALL)}])
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None and m.tool_calls is not None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_weather", {"city": "Paris"})] * 2
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 0, 1, 1]
    assert [bool(d.id) for d in deltas] == [True, False, True, False]
    assert "".join(d.function.arguments or "" for d in deltas if d.index == 1) == m.tool_calls[1].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices)
    # with tools offered, text that never becomes a call is content, all of it
    r = c.chat.completions.create(**{**kw, "messages": [{"role": "user", "content": reply("  <to be sure")}]})
    assert r.choices[0].message.content == "  <to be sure" and r.choices[0].finish_reason == "stop"
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        **{**kw, "messages": [{"role": "user", "content": reply("  <to be sure")}]}, stream=True) if ch.choices)
    assert text == "  <to be sure"


def test_history_with_tool_calls_is_rendered(router: LiveRouter) -> None:
    router.client().chat.completions.create(model="alpha", tools=TOOLS, max_tokens=2, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]},
    ])
    msgs = last_generate(router)["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == CALL and '"Rome"' in msgs[4]["content"]
    assert msgs[5]["content"] == "The tool get_weather returned:\n25 C\nAnswer the question with it."


CUSTOM = [{"type": "custom", "custom": {"name": "shout", "description": "Shout",
                                       "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": "[A-Z]+"}}}}]


def test_chat_custom_tools(router: LiveRouter) -> None:
    """OpenAI's custom tools on chat completions: the tool's grammar constrains the call's
    input, the call comes back as ``{"type": "custom", "custom": {"name", "input"}}``
    (streamed: one fragment with index and id), and goes back into history."""
    c = router.client()
    block = '<tool_call name="shout">\nHELLO\n</tool_call>'
    kw: dict[str, Any] = dict(model="alpha", tools=CUSTOM, tool_choice={"type": "custom", "custom": {"name": "shout"}},
                              messages=[{"role": "user", "content": reply(block)}])
    r = c.chat.completions.create(**kw)
    g = json.loads(last_generate(router)["grammar"])
    assert {"name": "custom_0", "lark_grammar": "start: /[A-Z]+/\n"} in g["grammars"]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert r.choices[0].finish_reason == "tool_calls" and call.type == "custom"
    assert call.custom.name == "shout" and call.custom.input == "HELLO" and call.id.startswith("call_")  # type: ignore[union-attr]
    deltas = [tc for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
              for tc in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.type, d.model_extra["custom"]) for d in deltas] == [  # type: ignore[index]
        (0, "custom", {"name": "shout", "input": "HELLO"})]
    c.chat.completions.create(model="alpha", max_tokens=2, tools=CUSTOM, messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "call_9", "type": "custom", "custom": {"name": "shout", "input": "HI"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "done"}])
    msgs = last_generate(router)["messages"]
    assert msgs[2]["content"] == '<tool_call name="shout">\nHI\n</tool_call>' and "shout returned" in msgs[3]["content"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "ebnf", "definition": "x"}}}}]}, "tools[0].custom.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages[0].tool_calls[0]"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tools": TOOLS + TOOLS[:1]}, f"tools[{len(TOOLS)}]"),  # a second tool of one name
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_fields_are_400_naming_them(router: LiveRouter, body: dict[str, Any], param: str) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json={
        "model": "alpha", "messages": [{"role": "user", "content": "x"}], **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
