"""llama.cpp's native routes, with ``model`` in the body (optional when only one
model is configured): ``/completion``, ``/tokenize``, ``/detokenize``, ``/apply-template``.

``/completion`` uses llama.cpp's names and defaults (``n_predict``, ``n_probs``,
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; temperature 0 is greedy;
``json_schema`` and ``grammar`` in Lark form constrain the output) and
answers ``content``, ``tokens``, ``stop_type``, ``timings`` and
``completion_probabilities`` — exactly one entry per generated token, also for a
token ending inside a UTF-8 character (its ``bytes`` are exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from protocol import (
    Accepted,
    ApplyTemplate,
    ApplyTemplateResult,
    Detokenize,
    DetokenizeResult,
    Done,
    Generate,
    Token,
    Tokenize,
    TokenIds,
    TokenizeResult,
    encode,
)
from protocol.limits import GENERATE_LIMITS
from router.dialects.constraints import llamacpp_constraint
from router.dialects.shared import RANDOM_SEED, read_template_kwargs, template_kwargs
from router.serving.calls import call_worker
from router.http.errors import ApiError, BadGateway, BadRequest
from router.dialects.field_policy import refuse_ignored
from router.serving.generation import (
    LLAMACPP_DEFAULTS,
    TokenProb,
    begin,
    collect,
    error_event,
    new_id,
    read_sampling,
    stream,
    timings_of,
    token_probs,
)
from router.dialects.chat_request import parse_messages
from router.metrics import label_request
from router.http.params import (
    INT32_MAX,
    MAX_TOKEN_ID,
    N_PREDICT_MIN,
    get_bool,
    get_bounded,
    get_int,
    model_of,
    get_prompt,
    get_str,
    get_token_list,
    read_json,
)
from router.serving.budget import RequestTooLarge, request_ceiling
from router.serving.server import Generation
from router.workers.pool import ModelSlot, Pool
from router.serving.presets import preset_template
from router.http.responses import JSONResponse, dumps
from router.http.access_log import access_record
from router.http.set_aside import set_aside
from router.http.sse import SSEResponse, sse_event, until_disconnect

def _slot(request: Request, body: dict[str, Any]) -> tuple[str, ModelSlot]:
    pool: Pool = request.app.state.pool
    name = model_of(body, pool.config.default_name(), pool.config.ids())
    slot = pool.get(name)
    label_request(request, slot.model.name)
    return name, slot


def _token_text(piece: bytes) -> str:
    """A piece's ``token`` text as llama.cpp's server gives it (``validate_utf8`` in
    tools/server/utils.hpp): a multi-byte character cut off at the end is dropped, so a
    token that ends mid-character shows only its complete part (``bytes`` has it all)."""
    n = len(piece)
    for i in range(1, min(4, n) + 1):
        c = piece[n - i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            n -= i
            break
    return piece[:n].decode("utf-8", errors="replace")


def _prob_entry(p: TokenProb, n: int, post_sampling: bool = False) -> dict[str, Any]:
    """One ``completion_probabilities`` entry: ``logprob`` / ``top_logprobs`` (the model's), or with
    ``post_sampling_probs`` llama.cpp's ``prob`` / ``top_probs`` (the sampler chain's probabilities)."""
    if post_sampling:
        return {
            "id": p.id, "token": _token_text(p.piece), "bytes": list(p.piece), "prob": _prob(p.logprob),
            "top_probs": [{"id": tid, "token": _token_text(pc), "bytes": list(pc), "prob": _prob(lp)}
                          for tid, pc, lp in p.top[:n]],
        }
    return {
        "id": p.id, "token": _token_text(p.piece), "bytes": list(p.piece), "logprob": p.logprob,
        "top_logprobs": [{"id": tid, "token": _token_text(pc), "bytes": list(pc),
                          "logprob": lp} for tid, pc, lp in p.top[:n]],
    }


def _prob(logprob: float | None) -> float:
    return 0.0 if logprob is None or logprob == -math.inf else math.exp(logprob)


PromptPart = str | int
Prompt = str | list[int] | list[PromptPart]


def _is_id(p: Any) -> bool:
    return isinstance(p, int) and not isinstance(p, bool)


def _prompts(body: dict[str, Any], most: int) -> list[Prompt]:
    """``prompt``'s prompts, as llama-server's ``tokenize_input_prompts`` reads the field: a list
    holding no number is a list of prompts (each answered in order, ``index`` its place), anything
    else is one prompt. ``most``: how many one request may carry (a 400 naming ``prompt`` beyond)."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) > 1 and not any(_is_id(p) for p in raw):
        if len(raw) > most:
            raise BadRequest(f"'prompt' holds {len(raw)} prompts; one request may carry at most {most} for this "
                             "model (its parallel + max_queue: every prompt runs as a request of its own)",
                             param="prompt")
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(raw)]
    return [_prompt(raw, "prompt")]


