"""llama.cpp's native routes, with ``model`` in the body (optional when only one
model is configured): ``/completion``, ``/tokenize``, ``/detokenize``, ``/apply-template``.

``/completion`` uses llama.cpp's names and defaults (``n_predict``, ``n_probs``,
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; temperature 0 is greedy;
``json_schema`` and ``grammar`` in Lark form constrain the output): its request is read by
``llamacpp_request``, its answer built by ``llamacpp_answers`` (``content``, ``tokens``,
``stop_type``, ``timings``, ``completion_probabilities``; a stream's ``prompt_progress`` chunks
with ``return_progress``), several prompts run at once by ``llamacpp_tasks``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocol import (
    ApplyTemplate,
    ApplyTemplateResult,
    Detokenize,
    DetokenizeResult,
    Tokenize,
    TokenIds,
    TokenizeResult,
)
from router.dialects.chat_request import parse_messages
from router.dialects.llamacpp_answers import CompletionAnswers, progress_chunk
from router.dialects.llamacpp_request import Completion, read_completion
from router.dialects.llamacpp_tasks import drop, gather, merge
from router.dialects.shared import read_template_kwargs, template_kwargs
from router.http.access_log import access_record
from router.http.errors import ApiError, BadGateway, BadRequest
from router.http.params import get_bool, get_str, get_token_list, model_of, read_json
from router.http.responses import JSONResponse, dumps
from router.http.sse import SSEResponse
from router.http.routes import route_table
from router.metrics import label_request
from router.serving.calls import call_worker
from router.serving.generation import begin, collect, error_event, stream
from router.serving.presets import preset_template
from router.serving.models import ModelPool, ServedModel


def _slot(request: Request, body: dict[str, Any]) -> tuple[str, ServedModel]:
    pool: ModelPool = request.app.state.pool
    name = model_of(body, pool.config.default_name(), pool.config.ids())
    slot = pool.get(name)
    label_request(request, slot.model.name)
    return name, slot


async def completion(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
    name, slot = _slot(request, body)
    req = await read_completion(request, slot, body)
    answers = CompletionAnswers(name, req, access_record(request.state))
    if not req.streaming:
        async def result(index: int) -> dict[str, Any]:
            run, first = await begin(request, slot, req.msgs[index], grammar_param=req.grammar_param)
            tokens, done = await collect(request, run, first)
            return answers.result(index, run, tokens, done)

        if len(req.msgs) == 1:
            return JSONResponse(await result(0))
        # llama-server answers several prompts with the list of their results, in the prompts' order
        return JSONResponse(await gather([result(i) for i in range(len(req.msgs))]))
    if len(req.msgs) == 1:
        run, first = await begin(request, slot, req.msgs[0], grammar_param=req.grammar_param, early=True)
        return SSEResponse(stream(run, first, answers.formatter(0, run), on_progress=progress_chunk(0)), run.close)
    return await _stream_several(request, slot, req, answers)


async def _stream_several(request: Request, slot: ServedModel, req: Completion,
                          answers: CompletionAnswers) -> SSEResponse:
    """Several prompts, streamed: each its own run, their chunks interleaved as they come (each
    names its prompt's index), as llama-server streams the tasks of one request. The stream opens
    once one of them is under way — a refusal before that is the request's answer (llama-server
    treats the first result's error as a non-stream one); later ones wait for a job slot while
    the first stream flows (waiting for them all first would deadlock: the first ones pause
    while nobody reads them, holding the slots the later ones wait for)."""
    starts = [asyncio.ensure_future(begin(request, slot, m, grammar_param=req.grammar_param, early=True))
              for m in req.msgs]
    try:
        await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        drop(starts)
        raise
    refused = [t for t in starts if t.done() and not t.cancelled() and t.exception() is not None]
    if refused:
        drop(starts)
        exc = refused[0].exception()
        assert exc is not None
        raise exc
    failed = False

    def on_error(err: ApiError) -> bytes:
        nonlocal failed
        failed = True  # llama-server ends the whole stream at an error of one of its tasks
        return error_event(err)

    async def prompt_stream(index: int) -> AsyncIterator[bytes]:
        try:
            run, first = await starts[index]
        except ApiError as err:
            yield on_error(err)
            return
        async for ev in stream(run, first, answers.formatter(index, run), on_error, on_progress=progress_chunk(index)):
            yield ev

    return SSEResponse(merge([prompt_stream(i) for i in range(len(req.msgs))], lambda: failed),
                       lambda: drop(starts))


def _piece(p: bytes) -> str | list[int]:
    try:
        return p.decode("utf-8")
    except UnicodeDecodeError:
        return list(p)


async def tokenize(request: Request) -> Response:
    body = await read_json(request)
    _, slot = _slot(request, body)
    content = get_str(body, "content")
    with_pieces = get_bool(body, "with_pieces", False)
    add_special = get_bool(body, "add_special", False)
    parse_special = get_bool(body, "parse_special", True)
    ans = await call_worker(request, slot, lambda i: Tokenize(id=i, content=content, add_special=add_special,
                                                         parse_special=parse_special, with_pieces=with_pieces))
    if not isinstance(ans, TokenizeResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to tokenize")
    if with_pieces:
        return Response(await _pieces_json(ans), media_type="application/json")
    return Response(await _token_list_json(ans), media_type="application/json")


#: Token ids rendered per event-loop turn for a /tokenize answer (~10 ms of work each).
TOKENS_PER_SLICE = 65536
#: Tokens with their pieces rendered per event-loop turn (a dict and a JSON object each).
PIECES_PER_SLICE = 8192


async def _token_list_json(ans: TokenizeResult) -> bytes:
    """``{"tokens":[...]}`` exactly as :func:`router.http.responses.dumps` makes it, rendered a
    slice at a time from the packed ids with the event loop free in between: 2.5M ids (a
    7 MB text) take ~0.8 s of encoding, which would otherwise pause every other stream
    of the router."""
    ids = ans.tokens.view()
    return await _sliced_json(len(ids), TOKENS_PER_SLICE, lambda lo, hi: ",".join(map(str, ids[lo:hi])).encode("ascii"))


async def _pieces_json(ans: TokenizeResult) -> bytes:
    """``{"tokens":[{"id":..,"piece":..},...]}`` (a piece that is not UTF-8 as its byte
    values), rendered a slice at a time like :func:`_token_list_json`."""
    ids = ans.tokens.view()
    return await _sliced_json(len(ids), PIECES_PER_SLICE, lambda lo, hi: dumps(
        [{"id": t, "piece": _piece(p)} for t, p in zip(ids[lo:hi], ans.piece_slice(lo, hi))])[1:-1])


async def _sliced_json(n: int, per: int, render: Callable[[int, int], bytes]) -> bytes:
    """``{"tokens":[...]}`` with its ``n`` entries rendered ``per`` at a time (``render(lo, hi)``:
    entries lo..hi-1 as JSON, comma-separated, no brackets), the event loop free between slices."""
    parts = [b'{"tokens":[']
    for i in range(0, n, per):
        if i:
            parts.append(b",")
            await asyncio.sleep(0)
        parts.append(render(i, min(i + per, n)))
    parts.append(b"]}")
    return b"".join(parts)


async def detokenize(request: Request) -> Response:
    body = await read_json(request)
    _, slot = _slot(request, body)
    raw = body.get("tokens")
    if raw == []:
        return JSONResponse({"content": ""})
    tokens = get_token_list(raw, "tokens")
    if tokens is None:
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    packed = TokenIds.of(tokens)  # ids in [0, MAX_TOKEN_ID]: int32 (get_token_list)
    ans = await call_worker(request, slot, lambda i: Detokenize(id=i, tokens=packed), param="tokens")
    if not isinstance(ans, DetokenizeResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to detokenize")
    return JSONResponse({"content": ans.content})


async def apply_template(request: Request) -> Response:
    body = await read_json(request)
    _, slot = _slot(request, body)
    messages = parse_messages(body)
    add_gen = get_bool(body, "add_generation_prompt", True)
    kwargs = template_kwargs(slot, read_template_kwargs(body))
    template = preset_template(slot)
    ans = await call_worker(request, slot, lambda i: ApplyTemplate(id=i, messages=messages, add_generation_prompt=add_gen,
                                                             template_kwargs=kwargs, chat_template=template),
                      param="messages")
    if not isinstance(ans, ApplyTemplateResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to apply-template")
    return JSONResponse({"prompt": ans.prompt})


routes = route_table({
    "POST /completion": completion, "POST /completions": completion, "POST /tokenize": tokenize,
    "POST /detokenize": detokenize, "POST /apply-template": apply_template
})
