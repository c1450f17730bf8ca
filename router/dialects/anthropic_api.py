"""Anthropic's Messages API: ``POST /v1/messages`` (JSON or SSE) and
``POST /v1/messages/count_tokens``, as the official ``anthropic`` SDK sends and parses them.

Request in: ``system`` (a string or text blocks), ``messages`` (content a string or
blocks ``text``, ``tool_use``, ``tool_result``; the text of ``thinking`` blocks of earlier
turns is kept as the turn's reasoning — the template's ``reasoning_content``, as llama-server
gives it — and ``redacted_thinking`` blocks are dropped; images and documents are a 400),
``max_tokens`` (required), ``stop_sequences``, ``temperature`` (0..1), ``top_p``,
``top_k``, ``tools`` (custom tools: ``name``, ``description``, ``input_schema``)
and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``). ``metadata``, ``thinking``, ``service_tier``,
``cache_control``, ``output_config.effort`` and unknown fields are ignored (they
do not change what a local model answers) — but a field that changes the answer in
another dialect or llama.cpp (``stop``, ``seed``, ``response_format``, ``n``, ...) is a 400
naming it (``router.dialects.field_policy``); ``output_config.format``
(``{"type": "json_schema", "schema"}``) constrains the text to the schema; ``anthropic-version`` /
``anthropic-beta`` headers are accepted and ignored.

Answer out: a ``message`` with ``text`` / ``tool_use`` content blocks,
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and
``usage`` (``input_tokens`` = prompt tokens evaluated, ``cache_read_input_tokens``
= prompt tokens reused from the KV cache, so their sum is what ``count_tokens``
gives; ``output_tokens``). Streams carry Anthropic's named events in its order:
``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``
(``text_delta`` / ``input_json_delta``), ``content_block_stop``, ``message_delta``
(``stop_reason``, usage), ``message_stop``; a failure after the first byte is an
``error`` event (written by ``router.dialects.anthropic_answer``). Errors on these routes are
Anthropic-shaped (``router.http.errors``).

Admission, the worker run, cancel-on-disconnect and the error path are the shared
ones of ``router.serving.generation``; tools, the constraint and the answer's parser come
from ``router.dialects.shared.prepare`` (the model template's own tool syntax, else the
generic tool format of ``router.dialects.tools``). A last assistant message is a prefill: the
answer continues it (the worker's chat template does it, as llama.cpp's server).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import Accepted, Done, Generate, Token
from router.dialects.anthropic_answer import PING, MessageStream, error_event, message
from router.dialects.constraints import json_format_constraint
from router.dialects.counting import count_beyond_context, refused_for_length
from router.dialects.shared import Prepared, choose, function_tool, objects, prepare, tool_list
from router.http.errors import BadRequest, ContextLengthExceeded
from router.dialects.field_policy import refuse_ignored
from router.serving.generation import OPENAI_DEFAULTS, begin, collect, new_id, read_sampling, stream
from router.metrics import label_request
from router.http.params import INT32_MAX, get_bool, get_float, get_int, get_str, model_of, read_json
from router.serving.models import ModelPool, ServedModel
from router.http.responses import JSONResponse
from router.serving.server import Generation
from router.http.set_aside import set_aside
from router.http.sse import SSEResponse
from router.http.routes import route_table
from router.dialects.tools import ChatTurn, Tool, ToolCall, ToolChoice

#: Content block types of earlier assistant turns that carry no text for the prompt (a ``thinking``
#: block's text is kept: the turn's reasoning, the template's ``reasoning_content``).
_DROPPED_BLOCKS = ("redacted_thinking",)


@dataclass
class _Request:
    """An Anthropic request, parsed: what the Generate and the answer need."""

    model: str
    slot: ServedModel
    prep: Prepared


def _text_blocks(v: Any, where: str) -> str:
    """A ``system`` / ``tool_result.content`` value: a string or a list of text blocks."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts: list[str] = []
        for j, b in enumerate(v):
            bw = f"{where}[{j}]"
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                kind = b.get("type") if isinstance(b, dict) else None
                raise BadRequest(f"'{bw}': only text blocks are supported here, got {kind!r}", param=bw)
            parts.append(b["text"])
        return "\n".join(parts)
    raise BadRequest(f"'{where}' must be a string or an array of text blocks", param=where)