def _prompt(raw: Any, param: str) -> Prompt:
    """One prompt as llama-server takes one: a string, token ids, a list mixing strings and
    token ids (``[12, 34, "text", 56]``: returned as is, :func:`_mixed_ids` tokenizes it), or an
    object ``{"prompt_string": ...}`` (with no ``multimodal_data``: this server has no vision).
    ``param``: the field's name in errors (``prompt``, ``prompt[2]``)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (dict, list)):
        raw = raw[0]  # one prompt in a list of prompts
    if isinstance(raw, dict):
        if raw.get("multimodal_data"):
            raise BadRequest(f"'{param}.multimodal_data' is not supported: this server's models take text only",
                             param=f"{param}.multimodal_data")
        text = raw.get("prompt_string")
        if not isinstance(text, str):
            raise BadRequest("a prompt object needs a string 'prompt_string'", param=f"{param}.prompt_string")
        return text
    prompt = get_prompt(raw, param)
    if prompt is not None:
        return prompt
    if (isinstance(raw, list) and raw and all(isinstance(p, str) or _is_id(p) for p in raw)
            and any(_is_id(p) for p in raw)):
        for t in raw:
            if _is_id(t) and not 0 <= t <= MAX_TOKEN_ID:
                raise BadRequest(f"'{param}': token ids must be integers in [0, {MAX_TOKEN_ID}], got {t}",
                                 param=param)
        return list(raw)
    raise BadRequest(f"'{param}' must be a string, a non-empty list of token ids (strings may be mixed in), "
                     "{\"prompt_string\": ...} or a list of these (several prompts)", param=param)


async def _tokenize(request: Request, slot: ModelSlot, text: str, add_special: bool, parse_special: bool,
                    param: str) -> list[int]:
    ans = await call_worker(request, slot, lambda i: Tokenize(id=i, content=text, add_special=add_special,
                                                         parse_special=parse_special), param=param)
    if not isinstance(ans, TokenizeResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to tokenize")
    return list(ans.tokens.view())


async def _mixed_ids(request: Request, slot: ModelSlot, parts: Sequence[PromptPart]) -> list[int]:
    """A mixed prompt's token ids, as llama-server's ``tokenize_mixed``: each string tokenized
    with special tokens parsed, the first element (only) with the model's BOS when it is a string;
    ids kept as they are."""
    out: list[int] = []
    for k, p in enumerate(parts):
        if isinstance(p, str):
            out += await _tokenize(request, slot, p, k == 0, True, "prompt")
        else:
            out.append(p)
    return out


async def _text_logit_bias(request: Request, slot: ModelSlot, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with llama-server's text-keyed ``logit_bias`` entries (``{"Hello": -1}``,
    ``[["Hello", false]]``) turned into one entry per token of the text (tokenized without
    special tokens, as llama-server does); entries keyed by token id are left as they are."""
    lb = body.get("logit_bias")
    if isinstance(lb, dict):
        pairs = list(lb.items())
    elif isinstance(lb, list) and all(isinstance(p, list) and len(p) == 2 for p in lb):
        pairs = [(p[0], p[1]) for p in lb]
    else:
        return body
    if not any(isinstance(k, str) and not k.strip().isdigit() for k, _ in pairs):
        return body
    out: list[list[Any]] = []
    for key, bias in pairs:
        if isinstance(key, str) and not key.strip().isdigit():
            out += [[t, bias] for t in await _tokenize(request, slot, key, False, False, "logit_bias")]
        else:
            out.append([key, bias])
    return {**body, "logit_bias": out}


