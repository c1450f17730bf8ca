"""The OpenAI Responses API against fake workers: object and event shapes, function
calls parsed from the generic tool format, the bounded store (count here, TTL with a
fake clock), previous_response_id history, refusals naming the field."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import openai
import pytest

from router.dialects.response_store import ResponseStore
from router.dialects.tools import ChatTurn
from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
responses_store_max = 2
[models.alpha]
path = "alpha.gguf"
"""


router = router_fixture(CONFIG, ggufs=("alpha.gguf",))


@pytest.fixture(scope="module")
def client(router: LiveRouter) -> openai.OpenAI:
    return router.client(timeout=30)


def reply(text: str) -> str:
    return "[reply64=" + base64.b64encode(text.encode()).decode() + "]"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "weather",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_text_response_and_stream_events(client: openai.OpenAI) -> None:
    r = client.responses.create(model="alpha", input="hi", max_output_tokens=4)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == " w100 w101 w102 w103" and r.usage is not None and r.usage.output_tokens == 4
    evs = list(client.responses.create(model="alpha", input="hi", max_output_tokens=4, stream=True))
    kinds = [e.type for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == r.output_text
    assert evs[-1].response.output_text == r.output_text  # type: ignore[union-attr]
    r = client.responses.create(model="alpha", input="hi [len=2]")
    assert r.status == "completed" and r.incomplete_details is None


def test_function_calls_streamed_and_not(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="alpha", tools=TOOLS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": reply(CALL + CALL)}]}])
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})] * 2
    assert len({c.call_id for c in calls}) == 2 and all(c.call_id.startswith("call_") for c in calls)
    assert not [o for o in r.output if o.type == "message"]
    evs = list(client.responses.create(**kw, stream=True))
    done = [e for e in evs if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [(c.name, json.loads(c.arguments)) for c in calls]
    assert [e.output_index for e in done] == [0, 1]
    assert not [e for e in evs if e.type.startswith("response.output_text")]


def test_history_items_rendered(router: LiveRouter, client: openai.OpenAI) -> None:
    client.responses.create(model="alpha", tools=TOOLS, instructions="be nice", input=[
        {"type": "message", "role": "developer", "content": "dev"},
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ])
    msgs = router.fake_events("generate")[-1]["messages"]
    assert [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("be nice\n\nYou can call these tools")
    assert msgs[3]["content"] == CALL
    assert msgs[4]["content"] == "The tool get_weather returned:\n18 C\nAnswer the question with it."


def test_store_previous_response_and_bound(router: LiveRouter, client: openai.OpenAI) -> None:
    a = client.responses.create(model="alpha", input="first", instructions="only once", max_output_tokens=2)
    assert client.responses.retrieve(a.id).output_text == a.output_text
    b = client.responses.create(model="alpha", input="second", previous_response_id=a.id, max_output_tokens=2)
    msgs = router.fake_events("generate")[-1]["messages"]
    assert msgs == [{"role": "user", "content": "first"}, {"role": "assistant", "content": a.output_text},
                    {"role": "user", "content": "second"}]  # instructions are not carried over
    client.responses.create(model="alpha", input="third", previous_response_id=b.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # store holds 2: the oldest is gone
        client.responses.retrieve(a.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="alpha", input="x", previous_response_id=a.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    n = client.responses.create(model="alpha", input="unstored", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(n.id)
    client.responses.delete(b.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b.id)


def test_a_prefill_is_stored_as_one_turn_with_its_continuation(router: LiveRouter, client: openai.OpenAI) -> None:
    a = client.responses.create(model="alpha", max_output_tokens=2, input=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "Sure:"}])
    client.responses.create(model="alpha", input="next", previous_response_id=a.id, max_output_tokens=2)
    msgs = router.fake_events("generate")[-1]["messages"]
    assert msgs == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "Sure:" + a.output_text},
                    {"role": "user", "content": "next"}]


def test_refusals_name_the_field(router: LiveRouter) -> None:
    for body, param in [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "x", "tools": [{"name": "untyped"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice.name"),
        ({}, "input"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ]:
        r = httpx.post(router.url + "/v1/responses", json={"model": "alpha", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_input_tokens_agrees_with_usage(client: openai.OpenAI) -> None:
    n = client.responses.input_tokens.count(model="alpha", input="count me [len=2]", instructions="s")
    r = client.responses.create(model="alpha", input="count me [len=2]", instructions="s")
    assert r.usage is not None and n.input_tokens == r.usage.input_tokens > 0


def test_store_ttl_and_count_with_a_fake_clock() -> None:
    now = [0.0]
    st = ResponseStore(3, 10.0, clock=lambda: now[0])
    for i in range(4):
        st.put(f"r{i}", {"id": f"r{i}"}, [ChatTurn("user", str(i))])
        now[0] += 1
    assert st.get("r0") is None and len(st) == 3  # count bound: oldest first
    now[0] = 11.5  # r1 stored at 1.0, r2 at 2.0, r3 at 3.0
    assert st.get("r1") is None and st.get("r2") is not None
    now[0] = 13.0
    assert len(st) == 0
    assert len(ResponseStore(0, 10.0)) == 0


def test_custom_tool_calls_and_history(router: LiveRouter, client: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "custom", "name": "apply_patch", "description": "edit files",
                         "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** " /[a-z ]+/'}}]
    block = '<tool_call name="apply_patch">\n*** add a line\n</tool_call>'
    r = client.responses.create(model="alpha", tools=tools, input=reply(block))
    assert [(o.type, o.name, o.input) for o in r.output] == [("custom_tool_call", "apply_patch", "*** add a line")]  # type: ignore[union-attr]
    g = json.loads(router.fake_events("generate")[-1]["grammar"])  # llguidance's JSON form: main + the tool's grammar
    assert g["grammars"][1] == {"name": "custom_0", "lark_grammar": 'start: "*** " /[a-z ]+/'}
    assert "@custom_0" in g["grammars"][0]["lark_grammar"]
    evs = list(client.responses.create(model="alpha", tools=tools, input=reply(block), stream=True))
    assert [e.input for e in evs if e.type == "response.custom_tool_call_input.done"] == ["*** add a line"]  # type: ignore[union-attr]
    client.responses.create(model="alpha", tools=tools, input=[
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": "*** x"},
        {"type": "custom_tool_call_output", "call_id": "call_9", "output": "ok"}])
    msgs = router.fake_events("generate")[-1]["messages"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call name="apply_patch">\n*** x\n</tool_call>'}
    assert msgs[3]["content"].startswith("The tool apply_patch returned:\nok")
    r2 = httpx.post(router.url + "/v1/responses", json={"model": "alpha", "input": "x", "tools": [
        {"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}]})
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "tools[0].format"


def test_output_text_logprobs_when_included_streamed_and_not(client: openai.OpenAI) -> None:
    """include message.output_text.logprobs + top_logprobs: each output token's logprob and
    alternatives (the same streamed as not); without the include none are sent; a completed
    response has completed_at."""
    kw: dict[str, Any] = {"model": "alpha", "input": "hi [len=3]", "include": ["message.output_text.logprobs"],
                          "top_logprobs": 2}
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.completed_at is not None and r.completed_at >= r.created_at
    part = r.output[0].content[0]  # type: ignore[union-attr]
    lps = part.logprobs
    assert lps is not None and "".join(lp.token for lp in lps) == r.output_text and len(lps) == 3
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert r.top_logprobs == 2
    evs = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in evs if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in lps]
    done = next(e for e in evs if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in lps]
    plain = client.responses.create(model="alpha", input="hi [len=3]", top_logprobs=2)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_failure_mid_stream_is_response_failed(client: openai.OpenAI) -> None:
    evs = list(client.responses.create(model="alpha", input="hi [crash]", stream=True))
    assert evs[0].type == "response.created" and evs[-1].type == "response.failed"
    assert evs[-1].response.status == "failed" and evs[-1].response.error is not None  # type: ignore[union-attr]
    assert evs[-1].response.error.code == "worker_crashed"  # type: ignore[union-attr]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
