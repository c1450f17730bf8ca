"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Request and response shapes follow OpenAI's; responses also carry llama.cpp's
``timings``. Unknown request fields are ignored, but not the fields of other dialects and
llama.cpp that change the answer (``router.dialects.field_policy``: a 400 naming them). ``echo``, ``best_of`` > 1, a
non-empty ``suffix`` and non-text content parts are a clear 400 (not supported),
never silently wrong. Chat tools (function and custom), ``tool_choice`` and
``response_format`` go through ``router.dialects.shared.prepare`` (the template's own tool
syntax, else the generic tool format); a last assistant message is a prefill.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import Accepted, Done, Generate, PromptProgress, Token
from protocol.limits import MAX_N, MAX_N_PROBS
from router import gguf_meta
from router.dialects.constraints import llamacpp_constraint
from router.dialects.shared import Prepared, prepare, read_template_kwargs
from router.http.errors import BadRequest, NotFound
from router.dialects.chat_request import parse_tools, parse_turns, refuse_unsupported_chat, response_format
from router.dialects.field_policy import refuse_ignored
from router.dialects.openai_shapes import choice_finals, envelope, final_events, fingerprint, usage_null, wants_usage
from router.serving.budget import context_size
from router.serving.generation import (
    OPENAI_DEFAULTS,
    TokenProb,
    begin,
    collect,
    new_id,
    now_s,
    openai_logprob,
    prompt_progress_of,
    read_sampling,
    stream,
    timings_of,
    token_probs,
    usage_of,
)
from router.metrics import label_request
from router.http.params import INT32_MAX, N_PREDICT_MIN, get_bool, get_int, model_of, get_prompt, get_str, read_json
from router.serving.models import ModelPool, ServedModel
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse, sse_event
from router.http.routes import route_table
from router.dialects.tools import ToolCall

MAX_TOP_LOGPROBS = MAX_N_PROBS  # they become Generate.n_probs


def _pool(request: Request) -> ModelPool:
    pool: ModelPool = request.app.state.pool
    return pool


# ----------------------------------------------------------------------------- models


def _model_object(pool: ModelPool, ident: str) -> dict[str, Any]:
    m = pool.config.resolve(ident)
    assert m is not None
    slot = pool.slots[m.name]
    created = int(m.path.stat().st_mtime) if m.path.exists() else 0
    n_ctx, train = context_size(slot)
    obj: dict[str, Any] = {
        "id": ident,
        "object": "model",
        "created": created,
        "owned_by": "modelyard",
        "root": m.name,
        "aliases": list(m.aliases) if ident == m.name else [],
        "state": slot.state.value,
        "weights": m.weights_mode,
    }
    if n_ctx is not None:
        # the context size under the names harnesses read: LM Studio / OpenRouter (context_length),
        # vLLM (max_model_len), llama.cpp's meta (n_ctx_train; n_ctx is the size served)
        obj.update(context_length=n_ctx, max_model_len=n_ctx)
    # the GGUF header's facts (cached; never loads the model), with the context as served
    header = gguf_meta.meta(m.path)
    obj["meta"] = {**header, "n_ctx": n_ctx, "n_ctx_train": train if train is not None else header["n_ctx_train"],
                   "size": m.path.stat().st_size if m.path.exists() else None}
    return obj


async def list_models(request: Request) -> Response:
    """Every configured name and alias. Never loads a model."""
    pool = _pool(request)
    await gguf_meta.warm([m.path for m in pool.config.models.values()])
    return JSONResponse({"object": "list", "data": [_model_object(pool, i) for i in pool.config.ids()]})


async def get_model(request: Request) -> Response:
    pool = _pool(request)
    ident = request.path_params["model_id"]
    if pool.config.resolve(ident) is None:
        raise NotFound(f"model '{ident}' not found; available models: {', '.join(pool.config.ids())}",
                       param="model")
    await gguf_meta.warm([m.path for m in pool.config.models.values()])
    return JSONResponse(_model_object(pool, ident))


# ----------------------------------------------------------------------------- shared parsing


