"""OpenAI's Responses API: ``POST /v1/responses`` (JSON or SSE, or in the background),
``POST /v1/responses/input_tokens``, ``GET`` / ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``.

Request in: ``input`` (a string, or items: ``message`` with ``input_text`` /
``output_text`` parts and role user / assistant / system / developer,
``function_call``, ``function_call_output``; ``reasoning`` items are dropped, as
they carry nothing for these models; images and files are a 400),
``instructions`` (a system message for this response only: not carried over by
``previous_response_id``), ``tools`` (``function`` tools, ``custom`` tools whose
free-text input may follow a ``grammar`` format in Lark or regex syntax, as Codex's
``apply_patch``, and ``namespace`` tools — a named group of those, as Codex's
``multi_agent_v1`` — flattened to their tools: the model sees ``<namespace>__<name>``,
the client gets its calls back as ``name`` + ``namespace``, and sends them so in
``input``; hosted built-in tools — ``web_search``, ``file_search``,
``code_interpreter``, ``computer_use_preview``, ``image_generation``, ``mcp``,
``local_shell``, any other type — cannot run here and are set aside: served without,
a warning logged and the ``X-Modelyard-Set-Aside`` header naming them, see
``router.http.set_aside``), ``tool_choice`` (``none`` / ``auto`` / ``required`` /
``{"type": "function" | "custom", "name", "namespace"?}`` / ``{"type":
"allowed_tools", "mode", "tools"}``; one naming a built-in tool is set aside as
``auto``),
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``,
``text.format`` (``text``, ``json_object``, ``json_schema``), ``include`` with
``message.output_text.logprobs`` (the output text's token logprobs, ``top_logprobs``
alternatives each; other ``include`` values are ignored), ``store`` (default
true) and ``previous_response_id`` (the stored conversation is continued, see
``router.dialects.response_store``). ``metadata`` is stored and echoed; ``reasoning``,
``user``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``truncation``, ``max_tool_calls`` (it bounds built-in tool
calls; there are none) and unknown fields are ignored; ``prompt`` and
``conversation`` are a 400, and so is a field that changes the answer in another
dialect or llama.cpp (``seed``, ``stop``, ``max_tokens``, ``response_format``, ...:
``router.dialects.field_policy``).

``background: true`` (OpenAI's background mode, through ``router.dialects.background``): the
answer is the response object at once, ``status`` ``queued`` or ``in_progress``;
``GET /v1/responses/{id}`` shows it as it goes (the output so far) and then done
(``completed``, ``incomplete``, ``failed`` or ``cancelled``); ``?stream=true`` replays
its events from the first (``starting_after=N``: after sequence number N) and follows
it; ``POST /v1/responses/{id}/cancel`` stops it (the worker's slot is freed) and
answers it ``cancelled``; ``DELETE`` cancels and forgets it. It needs ``store`` (a 400
with ``store: false``, as OpenAI) and cannot be combined with ``stream`` here (read
the events with GET).

Answer out: a ``response`` object with ``output`` items (one ``message`` with an
``output_text`` part, or ``function_call`` items), ``status`` ``completed`` or
``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) and
``usage``. Streams are named SSE events, each with a ``sequence_number``:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.content_part.done``, ``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.done``, then ``response.completed`` or
``response.incomplete``; a failure after the first byte is ``response.failed``.

Shared with the other dialects: admission, the worker run, cancel-on-disconnect and
the error path (``router.serving.generation``); tools, the constraint and the answer's parser
(``router.dialects.shared.prepare``: the template's own tool syntax, else the generic tool
format of ``router.dialects.tools``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from protocol import Accepted, Done, Generate, Token
from protocol.limits import MAX_N_PROBS as MAX_TOP_LOGPROBS
from router.dialects.constraints import json_format_constraint
from router.dialects.shared import Prepared, choose, content_text, custom_tool, function_tool, objects, prepare, tool_list
from router.http.errors import ApiError, BadRequest, NotFound, redact_paths
from router.dialects.field_policy import refuse_ignored
from router.serving.generation import OPENAI_DEFAULTS, begin, collect, openai_logprob, read_sampling, stream, token_probs
from router.metrics import label_request
from router.http.params import INT32_MAX, get_bool, get_int, get_str, model_of, read_json
from router.workers.pool import ModelSlot, Pool
from router.dialects.background import Job, new_job_id
from router.dialects.background_reads import job_events, stream_query
from router.dialects.background import store_of as background_of
from router.dialects.response_store import ResponseStore
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse, sse_named
from router.http.set_aside import set_aside
from router.dialects.tools import ChatTurn, Tool, ToolCall, ToolChoice, namespaced_name

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
#: Request fields echoed in the response object as they came (when given).
_ECHO = ("instructions", "max_output_tokens", "previous_response_id", "temperature", "top_p", "top_logprobs",
         "user")
#: The ``include`` value that asks for the output text's token logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def _hex() -> str:
    return uuid.uuid4().hex[:24]


def store_of(request: Request) -> ResponseStore:
    """The app's one store (made by ``router.app.create_app`` from the ``[server]`` keys)."""
    st: ResponseStore = request.app.state.responses
    return st


