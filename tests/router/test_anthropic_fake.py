"""The Anthropic Messages API against fake workers: shapes, event order, error shape,
x-api-key, history rendering (tool_use / tool_result), tool-call parsing.

The fake worker's ``[reply64=...]`` directive makes it answer a chosen text, so the
parsing of tool calls is tested here without a model; the real-model behaviour
(constraints, the SDK round trip) is in tests/e2e/test_harness_apis.py.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import anthropic
import httpx
import pytest

from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
api_key = "sekrit"
[models.alpha]
path = "alpha.gguf"
"""

H = {"x-api-key": "sekrit", "anthropic-version": "2023-06-01"}


router = router_fixture(CONFIG, ggufs=("alpha.gguf",))


@pytest.fixture(scope="module")
def client(router: LiveRouter) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="sekrit", max_retries=0, timeout=30)


def reply(text: str) -> str:
    return "[reply64=" + base64.b64encode(text.encode()).decode() + "]"


def events(router: LiveRouter, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", router.url + "/v1/messages", json={**body, "stream": True}, headers=H,
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
    return out


def test_text_message_and_stream_event_order(router: LiveRouter, client: anthropic.Anthropic) -> None:
    body = {"model": "alpha", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    m = client.messages.create(**body)  # type: ignore[arg-type]
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.content[0].text == " w100 w101 w102 w103 w104"
    assert m.usage.output_tokens == 5 and m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0
    evs = events(router, body)
    names = [n for n, _ in evs]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")
    assert text == m.content[0].text
    delta = evs[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


def test_stop_sequence_and_end_turn(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="alpha", max_tokens=50, stop_sequences=["w103"],
                               messages=[{"role": "user", "content": "hi"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "w103"
    assert m.content[0].text == " w100 w101 w102 "  # type: ignore[union-attr]
    m = client.messages.create(model="alpha", max_tokens=50, messages=[{"role": "user", "content": "hi [len=2]"}])
    assert m.stop_reason == "end_turn"


def test_errors_are_anthropic_shaped(router: LiveRouter, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    r = httpx.post(router.url + "/v1/messages", json={"model": "alpha", "messages": [{"role": "user", "content": "x"}]},
                   headers=H)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    for bad, field in [
        ({"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}, "image"),
        ({"role": "tool", "content": "x"}, "role"),
    ]:
        r = httpx.post(router.url + "/v1/messages", json={"model": "alpha", "max_tokens": 5, "messages": [bad]},
                       headers=H)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = httpx.post(router.url + "/v1/messages", json={"model": "alpha", "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "x"}]},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # the OpenAI routes keep OpenAI's shape, and take x-api-key too
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "nope", "messages": []}, headers=H)
    assert r.status_code == 404 and "type" not in r.json() and r.json()["error"]["code"] == "model_not_found"


def test_unknown_and_ignored_fields(router: LiveRouter, client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="alpha", max_tokens=3, metadata={"user_id": "u"}, service_tier="auto",
                               thinking={"type": "enabled", "budget_tokens": 1024},
                               system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                               messages=[{"role": "user", "content": [
                                   {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
                               extra_body={"some_future_field": 1},
                               extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert m.content[0].text  # type: ignore[union-attr]
    ev = router.fake_events("generate")[-1]
    assert ev["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    r = httpx.post(router.url + "/v1/messages", headers=H, json={
        "model": "alpha", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 200 and r.headers["x-modelyard-set-aside"] == "tools[0]:web_search_20250305"


def test_tool_history_is_rendered_not_dropped(router: LiveRouter, client: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    client.messages.create(model="alpha", max_tokens=3, tools=tools, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                     {"type": "text", "text": "And so?"}]},
    ])
    msgs = router.fake_events("generate")[-1]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert msgs[3]["content"] == "The tool get_weather returned:\n18 C\nAnswer the question with it.\n\nAnd so?"


def test_system_turns_inside_messages_are_kept_in_place(router: LiveRouter, client: anthropic.Anthropic) -> None:
    """Claude Code's mid-conversation system turns: rendered where they stand, not a 400."""
    out = client.messages.create(model="alpha", max_tokens=3, system="top", messages=[  # type: ignore[list-item]
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
        {"role": "user", "content": "three"},
    ])
    assert out.stop_reason == "max_tokens"
    msgs = router.fake_events("generate")[-1]["messages"]
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("system", "top"), ("user", "one"), ("assistant", "two"), ("system", "reminder"), ("user", "three")]


def test_server_tools_set_aside_visibly(router: LiveRouter) -> None:
    """A server tool (web search, ...) cannot run here: served without it, named in the header."""
    body = {"model": "alpha", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                      {"name": "f", "input_schema": {"type": "object", "properties": {}}}]}
    r = httpx.post(router.url + "/v1/messages", json=body, headers=H)
    assert r.status_code == 200, r.text
    assert r.headers["x-modelyard-set-aside"] == "tools[0]:web_search_20250305"
    msgs = router.fake_events("generate")[-1]["messages"]
    assert '"name": "f"' in msgs[0]["content"] and "web_search" not in msgs[0]["content"]
    with httpx.stream("POST", router.url + "/v1/messages", json={**body, "stream": True}, headers=H) as r:
        assert r.status_code == 200 and r.headers["x-modelyard-set-aside"] == "tools[0]:web_search_20250305"
        r.read()
    r = httpx.post(router.url + "/v1/messages", json={**body, "tools": body["tools"][1:]}, headers=H)
    assert r.status_code == 200 and "x-modelyard-set-aside" not in r.headers


def test_a_tool_choice_of_a_server_tool_is_set_aside_with_it(router: LiveRouter) -> None:
    """A request forcing its only (server) tool — tool_choice {"type": "tool", "name":
    "web_search"} or "any" — was a 400 "'tool_choice' naming a tool needs 'tools'" though it
    gave one: the choice is set aside with the tool. A custom tool it names is still honoured,
    and a choice of a tool never given is still a 400."""
    ws = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    base = {"model": "alpha", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    for tc, item in (({"type": "tool", "name": "web_search"}, "tool_choice:web_search"),
                     ({"type": "any"}, "tool_choice:any")):
        r = httpx.post(router.url + "/v1/messages", json={**base, "tools": [ws], "tool_choice": tc}, headers=H)
        assert r.status_code == 200, r.text
        assert r.headers["x-modelyard-set-aside"] == f"tools[0]:web_search_20250305, {item}"
    f = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
    r = httpx.post(router.url + "/v1/messages", headers=H,
                   json={**base, "tools": [ws, f], "tool_choice": {"type": "any"}})
    assert r.status_code == 200 and r.headers["x-modelyard-set-aside"] == "tools[0]:web_search_20250305"
    r = httpx.post(router.url + "/v1/messages", headers=H,
                   json={**base, "tools": [ws, f], "tool_choice": {"type": "tool", "name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_consecutive_assistant_turns_are_combined_once() -> None:
    """A run of assistant turns becomes one, texts and tool calls in order (joined once: merging
    pairwise was quadratic on the event loop — 4,000 turns of 2 KB held every client 7.9 s)."""
    from router.dialects.anthropic_api import _turns

    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                         {"role": "assistant", "content": [use]}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "r"}]
            + [{"role": "assistant", "content": str(i)} for i in range(3000)]}
    turns = _turns(body)
    assert [t.role for t in turns] == ["user", "assistant", "user", "assistant"]
    assert turns[1].content == "a\n\nb" and [c.id for c in turns[1].tool_calls] == ["t1"]
    assert turns[3].content == "\n\n".join(str(i) for i in range(3000)) and turns[3].tool_calls == []


def test_a_prompt_too_long_to_tokenize_is_worded_as_anthropic_words_it() -> None:
    """The worker refuses a prompt of more characters than n_ctx tokens can hold before
    tokenizing it (no token count): /v1/messages answered in OpenAI's wording, which Claude
    Code does not parse to compact; now 'prompt is too long: N tokens > M maximum' with the
    least count the characters imply."""
    from router.dialects.anthropic_api import anthropic_context_error
    from router.http.errors import ContextLengthExceeded

    e = ContextLengthExceeded("This model's maximum context length is 8192 tokens. However, the prompt has "
                              "7807946 characters, more than 8192 tokens of at most 162 characters can hold.")
    out = anthropic_context_error(e)
    m = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum", out.message)
    assert m is not None and m.groups() == ("48198", "8191"), out.message
    assert out.param == "messages" and out.n_ctx == 8192 and out.n_prompt_tokens == 48198
    other = ContextLengthExceeded("something else")
    assert anthropic_context_error(other) is other


def test_many_server_tools_are_set_aside_in_bounds(router: LiveRouter) -> None:
    """5,000 server tools: one request, one header within its bound, 33 log lines (32 items and
    one saying more follow) — each item was a warning, found by a list scan (quadratic)."""
    before = router.log_path.read_text(errors="replace")
    tools = [{"type": f"web_search_{i}", "name": f"w{i}"} for i in range(5000)]
    body = {"model": "alpha", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    r = httpx.post(router.url + "/v1/messages", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    value = r.headers["x-modelyard-set-aside"]
    assert value.startswith("tools[0]:web_search_0, tools[1]:web_search_1") and value.endswith(" more")
    assert len(value) <= 2048 + 20
    new = router.log_path.read_text(errors="replace")[len(before):]
    assert new.count(": set aside tools[") == 32 and new.count("more than 32 items set aside") == 1


def test_set_aside_header_of_a_hostile_tool_type(router: LiveRouter) -> None:
    """A server tool's ``type`` is the client's text: CR/LF or non-ASCII in it reach the
    X-Modelyard-Set-Aside header escaped (h11 refused the raw value: an empty reply), never a
    header of their own, and a long one is cut."""
    body = {"model": "alpha", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search\r\nX-Evil: 1", "name": "w"}, {"type": "s\u00e9arch_" + "x" * 500}]}
    r = httpx.post(router.url + "/v1/messages", json=body, headers=H)
    assert r.status_code == 200, r.text
    assert "x-evil" not in r.headers
    value = r.headers["x-modelyard-set-aside"]
    first, second = value.split(", ")
    assert first == "tools[0]:web_search\\r\\nX-Evil: 1"
    assert second.startswith("tools[1]:s\\xe9arch_xxx") and second.endswith("...") and len(second) < 140
    assert value.isascii() and value.isprintable()


def test_tool_use_parsed_streamed_and_not(router: LiveRouter, client: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {"model": "alpha", "max_tokens": 100, "tools": tools,
            "messages": [{"role": "user", "content": reply(call + "\n" + call)}]}
    m = client.messages.create(**body)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"})] * 2  # type: ignore[union-attr]
    ids = [b.id for b in m.content]  # type: ignore[union-attr]
    assert len(set(ids)) == 2 and all(i.startswith("toolu_") for i in ids)
    with client.messages.stream(**body) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in m.content]  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    evs = events(router, body)
    # undecided between text and a call, the stream opens before its first block: its ping comes
    # before it (Anthropic streams may carry pings anywhere)
    assert [n for n, _ in evs][:3] == ["message_start", "ping", "content_block_start"]
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in evs if n == "content_block_delta")
    # text that only looks like the start of a call is content, nothing held back is lost
    m = client.messages.create(**{**body, "messages": [{"role": "user", "content": reply("<tool is fine")}]})  # type: ignore[arg-type]
    assert m.content[0].text == "<tool is fine" and m.stop_reason == "end_turn"  # type: ignore[union-attr]


def test_count_tokens_agrees_with_usage(client: anthropic.Anthropic) -> None:
    msgs = [{"role": "user", "content": "count me [len=2]"}]
    n = client.messages.count_tokens(model="alpha", system="s", messages=msgs)  # type: ignore[arg-type]
    m = client.messages.create(model="alpha", max_tokens=5, system="s", messages=msgs)  # type: ignore[arg-type]
    assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0


def test_too_long_prompt_in_anthropic_wording(router: LiveRouter, client: anthropic.Anthropic) -> None:
    """Claude Code starts its compaction on Anthropic's own wording only."""
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="alpha", max_tokens=32000,
                               messages=[{"role": "user", "content": "word " * 3000}])
    err = e.value.body["error"]  # type: ignore[index]
    assert err["type"] == "invalid_request_error"
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", err["message"])
    assert m and int(m.group(1)) > int(m.group(2)), err
    r = httpx.post(router.url + "/v1/chat/completions", headers=H, json={
        "model": "alpha", "messages": [{"role": "user", "content": "word " * 3000}]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_failure_mid_stream_is_an_error_event(router: LiveRouter) -> None:
    evs = events(router, {"model": "alpha", "max_tokens": 20, "messages": [{"role": "user", "content": "hi [crash]"}]})
    assert evs[0][0] == "message_start" and evs[-1][0] == "error"
    err = evs[-1][1]
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and err["error"]["code"] == "worker_crashed"
    assert "message_stop" not in [n for n, _ in evs]