def _common(body: dict[str, Any], slot: ServedModel, prefix: str) -> dict[str, Any]:
    n = get_int(body, "n", 1, 1, MAX_N)  # choices: n sequences from one prefilled prompt
    max_tokens = get_int(body, "max_completion_tokens", None, 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, 1, INT32_MAX)
    # llama.cpp's id_slot, checked as /completion checks it (the prefix cache picks the slot that runs)
    get_int(body, "id_slot", -1, -1, slot.model.parallel - 1)
    n_predict = get_int(body, "n_predict", None, N_PREDICT_MIN, INT32_MAX)  # llama.cpp's name: it wins there
    if n_predict is not None:
        max_tokens = None if n_predict < 0 else n_predict  # -1: until n_ctx, as on /completion
    return {"id": new_id(prefix), "max_tokens": max_tokens, "n": n,
            "ignore_eos": get_bool(body, "ignore_eos", False),  # llama.cpp extension
            "cache_prompt": get_bool(body, "cache_prompt", True),  # llama.cpp extension
            **read_sampling(body, OPENAI_DEFAULTS, slot, openai=True)}


# ----------------------------------------------------------------------------- chat


def _chat_logprobs(tokens: list[Token], n_top: int) -> list[dict[str, Any]]:
    return [openai_logprob(p, n_top) for p in token_probs(tokens, n_top)]


