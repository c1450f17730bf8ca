"""An OpenAI chat request's messages, tools and response format, parsed into the dialect-neutral
turns and tools of ``router.dialects.tools`` (the chat route, and llama.cpp's ``/apply-template``
which takes the same ``messages``). Every error is a BadRequest naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from router.dialects.constraints import json_format_constraint
from router.dialects.field_policy import refuse_ignored
from router.dialects.shared import choose, content_text, custom_tool, function_tool, objects, tool_list
from router.dialects.tools import ChatTurn, Tool, ToolCall, ToolChoice, TrailingAssistants, render_messages
from router.http.errors import BadRequest
from router.http.params import get_bool

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}


def tool_calls(m: dict[str, Any], where: str, *, id_prefix: str = "call_", custom: bool = False,
               ollama: bool = False) -> list[ToolCall]:
    """An assistant message's ``tool_calls`` as ToolCalls (their arguments as JSON text).

    OpenAI's form by default: ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    the arguments a JSON text (an object given instead is written as one); with ``custom``,
    ``{"id", "type": "custom", "custom": {"name", "input"}}`` too. ``ollama``: Ollama's form,
    ``{"function": {"name", "arguments"}}`` with a non-empty name and the arguments an object
    (or its JSON text; ``{}`` when absent or null). A call without an id (Ollama: or with an
    empty one) gets ``<id_prefix><k>``, k its index. Raises BadRequest naming the field."""
    raw = m.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    calls: list[ToolCall] = []
    for k, c in enumerate(raw):
        cw = f"{where}.tool_calls[{k}]"
        ident = c.get("id") if isinstance(c, dict) else None
        ident = ident if isinstance(ident, str) and (ident or not ollama) else f"{id_prefix}{k}"
        if custom and isinstance(c, dict) and c.get("type") == "custom":
            cu = c.get("custom")
            if not isinstance(cu, dict) or not isinstance(cu.get("name"), str) or not isinstance(cu.get("input"), str):
                raise BadRequest(f"'{cw}' must be {{\"id\", \"type\": \"custom\", \"custom\": {{\"name\", "
                                 "\"input\"}}", param=cw)
            calls.append(ToolCall(ident, cu["name"], cu["input"], custom=True))
            continue
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or (ollama and not fn["name"]):
            shape = "" if ollama else '\"id\", \"type\": \"function\", '
            raise BadRequest(f"'{cw}' must be {{{shape}\"function\": {{\"name\", \"arguments\"}}}}", param=cw)
        calls.append(ToolCall(ident, fn["name"], _arguments(fn, f"{cw}.function.arguments", ollama)))
    return calls


def _arguments(fn: dict[str, Any], where: str, ollama: bool) -> str:
    """A call's ``arguments`` as JSON text: OpenAI's a text ("" when absent; anything else is
    written as JSON), Ollama's an object or its text (``{}`` when absent or null)."""
    if not ollama:
        args = fn.get("arguments", "")
        return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)  # some send the object
    args = fn.get("arguments", {})
    if args is None:
        args = {}
    if isinstance(args, str):  # some clients send the JSON text
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    raise BadRequest(f"'{where}' must be an object", param=where)


