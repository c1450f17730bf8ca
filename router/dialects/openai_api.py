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
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from protocol import Accepted, Done, Generate, Ready, Token
from protocol.limits import MAX_N, MAX_N_PROBS
from router.workers import gguf_meta
from router.dialects.constraints import llamacpp_constraint
from router.dialects.shared import prepare, read_template_kwargs
from router.http.errors import BadRequest, NotFound
from router.dialects.chat_request import parse_tools, parse_turns, refuse_unsupported_chat, response_format
from router.dialects.field_policy import refuse_ignored
from router.serving.budget import context_size
from router.serving.generation import (
    OPENAI_DEFAULTS,
    TokenProb,
    begin,
    collect,
    new_id,
    now_s,
    openai_logprob,
    read_sampling,
    stream,
    timings_of,
    token_probs,
    usage_of,
)
from router.metrics import label_request
from router.http.params import INT32_MAX, N_PREDICT_MIN, get_bool, get_int, model_of, get_prompt, get_str, read_json
from router.workers.pool import ModelSlot, Pool
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse, sse_event
from router.dialects.tools import ToolCall

MAX_TOP_LOGPROBS = MAX_N_PROBS  # they become Generate.n_probs


def _pool(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


# ----------------------------------------------------------------------------- models


def _model_object(pool: Pool, ident: str) -> dict[str, Any]:
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


def _common(body: dict[str, Any], slot: ModelSlot, prefix: str) -> dict[str, Any]:
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


def _include_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage`` of a streaming request. Without ``stream`` the
    field is ignored, as llama.cpp does (OpenAI refuses it; litellm and pr-agent send it)."""
    opts = body.get("stream_options")
    if opts is None or not get_bool(body, "stream", False):
        return False
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return get_bool(opts, "include_usage", False)


def _usage_null(include_usage: bool) -> dict[str, Any]:
    """What every chunk before the final usage chunk carries: with
    ``stream_options.include_usage`` OpenAI sends ``"usage": null`` in each of them."""
    return {"usage": None} if include_usage else {}


def _fingerprint(ready: Ready | None) -> str | None:
    """The ``system_fingerprint`` of the worker's model (its GGUF content hash)."""
    if ready is None:
        return None
    fp = ready.fingerprint  # "" while the worker is still hashing a file it never saw
    return f"fp_{fp[:12]}" if fp else None


def _envelope(rid: str, obj: str, created: int, model: str, fp: str | None) -> dict[str, Any]:
    """The fields that open every completion object and chunk, in OpenAI's order."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp}


def _choice_finals(done: Done, n: int) -> list[tuple[str, str]]:
    """``(held-back text, finish_reason)`` of each of the ``n`` choices, by index."""
    if n == 1 or not done.choices:
        return [(done.text, done.finish_reason)]
    by_index = {int(c["index"]): c for c in done.choices}
    return [(str(by_index[i].get("text", "")), str(by_index[i].get("finish_reason", done.finish_reason)))
            if i in by_index else ("", done.finish_reason) for i in range(n)]


def _final_events(final: dict[str, Any], done: Done, head: dict[str, Any], include_usage: bool) -> list[bytes]:
    """The end of a stream: ``final`` (the last chunk) with llama.cpp ``timings``; with
    ``include_usage`` a chunk ``head`` + no choices + ``usage``; then ``[DONE]``."""
    final["timings"] = timings_of(done)
    out = [sse_event(final)]
    if include_usage:
        out.append(sse_event({**head, "choices": [], "usage": usage_of(done), "timings": timings_of(done)}))
    out.append(sse_event("[DONE]"))
    return out


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


async def chat_completions(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
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
    offered = prep.offered
    common = _common(body, slot, "chatcmpl")
    want_logprobs = get_bool(body, "logprobs", False)
    top_n = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_n is not None and not want_logprobs:
        raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    top_n = top_n or 0
    streaming = get_bool(body, "stream", False)
    include_usage = _include_usage(body)
    msg = Generate(n_probs=max(top_n, 1) if want_logprobs else 0, **fields, **common)

    run, first = await begin(request, slot, msg, grammar_param=constraint_param, early=streaming)
    assert run.worker is not None
    rid, created, fp = msg.id, now_s(), _fingerprint(run.ready)
    n = msg.n
    parsers = [prep.parser() for _ in range(n)]  # one per choice

    if not streaming:
        tokens, done = await collect(request, run, first)
        choices = []
        for i, (tail_text, finish) in enumerate(_choice_finals(done, n)):
            parser = parsers[i]
            mine = [t for t in tokens if t.index == i]
            out = parser.read([*(t.text for t in mine), tail_text])
            logprobs = None
            if want_logprobs and out.content is not None:
                logprobs = {"content": _chat_logprobs(mine, top_n), "refusal": None}
            message: dict[str, Any] = {"role": "assistant", "content": out.content, "refusal": None}
            if out.calls:
                message["tool_calls"] = [_tool_call_json(c) for c in out.calls]
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": _chat_finish(finish, out.calls)})
        return JSONResponse({
            **_envelope(rid, "chat.completion", created, model_name, fp),
            "choices": choices, "usage": usage_of(done), "timings": timings_of(done),
        })

    head = _envelope(rid, "chat.completion.chunk", created, model_name, fp)
    tail = _usage_null(include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None,
              lp: list[dict[str, Any]] | None = None, index: int = 0) -> dict[str, Any]:
        return {**head,
                "choices": [{"index": index, "delta": delta,
                             "logprobs": {"content": lp, "refusal": None} if lp else None,
                             "finish_reason": finish}], **tail}

    pending: list[list[Token]] = [[] for _ in range(n)]  # tokens not yet sent, by choice
    started: set[int] = set()

    def start(i: int, out: list[bytes]) -> None:
        if i not in started:
            started.add(i)
            # content null, as llama-server's first chunk (its clients expect a non-empty delta or null)
            out.append(sse_event(chunk({"role": "assistant", "content": None}, index=i)))

    def on_open(accepted: Accepted) -> list[bytes]:
        """Every choice's role chunk at once, before the prompt is prefilled."""
        out: list[bytes] = []
        for i in range(n):
            start(i, out)
        return out

    def emit(i: int, content: str, calls: list[ToolCall], out: list[bytes]) -> None:
        """Choice i's content deltas (with the logprobs of the tokens that made them) and tool-call
        deltas: a call's first fragment has its index, id, type and name; the next, its arguments."""
        if content:
            lp = _chat_logprobs(pending[i], top_n) if want_logprobs else None
            pending[i].clear()
            out.append(sse_event(chunk({"content": content}, lp=lp, index=i)))
        for c in calls:
            pending[i].clear()
            index = len(parsers[i].calls) - len(calls) + calls.index(c)
            if c.custom:  # one fragment: the whole input
                out.append(sse_event(chunk({"tool_calls": [{"index": index, **_tool_call_json(c)}]}, index=i)))
                continue
            out.append(sse_event(chunk({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                                         "function": {"name": c.name, "arguments": ""}}]},
                                       index=i)))
            out.append(sse_event(chunk({"tool_calls": [{"index": index, "function": {"arguments": c.arguments}}]},
                                       index=i)))

    async def on_frame(item: Token | Done) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(item, Token):
            i = item.index
            start(i, out)
            pending[i].append(item)
            if item.text:
                emit(i, *parsers[i].feed(item.text), out)
            return out
        finals = _choice_finals(item, n)
        for i, (tail_text, finish) in enumerate(finals):
            start(i, out)
            parser = parsers[i]
            emit(i, *parser.feed(tail_text), out)
            emit(i, *parser.finish(), out)
            lp = _chat_logprobs(pending[i], top_n) if want_logprobs and pending[i] and not parser.calls \
                else ([] if want_logprobs else None)
            pending[i].clear()
            last = chunk({}, _chat_finish(finish, parser.calls), lp, index=i)
            if i < len(finals) - 1:
                out.append(sse_event(last))
            else:
                out.extend(_final_events(last, item, head, include_usage))
        return out

    return SSEResponse(stream(run, first, on_frame, on_open=on_open), run.close)


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
    include_usage = _include_usage(body)
    json_schema, grammar, cparam = llamacpp_constraint(body)  # llama.cpp's extensions on its OpenAI route
    msg = Generate(prompt=prompt, n_probs=max(n_lp, 1) if n_lp is not None else 0, json_schema=json_schema,
                   grammar=grammar, **common)

    run, first = await begin(request, slot, msg, grammar_param=cparam, early=streaming)
    assert run.worker is not None
    rid, created, fp = msg.id, now_s(), _fingerprint(run.ready)
    top_n = n_lp or 0

    n = msg.n
    if not streaming:
        tokens, done = await collect(request, run, first)
        choices = []
        for i, (tail_text, finish) in enumerate(_choice_finals(done, n)):
            mine = [t for t in tokens if t.index == i]
            logprobs = _legacy_logprobs(token_probs(mine, top_n), top_n, _TextOffsets()) \
                if n_lp is not None else None
            choices.append({"index": i, "text": "".join(t.text for t in mine) + tail_text, "logprobs": logprobs,
                            "finish_reason": finish})
        return JSONResponse({
            **_envelope(rid, "text_completion", created, model_name, fp),
            "choices": choices, "usage": usage_of(done), "timings": timings_of(done),
        })

    head = _envelope(rid, "text_completion", created, model_name, fp)
    tail = _usage_null(include_usage)

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
        finals = _choice_finals(item, n)
        out: list[bytes] = []
        for i, (tail_text, finish) in enumerate(finals[:-1]):
            out.append(sse_event(chunk(tail_text, finish, flush_lp(i), index=i)))
        i = len(finals) - 1
        tail_text, finish = finals[i]
        return out + _final_events(chunk(tail_text, finish, flush_lp(i), index=i), item, head, include_usage)

    return SSEResponse(stream(run, first, on_frame), run.close)


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    # llama-server serves its OpenAI routes without the /v1 prefix too (an SDK whose base URL has no
    # /v1 reaches them), and counts a chat request's prompt tokens: the same handlers as under /v1
    Route("/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
    Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
]