def _tool_call_json(c: ToolCall) -> dict[str, Any]:
    """A call as chat completions write it: a function call's ``arguments`` JSON text, or a
    custom tool's ``input`` text."""
    if c.custom:
        return {"id": c.id, "type": "custom", "custom": {"name": c.name, "input": c.arguments}}
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _chat_finish(finish: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish_reason of a choice: "tool_calls" when it ended by itself with calls."""
    return "tool_calls" if calls and finish == "stop" else finish


@dataclass
class _Chat:
    """A validated chat request: its model, its Generate, and how to write the answer."""

    slot: ServedModel
    model_name: str
    msg: Generate
    prep: Prepared
    constraint_param: str | None
    want_logprobs: bool
    top_n: int
    streaming: bool
    include_usage: bool


def _read_chat(request: Request, body: dict[str, Any]) -> _Chat:
    """Validate a chat body into a :class:`_Chat`. Raises BadRequest naming the field, NotFound."""
    pool = _pool(request)
    model_name = model_of(body, pool.config.default_name(), pool.config.ids())
    slot = pool.get(model_name)
    label_request(request, slot.model.name)
    refuse_unsupported_chat(body)
    tools, choice = parse_tools(body)
    schema, grammar, cparam = llamacpp_constraint(body)  # llama.cpp's extensions on its OpenAI route
    if cparam is not None and body.get("response_format") is not None:
        raise BadRequest(f"give at most one of 'response_format' and '{cparam}'", param=cparam)
    text_schema, fmt_param = (schema, "json_schema") if schema is not None else (response_format(body),
                                                                               "response_format")
    prep = prepare(slot, parse_turns(body), tools, choice, text_schema, fmt_param,
                   chat_template_kwargs=read_template_kwargs(body))
    fields, constraint_param = prep.generate_fields(), prep.constraint_param
    if grammar is not None:
        if prep.grammar is not None:
            raise BadRequest("'grammar' cannot be combined with tools (their calls are a grammar already)",
                             param="grammar")
        fields["grammar"], constraint_param = grammar, "grammar"
    common = _common(body, slot, "chatcmpl")
    want_logprobs = get_bool(body, "logprobs", False)
    top_n = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_n is not None and not want_logprobs:
        raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    top_n = top_n or 0
    streaming = get_bool(body, "stream", False)
    include_usage = wants_usage(body)
    msg = Generate(n_probs=max(top_n, 1) if want_logprobs else 0,  # llama.cpp's return_progress: streams only
                   return_progress=streaming and get_bool(body, "return_progress", False), **fields, **common)
    return _Chat(slot, model_name, msg, prep, constraint_param, want_logprobs, top_n, streaming, include_usage)


async def chat_completions(request: Request) -> Response | SSEResponse:
    chat = _read_chat(request, await read_json(request))
    run, first = await begin(request, chat.slot, chat.msg, grammar_param=chat.constraint_param,
                             early=chat.streaming)
    assert run.granted
    created, fp = now_s(), fingerprint(run.ready)
    if not chat.streaming:
        tokens, done = await collect(request, run, first)
        return JSONResponse(_chat_answer(chat, created, fp, tokens, done))
    out = _ChatStream(chat, created, fp)
    return SSEResponse(stream(run, first, out.on_frame, on_open=out.on_open, on_progress=out.on_progress),
                       run.close)


def _chat_answer(chat: _Chat, created: int, fp: str | None, tokens: list[Token], done: Done) -> dict[str, Any]:
    """The non-streaming answer: every choice read back (content, tool calls, logprobs)."""
    choices = []
    for i, (tail_text, finish) in enumerate(choice_finals(done, chat.msg.n)):
        parser = chat.prep.parser()
        mine = [t for t in tokens if t.index == i]
        out = parser.read([*(t.text for t in mine), tail_text])
        logprobs = None
        if chat.want_logprobs and out.content is not None:
            logprobs = {"content": _chat_logprobs(mine, chat.top_n), "refusal": None}
        message: dict[str, Any] = {"role": "assistant", "content": out.content, "refusal": None}
        if out.calls:
            message["tool_calls"] = [_tool_call_json(c) for c in out.calls]
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": _chat_finish(finish, out.calls)})
    return {**envelope(chat.msg.id, "chat.completion", created, chat.model_name, fp),
            "choices": choices, "usage": usage_of(done), "timings": timings_of(done)}


class _ChatStream:
    """The SSE chunks of a streamed chat: each choice's role chunk, its content and tool-call
    deltas as its parser reads them (with the logprobs of the tokens that made them), its
    finish chunk, then the usage chunk and ``[DONE]``."""

    def __init__(self, chat: _Chat, created: int, fp: str | None) -> None:
        self.chat = chat
        n = chat.msg.n
        self.head = envelope(chat.msg.id, "chat.completion.chunk", created, chat.model_name, fp)
        self.tail = usage_null(chat.include_usage)
        self.parsers = [chat.prep.parser() for _ in range(n)]  # one per choice
        self.pending: list[list[Token]] = [[] for _ in range(n)]  # tokens not yet sent, by choice
        self.started: set[int] = set()

    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              lp: list[dict[str, Any]] | None = None, index: int = 0) -> dict[str, Any]:
        return {**self.head,
                "choices": [{"index": index, "delta": delta,
                             "logprobs": {"content": lp, "refusal": None} if lp else None,
                             "finish_reason": finish}], **self.tail}

    def start(self, i: int, out: list[bytes]) -> None:
        if i not in self.started:
            self.started.add(i)
            # content null, as llama-server's first chunk (its clients expect a non-empty delta or null)
            out.append(sse_event(self.chunk({"role": "assistant", "content": None}, index=i)))

    def on_open(self, accepted: Accepted) -> list[bytes]:
        """Every choice's role chunk at once, before the prompt is prefilled."""
        out: list[bytes] = []
        for i in range(self.chat.msg.n):
            self.start(i, out)
        return out

    def on_progress(self, p: PromptProgress) -> list[bytes]:
        """llama-server's ``prompt_progress`` chunk (``return_progress``): the role delta with it."""
        chunk = self.chunk({"role": "assistant", "content": None})
        return [sse_event({**chunk, "prompt_progress": prompt_progress_of(p)})]

    def emit(self, i: int, content: str, calls: list[ToolCall], out: list[bytes]) -> None:
        """Choice i's content deltas (with the logprobs of the tokens that made them) and tool-call
        deltas: a call's first fragment has its index, id, type and name; the next, its arguments."""
        if content:
            lp = _chat_logprobs(self.pending[i], self.chat.top_n) if self.chat.want_logprobs else None
            self.pending[i].clear()
            out.append(sse_event(self.chunk({"content": content}, lp=lp, index=i)))
        for c in calls:
            self.pending[i].clear()
            index = len(self.parsers[i].calls) - len(calls) + calls.index(c)
            if c.custom:  # one fragment: the whole input
                out.append(sse_event(self.chunk({"tool_calls": [{"index": index, **_tool_call_json(c)}]}, index=i)))
                continue
            out.append(sse_event(self.chunk({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                                              "function": {"name": c.name, "arguments": ""}}]},
                                            index=i)))
            out.append(sse_event(self.chunk({"tool_calls": [{"index": index,
                                                              "function": {"arguments": c.arguments}}]}, index=i)))

    async def on_frame(self, item: Token | Done) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(item, Token):
            i = item.index
            self.start(i, out)
            self.pending[i].append(item)
            if item.text:
                self.emit(i, *self.parsers[i].feed(item.text), out)
            return out
        finals = choice_finals(item, self.chat.msg.n)
        for i, (tail_text, finish) in enumerate(finals):
            self.start(i, out)
            parser = self.parsers[i]
            self.emit(i, *parser.feed(tail_text), out)
            self.emit(i, *parser.finish(), out)
            want = self.chat.want_logprobs
            lp = (_chat_logprobs(self.pending[i], self.chat.top_n) if want and self.pending[i] and not parser.calls
                  else ([] if want else None))
            self.pending[i].clear()
            last = self.chunk({}, _chat_finish(finish, parser.calls), lp, index=i)
            if i < len(finals) - 1:
                out.append(sse_event(last))
            else:
                out.extend(final_events(last, item, self.head, self.chat.include_usage))
        return out


