"""The Responses API's request read (``POST /v1/responses``, router.dialects.openai_responses
documents its fields): ``input`` items as dialect-neutral turns, ``tools`` (function, custom,
namespace; hosted built-in tools set aside) and ``tool_choice``, ``text.format``, ``include``,
and the Generate it asks for. Every error is a BadRequest naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from protocol import Generate
from protocol.limits import MAX_N_PROBS as MAX_TOP_LOGPROBS
from router.dialects.constraints import json_format_constraint
from router.dialects.response_store import store_of
from router.dialects.shared import Prepared, choose, content_text, custom_tool, function_tool, objects, prepare, tool_list
from router.dialects.tools import ChatTurn, Tool, ToolCall, ToolChoice, namespaced_name
from router.http.errors import BadRequest
from router.http.params import get_bool, get_int, get_str, model_of
from router.http.set_aside import set_aside
from router.metrics import label_request
from router.serving.generation import OPENAI_DEFAULTS, read_sampling
from router.serving.models import ModelPool, ServedModel

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
#: Request fields echoed in the response object as they came (when given).
_ECHO = ("instructions", "max_output_tokens", "previous_response_id", "temperature", "top_p", "top_logprobs",
         "user")
#: The ``include`` value that asks for the output text's token logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


@dataclass
class ResponsesRequest:
    """A parsed ``POST /v1/responses`` body: the model, the conversation, the prepared prompt and
    what the response object echoes."""

    model: str
    slot: ServedModel
    history: list[ChatTurn]  # conversation without the instructions (what is stored)
    prep: Prepared  # the prompt, the template's tools, the constraint, the answer's parser
    echo: dict[str, Any] = field(default_factory=dict)
    n_top: int | None = None  # logprobs wanted (include message.output_text.logprobs): alternatives per token
    namespaced: dict[str, Tool] = field(default_factory=dict)  # flat name -> a namespace's function

    def call_names(self, c: ToolCall) -> dict[str, str]:
        """A call's ``name`` as the client knows it, with its ``namespace`` when it has one."""
        t = self.namespaced.get(c.name)
        if t is None:
            return {"name": c.name}
        ns, name = t.client_name()
        return {"name": name, "namespace": ns or ""}


def _part_text(content: Any, where: str) -> str:
    return content_text(content, where, _TEXT_PARTS)


