"""Ollama's answers written (``/api/chat``, ``/api/generate``; router.dialects.ollama_api reads
the request and runs it here).

Answers out: NDJSON (``application/x-ndjson``, one object a line, ``stream`` defaults to
true) ending with ``done: true``, ``done_reason`` (``stop`` / ``length``) and the timings in
nanoseconds (``total_duration``, ``load_duration`` — the wait for the model's load, 0 when
it was loaded — ``prompt_eval_count`` = the prompt's tokens, ``prompt_eval_cached_count`` =
those reused from the KV cache (when some were), ``prompt_eval_duration``, ``eval_count``,
``eval_duration``); or one object with ``stream: false``. Tool calls are
``message.tool_calls`` ``[{"id", "function": {"index", "name", "arguments": {...}}}]``.
Errors are ``{"error": "..."}`` with their status (``router.http.errors``: 400, 404 unknown model,
503 + Retry-After queue full, ...); a failure after the first line is a last line
``{"error": "..."}``.

The generation itself (admission, the worker run, cancel-on-disconnect, the error path) is
``router.serving.generation``'s.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import Accepted, Done, Generate, Token
from router.dialects.ollama_request import read_body
from router.dialects.shared import Prepared
from router.dialects.tools import ToolCall
from router.http.errors import ApiError, ollama_error_payload
from router.http.params import get_bool
from router.http.responses import JSONResponse, dumps
from router.http.sse import SSEResponse
from router.serving.generation import begin, collect, openai_logprob, stream, token_probs
from router.serving.models import ServedModel
from router.serving.server import Generation
from router.serving.models import LOADED

_NS_PER_MS = 1_000_000


def now_iso() -> str:
    """Ollama's ``created_at``: RFC 3339 UTC with microseconds."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _stats(done: Done, t0: float, load_ns: int) -> dict[str, Any]:
    """The final object's figures, as Ollama gives them: ``prompt_eval_count`` the prompt's
    tokens in all, ``prompt_eval_cached_count`` those reused from the KV cache (only when
    some were), ``prompt_eval_duration`` the time evaluating the others; durations in ns."""
    out = {
        "done_reason": done.finish_reason,  # "stop" | "length" (cancelled never reaches here)
        "total_duration": int((time.monotonic() - t0) * 1e9),
        "load_duration": load_ns,
        "prompt_eval_count": done.prompt_tokens,
        "prompt_eval_duration": int(done.prompt_ms * _NS_PER_MS),
        "eval_count": done.completion_tokens,
        "eval_duration": int(done.predicted_ms * _NS_PER_MS),
    }
    if done.cache_n > 0:
        out["prompt_eval_cached_count"] = done.cache_n
    return out


def _call_json(c: ToolCall, index: int) -> dict[str, Any]:
    """A call as Ollama writes it: arguments an object."""
    try:
        args = json.loads(c.arguments) if c.arguments.strip() else {}
    except json.JSONDecodeError:
        args = {}
    if not isinstance(args, dict):
        args = {"value": args}
    return {"id": c.id, "function": {"index": index, "name": c.name, "arguments": args}}


def _lp(tokens: list[Token], top: int | None) -> list[dict[str, Any]]:
    return [openai_logprob(p, top or 0) for p in token_probs(tokens, top or 0)]


class NDJSONResponse(SSEResponse):
    """Ollama's stream: one JSON object a line (the SSE response's disconnect handling)."""

    content_type = b"application/x-ndjson"


def line(obj: dict[str, Any]) -> bytes:
    return dumps(obj) + b"\n"


def _error_line(err: ApiError) -> bytes:
    return line(ollama_error_payload(err))


@dataclass
class Job:
    """A parsed generation request: what to run and how to answer."""

    model: str  # the name the client used (echoed back)
    slot: ServedModel
    msg: Generate
    prep: Prepared | None  # chat: tools and the parser
    constraint_param: str | None
    top_lp: int | None
    chat: bool  # /api/chat (a message) or /api/generate (a response)