async def chat_input_tokens(request: Request) -> Response:
    """``{"object": "chat.completion.input_tokens", "input_tokens": N}`` (llama-server's
    ``/chat/completions/input_tokens``): the prompt tokens ``/v1/chat/completions`` would have
    for this body (template, tools and response format included). Exact: the worker renders
    and tokenizes it as a generation of 0 tokens (which also warms the prefix cache)."""
    body = await read_json(request)
    pool = _pool(request)
    slot = pool.get(model_of(body, pool.config.default_name(), pool.config.ids()))
    label_request(request, slot.model.name)
    refuse_unsupported_chat(body)
    tools, choice = parse_tools(body)
    schema, grammar, cparam = llamacpp_constraint(body)
    text_schema, fmt_param = (schema, "json_schema") if schema is not None else (response_format(body),
                                                                               "response_format")
    prep = prepare(slot, parse_turns(body), tools, choice, text_schema, fmt_param,
                   chat_template_kwargs=read_template_kwargs(body))
    msg = Generate(id=new_id("count"), max_tokens=0, cache_prompt=get_bool(body, "cache_prompt", True),
                   **prep.generate_fields())
    run, first = await begin(request, slot, msg, grammar_param=prep.constraint_param)
    _, done = await collect(request, run, first)
    return JSONResponse({"object": "chat.completion.input_tokens", "input_tokens": done.prompt_tokens})


# ----------------------------------------------------------------------------- completions


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", param="prompt")
    p = body["prompt"]
    prompt = get_prompt(p, "prompt")
    if prompt is not None:
        return prompt
    if isinstance(p, list) and len(p) > 1:
        raise BadRequest("only one prompt per request is supported (a string or a list of token ids)",
                         param="prompt")
    raise BadRequest("'prompt' must be a string or a non-empty list of token ids", param="prompt")


def _token_str(piece: bytes) -> str:
    """A token's text as OpenAI writes it: the UTF-8 text, or ``bytes:\\xNN...`` for a
    piece that is not valid UTF-8 on its own (part of a character), so distinct
    partial tokens stay distinct keys in ``top_logprobs``."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class _TextOffsets:
    """Character offset of each generated token in the completion text.

    Feeds token pieces through an incremental UTF-8 decoder: a token's offset is
    the number of characters completed by the pieces before it (bytes of a
    character still incomplete are not counted), so offsets never run past the
    text the client receives.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def next(self, piece: bytes) -> int:
        off = self.chars
        self.chars += len(self._decoder.decode(piece))
        return off


def _legacy_logprobs(probs: list[TokenProb], n_top: int, offsets: _TextOffsets) -> dict[str, Any]:
    """The ``/v1/completions`` ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset) for ``probs``; ``offsets`` carries the position across stream chunks."""
    return {
        "tokens": [_token_str(p.piece) for p in probs],
        "token_logprobs": [p.logprob for p in probs],
        "top_logprobs": [{_token_str(pc): lp for _, pc, lp in p.top[:n_top]} for p in probs],
        "text_offset": [offsets.next(p.piece) for p in probs],
    }