def _input_turns(v: Any) -> list[ChatTurn]:
    if isinstance(v, str):
        return [ChatTurn("user", v)]
    turns: list[ChatTurn] = []
    for where, item in objects(v, "input"):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadRequest(f"'{where}.role' must be one of {sorted(_ROLES)}, got {role!r}", param=f"{where}.role")
            turns.append(ChatTurn(_ROLES[role], _part_text(item.get("content", ""), f"{where}.content")))
        elif kind in ("function_call", "custom_tool_call"):
            field = "arguments" if kind == "function_call" else "input"
            name, call_id, text = item.get("name"), item.get("call_id"), item.get(field, "")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(text, str):
                raise BadRequest(f"'{where}': a {kind} needs string 'call_id', 'name' and '{field}'", param=where)
            ns = item.get("namespace")
            if ns is not None and not isinstance(ns, str):
                raise BadRequest(f"'{where}.namespace' must be a string", param=f"{where}.namespace")
            if ns:  # a namespace's function: the model saw (and called) it by its flat name
                name = namespaced_name(ns, name)
            call = ToolCall(call_id, name, text, custom=kind == "custom_tool_call")
            if turns and turns[-1].role == "assistant":
                turns[-1].tool_calls.append(call)
            else:
                turns.append(ChatTurn("assistant", "", tool_calls=[call]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadRequest(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
            turns.append(ChatTurn("tool", _part_text(item.get("output", ""), f"{where}.output"), tool_call_id=call_id))
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(f"'{where}': input items of type {kind!r} are not supported", param=f"{where}.type")
    return turns


#: Tool types whose calls the model makes and the client runs; every other type is a hosted
#: built-in tool (web_search, file_search, code_interpreter, computer_use_preview,
#: image_generation, mcp, local_shell, ...), run by OpenAI's servers: set aside here.
_RUNNABLE = ("function", "custom", "namespace")


def _tool(request: Request, t: dict[str, Any], where: str) -> Tool | list[Tool]:
    kind = t.get("type")
    if kind == "custom":
        return custom_tool(t.get("name"), t.get("description"), t.get("format"), where)
    if kind == "function":
        return function_tool(t.get("name"), t.get("description"), t.get("parameters"), where, "parameters")
    if kind == "namespace":
        return _namespace(request, t, where)
    if not isinstance(kind, str) or not kind:
        raise BadRequest(f"'{where}.type' must be a tool type (function, custom, namespace, or a built-in "
                         "tool's type)", param=f"{where}.type")
    set_aside(request.state, where, kind, "a hosted built-in tool: this server cannot run it; served without it")
    return []


def _namespace(request: Request, t: dict[str, Any], where: str) -> list[Tool]:
    """A ``namespace`` tool (a named group of function / custom tools, as Codex's
    ``multi_agent_v1``) flattened to its tools, each under its flat name
    (``router.dialects.tools.namespaced_name``); a call is answered with ``name`` and ``namespace``."""
    ns = t.get("name")
    if not isinstance(ns, str) or not ns or '"' in ns or "\n" in ns:
        raise BadRequest(f"'{where}.name' must be a non-empty string without quotes or newlines",
                         param=f"{where}.name")
    inner = t.get("tools")
    if not isinstance(inner, list):
        raise BadRequest(f"'{where}.tools' must be an array of tools", param=f"{where}.tools")
    out: list[Tool] = []
    for j, f in enumerate(inner):
        fw = f"{where}.tools[{j}]"
        if not isinstance(f, dict):
            raise BadRequest(f"'{fw}' must be an object", param=fw)
        kind = f.get("type", "function")
        if kind not in ("function", "custom"):
            set_aside(request.state, fw, str(kind), "only function and custom tools run inside a namespace")
            continue
        tool = _tool(request, {**f, "type": kind}, fw)
        assert isinstance(tool, Tool)
        out.append(replace(tool, name=namespaced_name(ns, tool.name), namespace=ns, local_name=tool.name))
    return out


def _named(tools: list[Tool], tc: dict[str, Any], where: str) -> str:
    """The flat name of the tool a ``tool_choice`` / ``allowed_tools`` entry names (with its
    ``namespace``, or a namespace's function named alone when that is unambiguous)."""
    name, ns = tc.get("name"), tc.get("namespace")
    if not isinstance(name, str):
        raise BadRequest(f"'{where}.name' must be a string", param=f"{where}.name")
    if isinstance(ns, str) and ns:
        return namespaced_name(ns, name)
    if any(t.name == name for t in tools):
        return name
    inner = [t.name for t in tools if t.local_name == name]
    return inner[0] if len(inner) == 1 else name


def _tools(request: Request, body: dict[str, Any]) -> tuple[list[Tool], ToolChoice]:
    tools = tool_list(body, lambda t, where: _tool(request, t, where))
    parallel = get_bool(body, "parallel_tool_calls", True)
    tc = body.get("tool_choice", "auto")
    if tc is None:
        tc = "auto"
    if tc in ("none", "auto", "required"):
        return tools, choose(tools, tc, None, parallel, "tool_choice")
    if isinstance(tc, dict) and tc.get("type") in ("function", "custom"):
        return tools, choose(tools, "named", _named(tools, tc, "tool_choice"), parallel, "tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "allowed_tools":
        return _allowed_tools(tools, tc, parallel)
    if isinstance(tc, dict) and isinstance(tc.get("type"), str) and tc["type"] not in _RUNNABLE:
        # a built-in tool forced (web_search, file_search, mcp, ...): it was set aside with the tools
        set_aside(request.state, "tool_choice", tc["type"], "names a hosted built-in tool; served with 'auto'")
        return tools, choose(tools, "auto", None, parallel, "tool_choice")
    raise BadRequest("'tool_choice' must be 'none', 'auto', 'required', {\"type\": \"function\" | \"custom\", "
                     "\"name\": ...} or {\"type\": \"allowed_tools\", ...}",
                     param="tool_choice")


def _allowed_tools(tools: list[Tool], tc: dict[str, Any], parallel: bool) -> tuple[list[Tool], ToolChoice]:
    """``{"type": "allowed_tools", "mode": "auto" | "required", "tools": [...]}``: only the
    listed tools are offered (a listed built-in tool was set aside with the tools)."""
    mode = tc.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise BadRequest("'tool_choice.mode' must be 'auto' or 'required'", param="tool_choice.mode")
    listed = tc.get("tools")
    if not isinstance(listed, list) or not all(isinstance(x, dict) for x in listed):
        raise BadRequest("'tool_choice.tools' must be an array of tool references", param="tool_choice.tools")
    names = {_named(tools, x, f"tool_choice.tools[{i}]") for i, x in enumerate(listed)
             if x.get("type") in ("function", "custom")}
    allowed = [t for t in tools if t.name in names]
    return allowed, choose(allowed, mode, None, parallel, "tool_choice")


def _text_format(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``text.format`` -> (JSON Schema text or None, the format object echoed)."""
    text = body.get("text")
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'text.format.type' must be 'text', 'json_object' or 'json_schema'", param="text.format")
    return json_format_constraint(fmt, "text.format"), fmt


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields that would change the answer and are not implemented: a 400 naming them."""
    for key, why in (("prompt", "reusable prompt templates are not stored here; send 'input'"),
                     ("conversation", "use 'previous_response_id'")):
        if body.get(key) is not None:
            raise BadRequest(f"'{key}' is not supported: {why}", param=key)


def parse(request: Request, body: dict[str, Any]) -> ResponsesRequest:
    """The request as a ResponsesRequest: its model's slot, the stored conversation it continues
    (``previous_response_id``) and its ``input``, tools and text format prepared. Raises
    BadRequest naming the field, NotFound for an unknown model."""
    pool: ModelPool = request.app.state.pool
    model = model_of(body, pool.config.default_name(), pool.config.ids())
    slot = pool.get(model)
    label_request(request, slot.model.name)
    _refuse_unsupported(body)
    history: list[ChatTurn] = []
    prev = get_str(body, "previous_response_id", None)
    if prev is not None:
        stored = store_of(request).get(prev)
        if stored is None:
            raise BadRequest(f"Previous response with id '{prev}' not found.", param="previous_response_id",
                             code="previous_response_not_found")
        history = [ChatTurn(t.role, t.content, list(t.tool_calls), t.tool_call_id, t.name) for t in stored.turns]
    if "input" not in body:
        raise BadRequest("'input' is required", param="input")
    history += _input_turns(body["input"])
    instructions = get_str(body, "instructions", None)
    turns = ([ChatTurn("system", instructions)] if instructions else []) + history
    tools, choice = _tools(request, body)
    text_schema, fmt = _text_format(body)
    prep = prepare(slot, turns, tools, choice, text_schema, "text.format", messages_param="input")
    echo = {k: body[k] for k in _ECHO if body.get(k) is not None}
    echo["text"] = {"format": fmt}
    echo["tools"] = [dict(t) for t in body.get("tools") or []]
    echo["tool_choice"] = body.get("tool_choice", "auto")
    echo["parallel_tool_calls"] = choice.parallel
    echo["metadata"] = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    echo["store"] = get_bool(body, "store", True)
    echo["background"] = get_bool(body, "background", False)
    return ResponsesRequest(model, slot, history, prep, echo, _logprobs_wanted(body),
                    {t.name: t for t in tools if t.namespace})


def _logprobs_wanted(body: dict[str, Any]) -> int | None:
    """``top_logprobs`` (0-20) when ``include`` asks for the output text's logprobs, else None;
    ``top_logprobs`` without that ``include`` is only echoed (as OpenAI does)."""
    top = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise BadRequest("'include' must be an array of strings", param="include")
    return (top or 0) if include and INCLUDE_LOGPROBS in include else None


def generate(req: ResponsesRequest, body: dict[str, Any], max_tokens: int | None, rid: str) -> Generate:
    sampling = read_sampling({k: body[k] for k in ("temperature", "top_p") if k in body},
                             OPENAI_DEFAULTS, req.slot, openai=True)
    n_probs = 0 if req.n_top is None else max(req.n_top, 1)
    return Generate(id=rid, max_tokens=max_tokens, cache_prompt=get_bool(body, "cache_prompt", True),
                    n_probs=n_probs, **req.prep.generate_fields(), **sampling)