def _settings(msg: Generate, n_predict: int | None, streaming: bool) -> dict[str, Any]:
    """llama-server's ``generation_settings`` of a /completion answer: the parameters this request
    ran with (its own values, the model's config and llama.cpp's defaults), in its names."""
    return {
        "n_predict": -1 if n_predict is None else n_predict,
        "seed": RANDOM_SEED if msg.seed is None else msg.seed,
        "temperature": msg.temperature, "top_k": msg.top_k, "top_p": msg.top_p, "min_p": msg.min_p,
        "repeat_last_n": msg.repeat_last_n, "repeat_penalty": msg.repeat_penalty,
        "presence_penalty": msg.presence_penalty, "frequency_penalty": msg.frequency_penalty,
        "stop": list(msg.stop), "max_tokens": -1 if n_predict is None else n_predict, "n_keep": 0,
        "ignore_eos": msg.ignore_eos, "stream": streaming,
        "logit_bias": [[t, b if b not in (math.inf, -math.inf) else False if b < 0 else b]
                       for t, b in msg.logit_bias],
        "n_probs": msg.n_probs, "grammar": msg.grammar or "", "json_schema": msg.json_schema or "",
        "cache_prompt": msg.cache_prompt,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
    }


async def completion(request: Request) -> Response | SSEResponse:
    body = await read_json(request)
    name, slot = _slot(request, body)
    # llama.cpp's post_sampling_probs: served here (router.serving.samplers refuses it on the other routes)
    post_sampling = get_bool(body, "post_sampling_probs", False)
    body = {k: v for k, v in body.items() if k != "post_sampling_probs"}
    refuse_ignored(body, "/completion")  # n, logprobs, response_format, tools, ...: not /completion fields
    prompts: list[str | list[int]] = []
    for parts in _prompts(body, slot.model.parallel + slot.model.max_queue):
        if isinstance(parts, list) and any(isinstance(p, str) for p in parts):
            prompts.append(await _mixed_ids(request, slot, parts))
        else:
            prompts.append(cast("str | list[int]", parts))  # a list with no string in it holds ids only
    body = await _text_logit_bias(request, slot, body)
    if get_bool(body, "return_progress", False):  # cannot be done: the worker reports no prefill progress
        set_aside(request.state, "return_progress", "prompt_progress",
                  "the worker reports no progress of a prompt's prefill; the stream has no prompt_progress chunks")
    n_predict = get_int(body, "n_predict", None, N_PREDICT_MIN, INT32_MAX)  # -1: until n_ctx
    for alias in ("max_completion_tokens", "max_tokens"):  # llama.cpp's aliases of n_predict
        if n_predict is None:
            n_predict = get_int(body, alias, None, N_PREDICT_MIN, INT32_MAX)
    max_tokens = None if n_predict is None or n_predict < 0 else n_predict
    n_probs = get_bounded(body, "n_probs", 0, GENERATE_LIMITS["n_probs"], integer=True)
    return_tokens = get_bool(body, "return_tokens", False)
    streaming = get_bool(body, "stream", False)
    json_schema, grammar, param = llamacpp_constraint(body)
    # a slot that exists is accepted; which slot runs is the prefix cache's choice (the text does not
    # depend on it; the answer's id_slot says which ran), as llama.cpp does when id_slot is -1
    get_int(body, "id_slot", -1, -1, slot.model.parallel - 1)
    sampling = read_sampling(body, LLAMACPP_DEFAULTS, slot, openai=False)
    cache_prompt, ignore_eos = get_bool(body, "cache_prompt", True), get_bool(body, "ignore_eos", False)
    if len(prompts) > 1:
        max_tokens = await _shared_n_predict(request, slot, len(prompts), max_tokens)
    msgs = [Generate(id=new_id("cmpl"), prompt=prompt, max_tokens=max_tokens, n_probs=n_probs,
                     post_sampling_probs=post_sampling, cache_prompt=cache_prompt, ignore_eos=ignore_eos,
                     json_schema=json_schema, grammar=grammar, **sampling) for prompt in prompts]
    settings = _settings(msgs[0], max_tokens, streaming)
    access = access_record(request.state)
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}

    def account(done: Done) -> None:
        """Several prompts: the access log's figures are the request's, every prompt's summed (each
        generation's record writes its own, last one wins, as it finishes before this runs)."""
        if len(msgs) > 1:
            totals["prompt_tokens"] += done.prompt_tokens
            totals["cached_tokens"] += done.cache_n
            totals["completion_tokens"] += done.completion_tokens
            access.update(totals)

    def summary(index: int, run: Generation, done: Done, tokens: list[int], content: str) -> dict[str, Any]:
        ready = run.ready
        prompt = prompts[index]
        # as llama.cpp: truncated when generation stopped because the context was full
        truncated = (done.stop_type == "limit" and ready is not None
                     and done.prompt_tokens + done.completion_tokens >= ready.n_ctx)
        return {
            "index": index, "content": content, "tokens": tokens if return_tokens else [], "id_slot": done.id_slot,
            "stop": True, "model": name, "tokens_predicted": done.completion_tokens,
            "tokens_evaluated": done.prompt_tokens, "generation_settings": settings,
            **({"prompt": prompt} if isinstance(prompt, str) else {}),
            "has_new_line": "\n" in content, "truncated": truncated,
            "stop_type": done.stop_type if done.stop_type in ("eos", "word", "limit") else "none",
            "stopping_word": done.stopping_word,
            "tokens_cached": done.prompt_tokens + done.completion_tokens,
            "timings": timings_of(done),
        }

    def eog_token(done: Done) -> list[Token]:
        # llama.cpp reports the end-of-generation token like any other (in tokens, one stream
        # chunk, completion_probabilities); its piece is "" as it is not rendered
        if done.eog_token < 0:
            return []
        return [Token(id=done.id, text="", token_id=done.eog_token, piece=b"", logprob=done.eog_logprob,
                      top_logprobs=done.eog_top_logprobs)]

    def probs(tokens: list[Token]) -> list[dict[str, Any]]:
        return [_prob_entry(p, n_probs, post_sampling) for p in token_probs(tokens, n_probs)]

    if not streaming:
        async def answer(index: int) -> dict[str, Any]:
            run, first = await begin(request, slot, msgs[index], grammar_param=param)
            tokens, done = await collect(request, run, first)
            account(done)
            text = "".join(t.text for t in tokens) + done.text
            tokens += eog_token(done)
            out = summary(index, run, done, [t.token_id for t in tokens], text)
            if n_probs > 0:
                out["completion_probabilities"] = probs(tokens)
            return out

        if len(msgs) == 1:
            return JSONResponse(await answer(0))
        # llama-server answers several prompts with the list of their results, in the prompts' order
        return JSONResponse(await _all([answer(i) for i in range(len(msgs))]))

    def formatter(index: int, run: Generation) -> Callable[[Token | Done], Awaitable[list[bytes]]]:
        count = 0

        async def on_frame(item: Token | Done) -> list[bytes]:
            nonlocal count
            if isinstance(item, Token):
                count += 1
                chunk: dict[str, Any] = {"index": index, "content": item.text,
                                         "tokens": [item.token_id],  # llama.cpp: always, when streaming
                                         "stop": False, "tokens_predicted": count}
                if n_probs > 0:
                    chunk["completion_probabilities"] = probs([item])
                return [sse_event(chunk)]
            account(item)
            events = []
            for eog in eog_token(item):  # llama.cpp streams the end-of-generation token as a chunk too
                count += 1
                eog_chunk: dict[str, Any] = {"index": index, "content": "", "tokens": [eog.token_id], "stop": False,
                                             "tokens_predicted": count}
                if n_probs > 0:
                    eog_chunk["completion_probabilities"] = probs([eog])
                events.append(sse_event(eog_chunk))
            return events + [sse_event(summary(index, run, item, [], item.text))]

        return on_frame

    if len(msgs) == 1:
        run, first = await begin(request, slot, msgs[0], grammar_param=param, early=True)
        return SSEResponse(stream(run, first, formatter(0, run)), run.close)
    # several prompts: each its own run, their chunks interleaved as they come (each names its
    # prompt's index), as llama-server streams the tasks of one request. The stream opens once
    # one of them is under way — a refusal before that is the request's answer (llama-server
    # treats the first result's error as a non-stream one); later ones wait for a job slot while
    # the first stream flows (waiting for them all first would deadlock: the first ones pause
    # while nobody reads them, holding the slots the later ones wait for)
    starts = [asyncio.ensure_future(begin(request, slot, m, grammar_param=param, early=True)) for m in msgs]
    try:
        await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _drop(starts)
        raise
    refused = [t for t in starts if t.done() and not t.cancelled() and t.exception() is not None]
    if refused:
        _drop(starts)
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
        async for ev in stream(run, first, formatter(index, run), on_error):
            yield ev

    return SSEResponse(_merge([prompt_stream(i) for i in range(len(msgs))], lambda: failed),
                       lambda: _drop(starts))