async def run(request: Request, job: Job, t0: float) -> Response | SSEResponse:
    """Run ``job`` and answer it: one JSON object with ``stream: false``, else an NDJSON stream
    (``t0``: the request's arrival, ``time.monotonic()``)."""
    was_loaded = job.slot.state in LOADED
    streaming = get_bool(await read_body(request), "stream", True)
    gen, first = await begin(request, job.slot, job.msg, grammar_param=job.constraint_param, early=streaming)
    load_ns = 0 if was_loaded else max(0, int(gen.waited_s * 1e9))
    if not streaming:
        return await _whole(request, job, gen, first, t0, load_ns)
    return _stream(job, gen, first, t0, load_ns)


async def _whole(request: Request, job: Job, gen: Generation, first: Token | Done | Accepted, t0: float,
                 load_ns: int) -> Response:
    tokens, done = await collect(request, gen, first)
    pieces = [*(t.text for t in tokens), done.text]
    out: dict[str, Any] = {"model": job.model, "created_at": now_iso()}
    if job.chat:
        assert job.prep is not None
        parsed = job.prep.parser().read(pieces)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
        if parsed.calls:
            message["tool_calls"] = [_call_json(c, k) for k, c in enumerate(parsed.calls)]
        out["message"] = message
    else:
        out["response"] = "".join(pieces)
    out["done"] = True
    out.update(_stats(done, t0, load_ns))
    if job.top_lp is not None:
        out["logprobs"] = _lp(tokens, job.top_lp)
    return JSONResponse(out)


def _stream(job: Job, gen: Generation, first: Token | Done | Accepted, t0: float, load_ns: int) -> SSEResponse:
    head = {"model": job.model}
    parser = job.prep.parser() if job.prep is not None else None
    pending: list[Token] = []
    n_calls = 0

    def chunk(text: str, calls: list[ToolCall] | None = None) -> bytes:
        nonlocal n_calls
        obj: dict[str, Any] = {**head, "created_at": now_iso()}
        if job.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [_call_json(c, n_calls + k) for k, c in enumerate(calls)]
                n_calls += len(calls)
            obj["message"] = message
        else:
            obj["response"] = text
        obj["done"] = False
        if job.top_lp is not None:
            obj["logprobs"] = _lp(pending, job.top_lp)
            pending.clear()
        return line(obj)

    def emit(text: str, calls: list[ToolCall], out: list[bytes]) -> None:
        if text:
            out.append(chunk(text))
        if calls:
            out.append(chunk("", calls))

    async def on_frame(item: Token | Done) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(item, Token):
            pending.append(item)
            if item.text:
                emit(*(parser.feed(item.text) if parser is not None else (item.text, [])), out)
            return out
        if parser is not None:
            emit(*parser.feed(item.text), out)
            emit(*parser.finish(), out)
        elif item.text:
            emit(item.text, [], out)
        final: dict[str, Any] = {**head, "created_at": now_iso()}
        if job.chat:
            final["message"] = {"role": "assistant", "content": ""}
        else:
            final["response"] = ""
        final["done"] = True
        final.update(_stats(item, t0, load_ns))
        if job.top_lp is not None and pending:
            final["logprobs"] = _lp(pending, job.top_lp)
        out.append(line(final))
        return out

    # the stream opens as soon as the worker has accepted the prompt, and a line that adds nothing
    # keeps it alive while a long prompt is prefilled (Ollama's clients read every line as a chunk)
    empty: dict[str, Any] = {**head, "created_at": now_iso()}
    empty.update({"message": {"role": "assistant", "content": ""}} if job.chat else {"response": ""})
    nothing = line({**empty, "done": False})
    return NDJSONResponse(stream(gen, first, on_frame, on_error=_error_line, on_open=lambda _: [nothing],
                                 keepalive=nothing), gen.close)