async def completions(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
    pool = _pool(request)
    model_name = model_of(body, pool.config.default_name(), pool.config.ids())
    slot = pool.get(model_name)
    label_request(request, slot.model.name)
    refuse_ignored(body, "/v1/completions")
    prompt = _completion_prompt(body)
    common = _common(body, slot, "cmpl")
    if get_bool(body, "echo", False):
        raise BadRequest("'echo' is not supported", param="echo")
    if get_int(body, "best_of", 1, 1) != 1:
        raise BadRequest("only best_of=1 is supported", param="best_of")
    if get_str(body, "suffix", ""):
        raise BadRequest("'suffix' is not supported", param="suffix")
    n_lp = get_int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    streaming = get_bool(body, "stream", False)
    include_usage = wants_usage(body)
    json_schema, grammar, cparam = llamacpp_constraint(body)  # llama.cpp's extensions on its OpenAI route
    msg = Generate(prompt=prompt, n_probs=max(n_lp, 1) if n_lp is not None else 0, json_schema=json_schema,
                   grammar=grammar, return_progress=streaming and get_bool(body, "return_progress", False), **common)

    run, first = await begin(request, slot, msg, grammar_param=cparam, early=streaming)
    assert run.granted
    rid, created, fp = msg.id, now_s(), fingerprint(run.ready)
    top_n = n_lp or 0

    n = msg.n
    if not streaming:
        tokens, done = await collect(request, run, first)
        choices = []
        for i, (tail_text, finish) in enumerate(choice_finals(done, n)):
            mine = [t for t in tokens if t.index == i]
            logprobs = _legacy_logprobs(token_probs(mine, top_n), top_n, _TextOffsets()) \
                if n_lp is not None else None
            choices.append({"index": i, "text": "".join(t.text for t in mine) + tail_text, "logprobs": logprobs,
                            "finish_reason": finish})
        return JSONResponse({
            **envelope(rid, "text_completion", created, model_name, fp),
            "choices": choices, "usage": usage_of(done), "timings": timings_of(done),
        })

    head = envelope(rid, "text_completion", created, model_name, fp)
    tail = usage_null(include_usage)

    def chunk(text: str, finish: str | None = None, lp: dict[str, Any] | None = None,
              index: int = 0) -> dict[str, Any]:
        return {**head,
                "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}], **tail}

    pending: dict[int, list[Token]] = {i: [] for i in range(n)}  # by choice
    offsets = {i: _TextOffsets() for i in range(n)}

    def flush_lp(i: int) -> dict[str, Any] | None:
        if n_lp is None:
            return None
        lp = _legacy_logprobs(token_probs(pending[i], top_n), top_n, offsets[i])
        pending[i].clear()
        return lp

    async def on_frame(item: Token | Done) -> list[bytes]:
        if isinstance(item, Token):
            pending[item.index].append(item)
            if not item.text:
                return []
            lp = flush_lp(item.index)
            return [sse_event(chunk(item.text, lp=lp, index=item.index))]
        finals = choice_finals(item, n)
        out: list[bytes] = []
        for i, (tail_text, finish) in enumerate(finals[:-1]):
            out.append(sse_event(chunk(tail_text, finish, flush_lp(i), index=i)))
        i = len(finals) - 1
        tail_text, finish = finals[i]
        return out + final_events(chunk(tail_text, finish, flush_lp(i), index=i), item, head, include_usage)

    return SSEResponse(stream(run, first, on_frame, on_progress=lambda p: [  # llama.cpp's return_progress
        sse_event({**chunk(""), "prompt_progress": prompt_progress_of(p)})]), run.close)


routes = route_table({
    "GET /v1/models": list_models, "GET /v1/models/{model_id:path}": get_model,
    "POST /v1/chat/completions": chat_completions, "POST /v1/completions": completions,
    # llama-server serves its OpenAI routes without the /v1 prefix too (an SDK whose base URL has no
    # /v1 reaches them), and counts a chat request's prompt tokens: the same handlers as under /v1
    "POST /chat/completions": chat_completions, "POST /chat/completions/input_tokens": chat_input_tokens,
    "POST /v1/chat/completions/input_tokens": chat_input_tokens
})