def _drop(starts: Sequence[asyncio.Future[tuple[Generation, Token | Done | Accepted]]]) -> None:
    """Cancel the ``begin`` calls still waiting; close the runs of those done."""
    for t in starts:
        if not t.done():
            t.cancel()
        elif not t.cancelled() and t.exception() is None:
            t.result()[0].close()


async def _shared_n_predict(request: Request, slot: ModelSlot, k: int, max_tokens: int | None) -> int | None:
    """The ``n_predict`` each of ``k`` prompts of one request gets: its total work is bounded
    as ``n`` choices' is (``router.serving.budget``): without ``n_predict`` each takes an equal share
    of the model's request ceiling; with one, ``k`` x ``n_predict`` beyond it is a 400 naming
    ``prompt``. The ceiling needs the worker's n_ctx when none is configured: the model is loaded
    first then (as a tokenize call would load it)."""
    ceiling, why = request_ceiling(slot)
    if ceiling is None:
        with slot.holding():
            await until_disconnect(request.receive, slot.ready_worker())
        ceiling, why = request_ceiling(slot)
        if ceiling is None:
            return max_tokens
    if max_tokens is None:
        if ceiling // k < 1:
            raise RequestTooLarge(f"{k} prompts cannot share this request's ceiling of {ceiling} tokens ({why}) "
                                  f"for model '{slot.model.name}'", param="prompt")
        return ceiling // k
    if k * max_tokens > ceiling:
        raise RequestTooLarge(
            f"{k} prompts x n_predict {max_tokens} = {k * max_tokens} tokens is beyond what one request may ask "
            f"of model '{slot.model.name}': {ceiling} tokens ({why}; set max_request_tokens to allow more). "
            "Send fewer prompts or fewer tokens", param="prompt")
    return max_tokens


