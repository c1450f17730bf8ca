"""What Codex CLI sends on every /v1/responses request, against fake workers:
``namespace`` tools flattened to their functions (the model sees
``<namespace>__<name>``; calls come back as ``name`` + ``namespace``, streamed and
not, and are read back so from ``input``), hosted built-in tools and a
``tool_choice`` naming one set aside (200, a warning, the ``X-Modelyard-Set-Aside``
header), ``allowed_tools``."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx

from router.http.set_aside import HEADER, header_value
from router.dialects.tools import namespaced_name
from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[models.alpha]
path = "alpha.gguf"
"""

FN = {"type": "function", "name": "exec_command", "description": "run a command", "strict": False,
      "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
NS = {"type": "namespace", "name": "agents_v1", "description": "sub-agents", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "start one", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}},
    {"type": "function", "name": "close_agent", "description": "stop one",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}]}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
          {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1"}, {"type": "local_shell"}]


router = router_fixture(CONFIG, ggufs=("alpha.gguf",))


def reply(text: str) -> str:
    return "[reply64=" + base64.b64encode(text.encode()).decode() + "]"


def call_block(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def post(router: LiveRouter, **body: Any) -> httpx.Response:
    return httpx.post(router.url + "/v1/responses", json={"model": "alpha", **body}, timeout=30)


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_flat_name_is_codex_canonical_form() -> None:
    assert namespaced_name("multi_agent_v1", "spawn_agent") == "multi_agent_v1__spawn_agent"
    assert namespaced_name("ns_", "_f") == "ns__f"  # underscores around the separator trimmed


def test_namespace_functions_offered_flat_and_calls_given_back_split(router: LiveRouter) -> None:
    out = call_block("agents_v1__spawn_agent", {"task": "look"})
    r = post(router, tools=[FN, NS], input=reply(out))
    assert r.status_code == 200, r.text
    assert HEADER.lower() not in r.headers  # nothing set aside
    gen = router.fake_events("generate")[-1]
    listing = gen["messages"][0]["content"]
    for name in ("exec_command", "agents_v1__spawn_agent", "agents_v1__close_agent"):
        assert f'"name": "{name}"' in listing
    assert '"name": "agents_v1"' not in listing  # the namespace itself is no tool
    (item,) = r.json()["output"]
    assert item["type"] == "function_call" and item["name"] == "spawn_agent" and item["namespace"] == "agents_v1"
    assert json.loads(item["arguments"]) == {"task": "look"}
    # a plain function's call has no namespace
    r = post(router, tools=[FN, NS], input=reply(call_block("exec_command", {"cmd": "ls"})))
    (item,) = r.json()["output"]
    assert item["name"] == "exec_command" and "namespace" not in item


def test_namespace_call_streamed(router: LiveRouter) -> None:
    out = call_block("agents_v1__close_agent", {"id": "a1"})
    r = post(router, tools=[NS], input=reply(out), stream=True)
    assert r.status_code == 200
    evs = sse_events(r)
    done = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["namespace"]) for e in done] == [("close_agent", "agents_v1")]
    items = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["namespace"]) for i in items] == [("close_agent", "agents_v1")]
    final = evs[-1]["response"]["output"]
    assert [(i["name"], i["namespace"]) for i in final] == [("close_agent", "agents_v1")]


def test_namespaced_history_read_back_as_the_flat_name(router: LiveRouter) -> None:
    r = post(router, tools=[NS], input=[
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "call_1", "name": "spawn_agent", "namespace": "agents_v1",
         "arguments": '{"task": "t"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "started"}])
    assert r.status_code == 200, r.text
    msgs = router.fake_events("generate")[-1]["messages"]
    assert msgs[2]["content"] == call_block("agents_v1__spawn_agent", {"task": "t"})
    assert msgs[3]["content"].startswith("The tool agents_v1__spawn_agent returned:\nstarted")


def test_hosted_tools_set_aside_with_a_header_and_a_warning(router: LiveRouter) -> None:
    tools = [FN, *HOSTED, NS]
    want = header_value([f"tools[{i + 1}]:{t['type']}" for i, t in enumerate(HOSTED)])
    r = post(router, tools=tools, input="hi [len=2]")
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == want
    listing = router.fake_events("generate")[-1]["messages"][0]["content"]
    assert "exec_command" in listing and "web_search" not in listing
    assert "set aside tools[1]:web_search" in router.log()
    with httpx.stream("POST", router.url + "/v1/responses", timeout=30,
                      json={"model": "alpha", "tools": tools, "input": "hi [len=2]", "stream": True}) as s:
        assert s.status_code == 200 and s.headers[HEADER] == want
        s.read()
    # only built-in tools: served as a plain answer
    r = post(router, tools=[{"type": "web_search_preview"}], input="hi [len=2]", tool_choice="auto")
    assert r.status_code == 200 and r.headers[HEADER] == "tools[0]:web_search_preview"
    assert r.json()["output"][0]["type"] == "message"
    # a tool_choice forcing a built-in tool: served as auto
    r = post(router, tools=[FN, {"type": "web_search"}], tool_choice={"type": "web_search"}, input="hi [len=2]")
    assert r.status_code == 200 and r.headers[HEADER] == "tools[1]:web_search, tool_choice:web_search"
    # a namespace's hosted member is set aside alone
    ns = {**NS, "tools": [*NS["tools"], {"type": "web_search"}]}
    r = post(router, tools=[ns], input="hi [len=2]")
    assert r.status_code == 200 and r.headers[HEADER] == "tools[0].tools[2]:web_search"


def test_tool_choice_names_a_namespace_function(router: LiveRouter) -> None:
    for tc in ({"type": "function", "name": "spawn_agent", "namespace": "agents_v1"},
               {"type": "function", "name": "agents_v1__spawn_agent"},
               {"type": "function", "name": "spawn_agent"}):  # unambiguous alone
        r = post(router, tools=[FN, NS], tool_choice=tc, input=reply(call_block("agents_v1__spawn_agent", {})))
        assert r.status_code == 200, r.text
        g = router.fake_events("generate")[-1]["grammar"]
        assert "agents_v1__spawn_agent" in g and "exec_command" not in g


def test_allowed_tools_restricts_what_is_offered(router: LiveRouter) -> None:
    tc = {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "close_agent", "namespace": "agents_v1"}, {"type": "web_search"}]}
    r = post(router, tools=[FN, NS], tool_choice=tc, input=reply(call_block("agents_v1__close_agent", {"id": "x"})))
    assert r.status_code == 200, r.text
    listing = router.fake_events("generate")[-1]["messages"][0]["content"]
    assert "agents_v1__close_agent" in listing and "exec_command" not in listing
    assert "agents_v1__spawn_agent" not in listing
    assert r.json()["output"][0]["namespace"] == "agents_v1"
    bad = post(router, tools=[FN], tool_choice={"type": "allowed_tools", "mode": "sometimes", "tools": []},
               input="x")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice.mode"


def test_malformed_namespaces_are_a_400_naming_the_field(router: LiveRouter) -> None:
    for tools, param in [
        ([{"type": "namespace", "name": "n"}], "tools[0].tools"),
        ([{"type": "namespace", "tools": []}], "tools[0].name"),
        ([{"type": "namespace", "name": "n", "tools": ["x"]}], "tools[0].tools[0]"),
        ([{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": ""}]}], "tools[0].tools[0].name"),
        ([{**FN, "name": "n__f"}, {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"}]}],
         "tools[1]"),
    ]:
        r = post(router, tools=tools, input="x")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