def parse_turns(body: dict[str, Any]) -> list[ChatTurn]:
    """``messages`` as dialect-neutral turns: content parts joined, ``developer`` as
    ``system``, assistant ``tool_calls`` (content null, "" or missing) and ``tool``
    messages (``tool_call_id``) kept. Raises BadRequest naming the field."""
    out: list[ChatTurn] = []
    for where, m in objects(body.get("messages"), "messages"):
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                             param=f"{where}.role")
        content = m.get("content")
        if content is None:
            if role not in ("assistant", "tool"):
                raise BadRequest(f"'{where}.content' is required", param=f"{where}.content")
            text = ""
        else:
            text = content_text(content, f"{where}.content", ("text", "input_text"))
        calls = tool_calls(m, where, custom=True) if role == "assistant" else []
        call_id = m.get("tool_call_id") if role == "tool" else None
        if role == "tool" and (not isinstance(call_id, str) or not call_id):
            raise BadRequest(f"'{where}.tool_call_id' is required in a tool message (the id of the call it "
                             "answers)", param=f"{where}.tool_call_id")
        name = m.get("name") if role == "tool" and isinstance(m.get("name"), str) else None
        reasoning = m.get("reasoning_content") if role == "assistant" else None  # llama.cpp's, kept for the template
        if reasoning is not None and not isinstance(reasoning, str):
            raise BadRequest(f"'{where}.reasoning_content' must be a string", param=f"{where}.reasoning_content")
        out.append(ChatTurn(CHAT_ROLES[role], text, calls, call_id if isinstance(call_id, str) else None, name,
                            reasoning or None))
    return out


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages`` as [{"role", "content": str}] for the worker's template (tool calls and
    results in the generic tool format; ``/apply-template``)."""
    try:
        return render_messages(parse_turns(body))
    except TrailingAssistants as e:
        raise BadRequest(str(e), param="messages") from None


def chat_tool(t: dict[str, Any], where: str, *, custom: bool = True) -> Tool:
    """One of a chat request's ``tools``: ``{"type": "function", "function": {"name",
    "description", "parameters"}}``, or with ``custom`` (OpenAI's, not Ollama's) ``{"type":
    "custom", "custom": {"name", "description", "format"}}``. Raises BadRequest naming the field."""
    kind = t.get("type", "function")
    if custom and kind == "custom":
        c = t.get("custom")
        if not isinstance(c, dict):
            raise BadRequest(f"'{where}.custom' must be an object", param=f"{where}.custom")
        return custom_tool(c.get("name"), c.get("description"), c.get("format"), f"{where}.custom")
    if kind != "function":
        kinds = "function and custom tools" if custom else "function tools"
        raise BadRequest(f"'{where}': tools of type {kind!r} are not supported ({kinds})", param=f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"'{where}.function' must be an object", param=f"{where}.function")
    return function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function",
                         "parameters")


def parse_tools(body: dict[str, Any]) -> tuple[list[Tool], ToolChoice]:
    """``tools`` (function tools, and custom tools whose free-text input may follow a
    ``grammar`` format, Lark or regex), ``tool_choice`` (``none`` / ``auto`` /
    ``required`` / ``{"type": "function", "function": {"name"}}`` / ``{"type":
    "custom", "custom": {"name"}}``) and ``parallel_tool_calls``."""
    tools = tool_list(body, chat_tool)
    parallel = get_bool(body, "parallel_tool_calls", True)
    tc = body.get("tool_choice")
    if tc is None:
        tc = "auto"
    if tc in ("none", "auto", "required"):
        return tools, choose(tools, tc, None, parallel, "tool_choice")
    if isinstance(tc, dict):
        kind = tc.get("type")
        if kind in ("function", "custom") and isinstance(tc.get(kind), dict):
            return tools, choose(tools, "named", tc[kind].get("name"), parallel, f"tool_choice.{kind}")
    raise BadRequest("'tool_choice' must be 'none', 'auto', 'required', {\"type\": \"function\", \"function\": "
                     "{\"name\": ...}} or {\"type\": \"custom\", \"custom\": {\"name\": ...}}", param="tool_choice")


def refuse_unsupported_chat(body: dict[str, Any]) -> None:
    """Chat fields that would change the answer and are not implemented: a 400 naming them
    (``router.dialects.field_policy``'s table, e.g. the legacy ``functions`` / ``function_call``: use
    ``tools`` / ``tool_choice``; and non-text ``modalities``)."""
    refuse_ignored(body, "/v1/chat/completions")  # functions, audio, web_search_options, stop_sequences, ...
    mods = body.get("modalities")
    if mods is not None and (not isinstance(mods, list) or any(m != "text" for m in mods)):
        raise BadRequest("'modalities' other than [\"text\"] are not supported", param="modalities")


def response_format(body: dict[str, Any]) -> str | None:
    """``response_format`` as the JSON Schema text the answer must match (None: text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise BadRequest("'response_format' must be an object", param="response_format")
    return json_format_constraint(rf, "response_format")