def _turns(body: dict[str, Any]) -> list[ChatTurn]:
    """``system`` + ``messages`` as dialect-neutral turns. Raises BadRequest naming the field."""
    turns: list[ChatTurn] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            turns.append(ChatTurn("system", text))
    # an empty conversation is rendered (system prompt and generation prompt only), as llama-server does
    raw = body.get("messages")
    for where, m in ([] if raw == [] else objects(raw, "messages")):
        role = m.get("role")
        if role in ("system", "developer"):
            # a system turn inside the conversation (Claude Code's mid-conversation-system beta):
            # kept in its place; the worker fits it to what the model's template can express
            text = _text_blocks(m.get("content", ""), f"{where}.content")
            if text:
                turns.append(ChatTurn("system", text))
            continue
        if role not in ("user", "assistant"):
            raise BadRequest(f"'{where}.role' must be 'user', 'assistant' or 'system', got {role!r}",
                             param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            turns.append(ChatTurn(role, content))
            continue
        if not isinstance(content, list):
            raise BadRequest(f"'{where}.content' must be a string or an array of content blocks",
                             param=f"{where}.content")
        texts: list[str] = []
        calls: list[ToolCall] = []
        thoughts: list[str] = []
        for j, b in enumerate(content):
            bw = f"{where}.content[{j}]"
            if not isinstance(b, dict):
                raise BadRequest(f"'{bw}' must be an object", param=bw)
            kind = b.get("type")
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise BadRequest(f"'{bw}.text' must be a string", param=f"{bw}.text")
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                name, ident = b.get("name"), b.get("id")
                if not isinstance(name, str) or not isinstance(ident, str):
                    raise BadRequest(f"'{bw}': a tool_use block needs string 'id' and 'name'", param=bw)
                calls.append(ToolCall(ident, name, json.dumps(b.get("input", {}), ensure_ascii=False)))
            elif kind == "tool_result" and role == "user":
                ident = b.get("tool_use_id")
                if not isinstance(ident, str):
                    raise BadRequest(f"'{bw}.tool_use_id' must be a string", param=f"{bw}.tool_use_id")
                result = _text_blocks(b.get("content", ""), f"{bw}.content")
                if b.get("is_error") is True:
                    result = f"Error: {result}"
                turns.append(ChatTurn("tool", result, tool_call_id=ident))
            elif kind == "thinking" and role == "assistant":
                if not isinstance(b.get("thinking"), str):
                    raise BadRequest(f"'{bw}.thinking' must be a string", param=f"{bw}.thinking")
                thoughts.append(b["thinking"])
            elif kind in _DROPPED_BLOCKS and role == "assistant":
                continue
            elif kind in ("image", "document"):
                raise BadRequest(f"'{bw}': {kind} content is not supported (these models read text only)",
                                 param=bw)
            else:
                raise BadRequest(f"'{bw}': content blocks of type {kind!r} are not supported in a {role} "
                                 "message", param=bw)
        if texts or calls or role == "assistant":
            turns.append(ChatTurn(role, "\n".join(texts), tool_calls=calls,
                                  reasoning="\n\n".join(thoughts) if thoughts else None))
    return _combine_assistants(turns)


def _combine_assistants(turns: list[ChatTurn]) -> list[ChatTurn]:
    """Consecutive assistant turns as one (Anthropic combines consecutive turns of one role;
    user turns are combined by the rendering, tool results stay their own turns)."""
    # each run is joined once: merging pairwise copied the run so far at every turn (quadratic, on
    # the event loop: 4,000 assistant turns of 2 KB held every other client for 7.9 s)
    runs: list[list[ChatTurn]] = []
    for t in turns:
        if runs and t.role == runs[-1][-1].role == "assistant":
            runs[-1].append(t)
        else:
            runs.append([t])
    return [run[0] if len(run) == 1 else
            ChatTurn("assistant", "\n\n".join(x.content for x in run if x.content),
                     [c for x in run for c in x.tool_calls],
                     reasoning="\n\n".join(x.reasoning for x in run if x.reasoning) or None)
            for run in runs]


def _tool(t: dict[str, Any], where: str) -> Tool:
    if not isinstance(t.get("input_schema"), dict):
        raise BadRequest(f"'{where}.input_schema' must be a JSON Schema object", param=f"{where}.input_schema")
    return function_tool(t.get("name"), t.get("description"), t["input_schema"], where, "input_schema")


def _is_server_tool(t: Any) -> bool:
    """An Anthropic server tool (``web_search_20250305``, ``code_execution_...``, ``bash_...``,
    ``text_editor_...``, ``computer_...``, ``web_fetch_...``): a ``type`` other than ``custom``."""
    return isinstance(t, dict) and t.get("type") not in (None, "custom")


def _tools(request: Request, body: dict[str, Any]) -> tuple[list[Tool], ToolChoice]:
    raw = body.get("tools")
    server_names: set[Any] = set()
    if isinstance(raw, list) and any(_is_server_tool(t) for t in raw):
        # server tools run on Anthropic's side; here nothing can run them: served without them, visibly
        kept = []
        for i, t in enumerate(raw):
            if _is_server_tool(t):
                set_aside(request.state, f"tools[{i}]", str(t.get("type")),
                          "a server tool this server cannot run")
                server_names.add(t.get("name"))
            else:
                kept.append(t)
        body = {**body, "tools": kept}
    tools = tool_list(body, _tool)
    tc = body.get("tool_choice")
    if tc is None:
        return tools, choose(tools, "auto", None, True, "tool_choice")
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("'tool_choice.type' must be one of 'auto', 'any', 'tool', 'none'", param="tool_choice")
    if server_names and ((tc["type"] == "tool" and tc.get("name") in server_names)
                         or (tc["type"] == "any" and not tools)):
        # a choice of the server tools just set aside (a web-search request forcing its tool): the
        # request is served without it too, rather than refused for naming a tool it did give
        set_aside(request.state, "tool_choice", str(tc.get("name") if tc["type"] == "tool" else "any"),
                  "it chose a server tool that was set aside")
        return tools, choose(tools, "auto", None, True, "tool_choice")
    parallel = not get_bool(tc, "disable_parallel_tool_use", False)
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc["type"]]
    return tools, choose(tools, mode, tc.get("name"), parallel, "tool_choice")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields that would change the answer and that a local model cannot honour: a 400 naming them."""
    if body.get("mcp_servers"):
        raise BadRequest("'mcp_servers' is not supported", param="mcp_servers")
    if body.get("container") is not None:
        raise BadRequest("'container' is not supported", param="container")


def _output_format(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """Structured output: ``output_config.format`` (or the older top-level
    ``output_format``) ``{"type": "json_schema", "schema"}`` -> (schema text, field)."""
    oc = body.get("output_config")
    for fmt, param in ((oc.get("format") if isinstance(oc, dict) else None, "output_config.format"),
                       (body.get("output_format"), "output_format")):
        if fmt is None:
            continue
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise BadRequest(f"'{param}.type' must be 'json_schema'", param=param)
        # Anthropic's structured outputs are always strict: objects hold only their properties
        return json_format_constraint({**fmt, "strict": True}, param), param
    return None, None


async def _parse(request: Request, body: dict[str, Any]) -> _Request:
    pool: ModelPool = request.app.state.pool
    model = model_of(body, pool.config.default_name(), pool.config.ids())
    slot = pool.get(model)
    label_request(request, slot.model.name)
    _refuse_unsupported(body)
    turns = _turns(body)
    tools, choice = _tools(request, body)
    text_schema, fmt_param = _output_format(body)
    return _Request(model, slot, prepare(slot, turns, tools, choice, text_schema, fmt_param,
                                         allow_empty=body.get("messages") == []))


def _generate(req: _Request, body: dict[str, Any], max_tokens: int, prefix: str) -> Generate:
    sampling_body: dict[str, Any] = {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    get_float(body, "temperature", None, 0.0, 1.0)  # Anthropic's range
    sampling = read_sampling(sampling_body, OPENAI_DEFAULTS, req.slot, openai=False)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise BadRequest("'stop_sequences' must be an array of strings", param="stop_sequences")
    sampling["stop"] = [s for s in (stops or []) if s]
    return Generate(id=new_id(prefix), max_tokens=max_tokens, **req.prep.generate_fields(), **sampling)


async def _begin(request: Request, req: _Request, msg: Generate,
                 early: bool = False) -> tuple[Generation, Token | Done | Accepted]:
    """``begin``, with a context overflow worded as Anthropic words it — the text Claude
    Code parses to compact the conversation (``prompt is too long: N tokens > M maximum``)
    or to lower ``max_tokens`` (``input length and `max_tokens` exceed context limit: N + M > C``)."""
    try:
        return await begin(request, req.slot, msg, grammar_param=req.prep.constraint_param, early=early)
    except ContextLengthExceeded as e:
        raise anthropic_context_error(e) from None


#: The worker's refusal of a prompt too long to tokenize (``worker.engine.Engine``'s character bound).
_UNTOKENIZED = re.compile(r"maximum context length is (\d+) tokens\. However, the prompt has (\d+) characters, "
                          r"more than \d+ tokens of at most (\d+) characters")


def anthropic_context_error(e: ContextLengthExceeded) -> ContextLengthExceeded:
    """``e`` reworded as the Anthropic API words it (figures from the worker's message). A prompt
    refused before tokenizing (more characters than n_ctx tokens can hold) is worded the same,
    with the least count its characters imply: Claude Code compacts on ``prompt is too long``."""
    if not e.n_ctx:
        m = _UNTOKENIZED.search(e.message)
        if m is None:
            return e
        n_ctx, n_chars, per_token = (int(g) for g in m.groups())
        at_least = -(-n_chars // per_token)
        out = ContextLengthExceeded(f"prompt is too long: {at_least} tokens > {n_ctx - 1} maximum (at least "
                                    f"{at_least}: the prompt's {n_chars} characters were not tokenized)",
                                    code=e.code, param="messages")
        out.n_ctx, out.n_prompt_tokens = n_ctx, at_least
        return out
    if e.n_prompt_tokens >= e.n_ctx or e.n_completion <= 1:
        text = f"prompt is too long: {e.n_prompt_tokens} tokens > {e.n_ctx - 1} maximum"
        param = "messages"
    else:
        text = (f"input length and `max_tokens` exceed context limit: {e.n_prompt_tokens} + {e.n_completion} > "
                f"{e.n_ctx}, decrease input length or `max_tokens` and try again")
        param = "max_tokens"
    out = ContextLengthExceeded(text, code=e.code, param=param)
    out.n_ctx, out.n_prompt_tokens, out.n_completion = e.n_ctx, e.n_prompt_tokens, e.n_completion
    return out


async def messages(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
    req = await _parse(request, body)
    refuse_ignored(body, "/v1/messages")  # stop, seed, response_format, ...: not Messages fields
    max_tokens = get_int(body, "max_tokens", None, 1, INT32_MAX)
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    streaming = get_bool(body, "stream", False)
    msg = _generate(req, body, max_tokens, "msg")
    run, first = await _begin(request, req, msg, early=streaming)
    mid = "msg_" + msg.id.split("-", 1)[1]
    parser = req.prep.parser("toolu")

    if not streaming:
        tokens, done = await collect(request, run, first)
        out = parser.read([*(t.text for t in tokens), done.text])
        return JSONResponse(message(mid, req.model, out.content, out.calls, done))

    events = MessageStream(mid, req.model, parser)
    return SSEResponse(stream(run, first, events.on_frame, on_error=error_event, on_open=events.on_open,
                              keepalive=PING), run.close)


async def count_tokens(request: Request) -> Response:
    """``{"input_tokens": N}``: the prompt tokens ``/v1/messages`` would have for this body
    (its template, tools and all). Exact: the worker renders and tokenizes it as for a
    generation of 0 tokens (so it also warms the prefix cache for the real request)."""
    body = await read_json(request)
    req = await _parse(request, body)
    msg = _generate(req, body, 0, "count")
    try:
        run, first = await begin(request, req.slot, msg, grammar_param=req.prep.constraint_param)
    except BadRequest as e:  # beyond the context (or KV budget): still a count (router.dialects.counting)
        if not refused_for_length(e):
            raise
        return JSONResponse({"input_tokens": await count_beyond_context(request, req.slot, msg, e)})
    _, done = await collect(request, run, first)
    return JSONResponse({"input_tokens": done.prompt_tokens})


routes = route_table({
    "POST /v1/messages": messages, "POST /v1/messages/count_tokens": count_tokens
})