T = TypeVar("T")


async def _all(coros: list[Coroutine[Any, Any, T]], discard: Callable[[T], None] | None = None) -> list[T]:
    """Run ``coros`` at once; their results in order. The first to fail (the lowest index of those
    failed by then) cancels the others and is raised; the results of those that had finished
    are given to ``discard`` (runs begun for nothing are closed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # this handler cancelled (client gone, shutdown): nothing is left running
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if discard is not None and not t.cancelled() and t.exception() is None:
                discard(t.result())
        raise
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if not failed:
        return [t.result() for t in tasks]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if discard is not None:
        for t in tasks:
            if not t.cancelled() and t.exception() is None:
                discard(t.result())
    exc = failed[0].exception()
    assert exc is not None
    raise exc


async def _merge(streams: list[AsyncIterator[bytes]], stop: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The events of ``streams`` interleaved as they come, until every one has ended or ``stop()``
    turns true after an event. Each stream is read only while fewer than ``len(streams)`` events
    wait to be sent: a reader that takes nothing holds them all back (router.http.sse's pacing)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=len(streams))

    async def pump(events: AsyncIterator[bytes]) -> None:
        async for ev in events:
            await queue.put(ev)
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        ended = 0
        while ended < len(tasks):
            ev = await queue.get()
            if ev is None:
                ended += 1
                continue
            yield ev
            if stop():
                return
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:  # a stream whose pump waited to put an event: its generator is suspended
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


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
    parts = [b'{"tokens":[']
    for i in range(0, len(ids), TOKENS_PER_SLICE):
        if i:
            parts.append(b",")
            await asyncio.sleep(0)
        parts.append(",".join(map(str, ids[i:i + TOKENS_PER_SLICE])).encode("ascii"))
    parts.append(b"]}")
    return b"".join(parts)


async def _pieces_json(ans: TokenizeResult) -> bytes:
    """``{"tokens":[{"id":..,"piece":..},...]}`` (a piece that is not UTF-8 as its byte
    values), rendered a slice at a time like :func:`_token_list_json`."""
    ids = ans.tokens.view()
    parts = [b'{"tokens":[']
    for i in range(0, len(ids), PIECES_PER_SLICE):
        if i:
            parts.append(b",")
            await asyncio.sleep(0)
        chunk = [{"id": t, "piece": _piece(p)}
                 for t, p in zip(ids[i:i + PIECES_PER_SLICE], ans.piece_slice(i, i + PIECES_PER_SLICE))]
        parts.append(dumps(chunk)[1:-1])
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


routes = [
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
]