@dataclass
class _Request:
    model: str
    slot: ModelSlot
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


def _parse(request: Request, body: dict[str, Any]) -> _Request:
    pool: Pool = request.app.state.pool
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
    return _Request(model, slot, history, prep, echo, _logprobs_wanted(body),
                    {t.name: t for t in tools if t.namespace})


def _logprobs_wanted(body: dict[str, Any]) -> int | None:
    """``top_logprobs`` (0-20) when ``include`` asks for the output text's logprobs, else None;
    ``top_logprobs`` without that ``include`` is only echoed (as OpenAI does)."""
    top = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise BadRequest("'include' must be an array of strings", param="include")
    return (top or 0) if include and INCLUDE_LOGPROBS in include else None


def _generate(req: _Request, body: dict[str, Any], max_tokens: int | None, rid: str) -> Generate:
    sampling = read_sampling({k: body[k] for k in ("temperature", "top_p") if k in body},
                             OPENAI_DEFAULTS, req.slot, openai=True)
    n_probs = 0 if req.n_top is None else max(req.n_top, 1)
    return Generate(id=rid, max_tokens=max_tokens, cache_prompt=get_bool(body, "cache_prompt", True),
                    n_probs=n_probs, **req.prep.generate_fields(), **sampling)


def _usage(done: Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cache_n},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _message_item(mid: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _logprobs(req: _Request, tokens: list[Token]) -> list[dict[str, Any]]:
    """The ``output_text.logprobs`` of ``tokens`` (empty unless asked for)."""
    if req.n_top is None:
        return []
    return [openai_logprob(p, req.n_top) for p in token_probs(tokens, req.n_top)]


def _call_item(req: _Request, c: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    text = c.arguments if arguments is None else arguments
    names = req.call_names(c)
    if c.custom:
        return {"type": "custom_tool_call", "id": "ctc_" + c.id.split("_", 1)[1], "call_id": c.id, **names,
                "input": text, "status": status}
    return {"type": "function_call", "id": "fc_" + c.id.split("_", 1)[1], "call_id": c.id, **names,
            "arguments": text, "status": status}


class _Answer:
    """The response object of one request as it builds up (shared by JSON and SSE)."""

    def __init__(self, req: _Request, rid: str) -> None:
        self.req = req
        self.id = rid
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.output: list[dict[str, Any]] = []

    def obj(self, status: str, done: Done | None = None, error: ApiError | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": self.completed_at if status == "completed" else None,
                "model": self.req.model, "output": list(self.output), "error": (
                    {"code": error.code or "server_error", "message": redact_paths(error.message)} if error else None),
                "incomplete_details": incomplete, "usage": _usage(done) if done is not None else None,
                "truncation": "disabled", "max_output_tokens": None, "instructions": None,
                "previous_response_id": None, "temperature": None, "top_p": None, **self.req.echo}

    def finish(self, request: Request, done: Done, calls: list[ToolCall], text: str | None) -> dict[str, Any]:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        self.completed_at = int(time.time())
        resp = self.obj(status, done)
        if self.req.echo["store"]:
            history = list(self.req.history)
            text = text or ""
            if history and history[-1].role == "assistant" and not history[-1].tool_calls:
                text = history.pop().content + text  # a prefill: the answer continues that turn
            store_of(request).put(self.id, resp, [*history, ChatTurn("assistant", text, tool_calls=list(calls))])
        return resp


async def create(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
    refuse_ignored(body, "/v1/responses")  # seed, stop, max_tokens, response_format, ...: not Responses fields
    job = getattr(request.state, "background_job", None)  # set when this runs a background response
    if job is None and get_bool(body, "background", False):
        return await _start_background(request, body)
    req = _parse(request, body)
    max_tokens = get_int(body, "max_output_tokens", None, 1, INT32_MAX)
    streaming = get_bool(body, "stream", False)
    ans = _Answer(req, job.id if job is not None else "resp_" + _hex())
    if job is not None:
        job.snapshot = ans.obj
    msg = _generate(req, body, max_tokens, ans.id)
    run, first = await begin(request, req.slot, msg, grammar_param=req.prep.constraint_param, early=streaming)
    parser = req.prep.parser()
    mid = "msg_" + _hex()

    if not streaming:
        tokens, done = await collect(request, run, first)
        out = parser.read([*(t.text for t in tokens), done.text])
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if out.content is None:
            ans.output = [_call_item(req, c, "completed") for c in out.calls]
        if not ans.output:
            ans.output = [_message_item(mid, out.content or "", status, _logprobs(req, tokens))]
        return JSONResponse(ans.finish(request, done, out.calls, out.content))

    seq = 0
    events: list[bytes] = []
    text_parts: list[str] = []
    all_lp: list[dict[str, Any]] = []  # the output text's logprobs (when asked for)
    pending_lp: list[dict[str, Any]] = []  # those of tokens whose text has not been sent yet
    msg_open = False
    started = False

    def ev(kind: str, **fields: Any) -> None:
        nonlocal seq
        events.append(sse_named(kind, {"type": kind, "sequence_number": seq, **fields}))
        seq += 1

    def open_message() -> None:
        nonlocal msg_open
        msg_open = True
        ans.output.append({"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []})
        ev("response.output_item.added", output_index=len(ans.output) - 1, item=ans.output[-1])
        ev("response.content_part.added", item_id=mid, output_index=len(ans.output) - 1, content_index=0,
           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def close_message(status: str) -> None:
        text = "".join(text_parts)
        idx = len(ans.output) - 1
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": list(all_lp)}
        ev("response.output_text.done", item_id=mid, output_index=idx, content_index=0, text=text,
           logprobs=list(all_lp))
        ev("response.content_part.done", item_id=mid, output_index=idx, content_index=0, part=part)
        ans.output[idx] = _message_item(mid, text, status, all_lp)
        ev("response.output_item.done", output_index=idx, item=ans.output[idx])

    def emit(text: str, calls: list[ToolCall]) -> None:
        if text:
            if not msg_open:
                open_message()
            text_parts.append(text)
            ev("response.output_text.delta", item_id=mid, output_index=len(ans.output) - 1, content_index=0,
               delta=text, logprobs=list(pending_lp))
            pending_lp.clear()
        for c in calls:
            ans.output.append(_call_item(req, c, "in_progress", ""))
            idx = len(ans.output) - 1
            item_id = ans.output[idx]["id"]
            ev("response.output_item.added", output_index=idx, item=ans.output[idx])
            if c.custom:
                ev("response.custom_tool_call_input.delta", item_id=item_id, output_index=idx, delta=c.arguments)
                ev("response.custom_tool_call_input.done", item_id=item_id, output_index=idx, input=c.arguments)
            else:
                ev("response.function_call_arguments.delta", item_id=item_id, output_index=idx, delta=c.arguments)
                ev("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                   arguments=c.arguments, **req.call_names(c))
            ans.output[idx] = _call_item(req, c, "completed")
            ev("response.output_item.done", output_index=idx, item=ans.output[idx])

    def start() -> None:
        nonlocal started
        if not started:
            started = True
            ev("response.created", response=ans.obj("in_progress"))
            ev("response.in_progress", response=ans.obj("in_progress"))
            if parser.mode != "undecided":
                open_message()

    def on_open(accepted: Accepted) -> list[bytes]:
        events.clear()
        start()  # response.created at once, before the prompt is prefilled
        return list(events)

    async def on_frame(item: Token | Done) -> list[bytes]:
        events.clear()
        start()
        if isinstance(item, Token):
            lp = _logprobs(req, [item])
            all_lp.extend(lp)
            pending_lp.extend(lp)
        emit(*parser.feed(item.text))
        if isinstance(item, Token):
            return list(events)
        emit(*parser.finish())
        status = "incomplete" if item.finish_reason == "length" else "completed"
        if not ans.output:
            open_message()
        if msg_open:
            close_message(status)
        out = parser.result()
        resp = ans.finish(request, item, out.calls, out.content)
        ev("response.completed" if status == "completed" else "response.incomplete", response=resp)
        return list(events)

    def on_error(err: ApiError) -> bytes:
        events.clear()
        ev("response.failed", response=ans.obj("failed", error=err))
        return events[0]

    return SSEResponse(stream(run, first, on_frame, on_error=on_error, on_open=on_open), run.close)


async def input_tokens(request: Request) -> Response:
    """``{"object": "response.input_tokens", "input_tokens": N}``: the prompt tokens
    ``POST /v1/responses`` would have for this body (counted by the worker as a
    generation of 0 tokens: exact, and it warms the prefix cache)."""
    body = await read_json(request)
    req = _parse(request, body)
    msg = _generate(req, body, 0, "count-" + _hex())
    run, first = await begin(request, req.slot, msg, grammar_param=req.prep.constraint_param)
    _, done = await collect(request, run, first)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": done.prompt_tokens})


def _not_found(rid: str) -> NotFound:
    return NotFound(f"No response with id '{rid}' found.", code="not_found", param="response_id")


async def _start_background(request: Request, body: dict[str, Any]) -> Response:
    if not get_bool(body, "store", True):
        raise BadRequest("background responses must be stored: 'store' cannot be false with 'background'",
                         param="store")
    if get_bool(body, "stream", False):
        raise BadRequest("'stream' with 'background' is not supported: follow the events with "
                         "GET /v1/responses/{id}?stream=true", param="stream")
    job = Job(new_job_id("resp_"), "response", str(body.get("model", "")))
    await background_of(request).start(request, job, create, "/v1/responses", body)
    return JSONResponse(_job_object(job))


def _job_object(job: Job) -> dict[str, Any]:
    """A background response as it stands: the final object once it has one, else the
    object so far with the job's status (and its error)."""
    obj = job.result() if not job.running else None
    if obj is None:
        obj = job.snapshot(job.status) if job.snapshot is not None else {"id": job.id, "object": "response",
                                                                            "status": job.status, "output": []}
    if job.status in ("cancelled", "failed"):  # ended without a final object of its own: say how
        obj = {**obj, "status": job.status, "error": obj.get("error") or job.error}
    return obj


async def retrieve(request: Request) -> Response | SSEResponse:
    rid = request.path_params["response_id"]
    job = background_of(request).get(rid)
    if job is not None:
        if stream_query(request):
            raw = request.query_params.get("starting_after", "-1")
            if not raw.lstrip("-").isdigit() or int(raw) < -1:
                raise BadRequest(f"'starting_after' must be a sequence number, got {raw!r}", param="starting_after")
            return job_events(job, skip=int(raw) + 1)
        return JSONResponse(_job_object(job))
    stored = store_of(request).get(rid)
    if stored is None:
        raise _not_found(rid)
    return JSONResponse(stored.response)


async def cancel(request: Request) -> Response:
    """OpenAI's ``POST /v1/responses/{id}/cancel``: a background response stops (a
    finished one is answered as it is); other responses cannot be cancelled (400)."""
    rid = request.path_params["response_id"]
    job = background_of(request).cancel(rid)
    if job is not None:
        return JSONResponse(_job_object(job))
    if store_of(request).get(rid) is not None:
        raise BadRequest("Only responses created with 'background': true can be cancelled.",
                         param="response_id")
    raise _not_found(rid)


async def delete(request: Request) -> Response:
    rid = request.path_params["response_id"]
    job = background_of(request).cancel(rid, forget=True)
    if not store_of(request).delete(rid) and job is None:
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    # llama-server's un-versioned aliases (see router.dialects.openai_api.routes)
    Route("/responses", create, methods=["POST"]),
    Route("/responses/input_tokens", input_tokens, methods=["POST"]),
]
