"""What the OpenAI and llama.cpp generation endpoints share.

* :func:`read_sampling` — sampling fields of a request body, layered over the
  API's defaults and the model's configured defaults;
* :func:`begin` — admit, wait for the worker, send Generate, and wait for the
  first frame *before* any response byte, so an error there (context overflow,
  bad token, load failure) still gets its precise HTTP status;
* :func:`collect` / :func:`stream` — drive the rest for a JSON answer or an SSE
  stream (a failure after the first byte becomes one ``data: {"error": ...}``
  event, then the stream closes);
* :func:`timings_of` / :func:`usage_of` / :class:`TokenProb` — llama.cpp
  ``timings``, OpenAI ``usage``, per-token log-probabilities.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from protocol import Accepted, Done, Generate, KVChunk, PromptProgress, Token
from router.http.access_log import access_record
from router.serving.budget import check_request_budget, request_ceiling
from router.serving.disaggregate import prefill_and_hand_over, prefill_slot
from router.http.errors import ApiError, BadRequest, ContextLengthExceeded, InternalError, Unavailable, error_payload
from protocol.limits import GENERATE_LIMITS
from router.http.params import (
    INT32_MAX,
    INT32_MIN,
    SEED_MAX,
    SEED_MIN,
    get_bounded,
    get_float,
    get_int,
    get_logit_bias,
    get_stop,
)
from router.serving import models
from router.serving.models import ServedModel, slot_of
from router.serving import keep_alive
from router.serving.presets import preset_template
from router.serving.server import Generation, submit
from router.serving.samplers import refuse_unimplemented
from router.http.set_aside import set_aside
from router.http.sse import sse_event, until_disconnect

log = logging.getLogger("modelyard.generation")

#: Built-in defaults when neither the request nor the model config says: OpenAI's for /v1/*.
OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
    "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None,
}
#: llama.cpp server's defaults, for /completion.
LLAMACPP_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.0,
    "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None,
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def read_sampling(body: dict[str, Any], api_defaults: dict[str, Any], slot: ServedModel,
                  *, openai: bool) -> dict[str, Any]:
    """Sampling fields for Generate (llama.cpp names). Raises BadRequest naming the field.

    Bounds: ``protocol.limits.GENERATE_LIMITS`` (the worker's too); integer bounds (see router.http.params): ``seed`` in [-2**63, 2**64-1] (negative: random),
    ``top_k`` and ``repeat_last_n`` at most INT32_MAX. ``openai`` applies OpenAI's
    stricter rules (temperature in [0, 2], logit_bias values in [-100, 100])."""
    refuse_unimplemented(body)  # mirostat, typical_p, DRY, XTC, ... only at their neutral values
    d = {**api_defaults, **slot.model.sampling}
    t_lo, t_hi = (0.0, 2.0) if openai else (None, None)
    seed = get_int(body, "seed", d["seed"], SEED_MIN, SEED_MAX)
    if seed is not None and seed < 0:
        seed = None  # llama.cpp: -1 is "random"
    top_k = get_int(body, "top_k", d["top_k"], INT32_MIN, INT32_MAX)
    lim = GENERATE_LIMITS  # the bounds the worker enforces too
    temperature = (get_float(body, "temperature", d["temperature"], t_lo, t_hi) if openai
                   else get_bounded(body, "temperature", d["temperature"], lim["temperature"]))
    return {
        "temperature": temperature,
        "top_p": get_bounded(body, "top_p", d["top_p"], lim["top_p"]),
        "top_k": max(0, top_k),
        "min_p": get_bounded(body, "min_p", d["min_p"], lim["min_p"]),
        "repeat_penalty": get_bounded(body, "repeat_penalty", d["repeat_penalty"], lim["repeat_penalty"]),
        "repeat_last_n": get_bounded(body, "repeat_last_n", d["repeat_last_n"], lim["repeat_last_n"], integer=True),
        "presence_penalty": get_float(body, "presence_penalty", d["presence_penalty"], -2.0, 2.0),
        "frequency_penalty": get_float(body, "frequency_penalty", d["frequency_penalty"], -2.0, 2.0),
        "seed": seed,
        "logit_bias": get_logit_bias(body, strict=openai),
        "stop": get_stop(body),
    }


async def begin(request: Request, served: ServedModel, msg: Generate, grammar_param: str | None = None, *,
                early: bool = False) -> tuple[Generation, Token | Done | Accepted]:
    """Admit ``msg``'s request (503 if full), wait its turn, send it, and return the
    run with its first frame: with ``early`` (a stream), the worker's Accepted — the prompt
    fits and is queued, so the stream can open before the prefill (:func:`stream`) — else
    the first Token or the Done. What the worker's constraint set aside is recorded for
    the response header (``router.http.set_aside``). A client that leaves meanwhile cancels it
    (ClientDisconnected). Raises the ApiError of a worker Error frame; an invalid
    constraint (``invalid_grammar``) names ``grammar_param``, the request field it came from.
    A background job's request (``router.dialects.background``) has ``state.run_hook(run, stage)``,
    called once admitted (``"admitted"``) and once its Generate is sent (``"started"``)."""
    slot = slot_of(served)
    rid = getattr(request.state, "request_id", "")
    if rid:
        msg = dataclasses.replace(msg, trace_id=rid)  # the worker logs it with the generation
    # n x max_tokens within the model's ceiling (router.serving.budget) — on what the client asked, before
    # the model's n_predict gives an answer that names no length its default
    msg = check_request_budget(slot, msg)
    msg = cap_answer(msg, slot.model.n_predict)
    msg = with_system_prompt(msg, slot.model.system_prompt)
    template = preset_template(slot)  # a preset's own template travels with its chats
    if template is not None and msg.messages is not None and msg.chat_template is None:
        msg = dataclasses.replace(msg, chat_template=template)
    pre = prefill_slot(request, slot)
    if pre is not None:  # disaggregated: another worker prefills, this one decodes (router.serving.disaggregate)
        try:
            await until_disconnect(request.receive, prefill_and_hand_over(pre, slot, msg))
        except ContextLengthExceeded as e:
            if e.param is None:
                e.param = "messages" if msg.messages is not None else "prompt"
            raise
        # the decode worker reuses the prefix just handed over even with cache_prompt false: the
        # prefill worker evaluated this prompt afresh (cache_prompt as asked), and the state is that
        # very evaluation (a prefix is only ever reused for the same tokens)
        msg = dataclasses.replace(msg, cache_prompt=True)
    keep = keep_alive.apply(request.state, getattr(request.state, "json_body", None),
                            request.app.state.pool.config.server.max_keep_alive_s)  # 400 before admission
    run = submit(slot, msg.id, access_record(request.state), early=early)  # its record: queued (or 503 now)
    models.set_keep_alive(slot, keep)  # the model as a whole: with replicas, each one
    hook = getattr(request.state, "run_hook", None)
    try:
        if hook is not None:
            hook(run, "admitted")
        if request_ceiling(slot)[0] is None:  # no n_ctx known before the load: checked on its worker
            await until_disconnect(request.receive, run.wait_worker())
            msg = check_request_budget(slot, msg)
        await until_disconnect(request.receive, run.start(msg))
        if hook is not None:
            hook(run, "started")
        first = await until_disconnect(request.receive, run.next())
        assert not isinstance(first, KVChunk)  # only router.serving.disaggregate asks for stream_state
        assert not isinstance(first, PromptProgress)  # sent after the Accepted, which comes first
    except ContextLengthExceeded as e:  # the field at fault, as OpenAI names it
        run.close()
        if e.param is None:
            e.param = "messages" if msg.messages is not None else "prompt"
        raise
    except BadRequest as e:
        run.close()
        if e.param is None:
            e.param = _worker_error_param(e, msg, grammar_param)
        raise
    except BaseException:
        run.close()
        raise
    if run.accepted is not None:
        for warning in run.accepted.set_aside:
            for what in _set_aside_items(warning):
                set_aside(request.state, grammar_param or "constraint", what,
                          "a JSON Schema keyword the constraint cannot enforce (the grammar was loosened)")
    return run, first


def with_system_prompt(msg: Generate, system_prompt: str | None) -> Generate:
    """``msg`` with the model's (or preset's) ``system_prompt`` as its first message when it is
    a chat whose messages bring no system (or developer) message of their own."""
    if not system_prompt or msg.messages is None:
        return msg
    if any(m.get("role") in ("system", "developer") for m in msg.messages if isinstance(m, dict)):
        return msg
    return dataclasses.replace(msg, messages=[{"role": "system", "content": system_prompt}, *msg.messages])


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
#: llguidance's other loosening: ``oneOf not fully supported; falling back to anyOf...``
_PARTIAL = re.compile(r"^\s*([A-Za-z$][\w$]*) not fully supported")


def _set_aside_items(warning: str) -> list[str]:
    """The schema keywords an llguidance warning names (``Unimplemented keys: ["a", "b"]``,
    ``oneOf not fully supported; ...``), else the warning's first words (short)."""
    m = _UNIMPLEMENTED.search(warning)
    if m:
        try:
            keys = json.loads(m.group(1))
            if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
                return keys
        except ValueError:
            pass
    m = _PARTIAL.match(warning)
    if m:
        return [m.group(1)]
    return [warning.split(";")[0][:80]]


def cap_answer(msg: Generate, n_predict: int) -> Generate:
    """``msg`` with the model's ``n_predict`` applied as llama.cpp's ``-n`` applies it: the
    answer's length when the request names none (``max_tokens`` None), its cap when the
    request names more (the answer then ends with finish_reason "length"). ``n_predict``
    -1: no limit (the request's own, else the context)."""
    if n_predict > 0 and (msg.max_tokens is None or msg.max_tokens > n_predict):
        return dataclasses.replace(msg, max_tokens=n_predict)
    return msg


def _worker_error_param(e: BadRequest, msg: Generate, grammar_param: str | None) -> str | None:
    """The request field a worker's 400 is about (the worker knows Generate's fields, the
    router the dialect's): the constraint's field, the prompt (``messages`` for chat), or
    a sampling field the message names."""
    if e.code == "invalid_grammar":
        return grammar_param
    if e.code in ("invalid_token", "empty_prompt"):
        return "messages" if msg.messages is not None else "prompt"
    for name in ("logit_bias", "stop", "seed"):
        if name in e.message:
            return name
    return None


async def collect(request: Request, run: Generation, first: Token | Done | Accepted) -> tuple[list[Token], Done]:
    """Every Token and the Done of a run (non-streaming). The client leaving cancels it."""

    async def go() -> tuple[list[Token], Done]:
        tokens: list[Token] = []
        item: Token | Done | Accepted | PromptProgress = first
        while not isinstance(item, Done):
            if isinstance(item, Token):
                tokens.append(item)
            nxt = await run.next()
            assert not isinstance(nxt, KVChunk)  # only router.serving.disaggregate asks for stream_state
            item = nxt
        return tokens, item

    try:
        tokens, done = await until_disconnect(request.receive, go())
    finally:
        run.close()
    check_not_cancelled(done)
    return tokens, done


def check_not_cancelled(done: Done) -> None:
    """A Done(cancelled) reaching a live client means the worker was stopped under it."""
    if done.finish_reason == "cancelled":
        raise Unavailable("the generation was cancelled by the server (model unloading or shutting down)",
                          code="cancelled")


Formatter = Callable[[Token | Done], Awaitable[list[bytes]]]


#: A stream that has sent nothing for ``[server] sse_keepalive_s`` sends a keep-alive: while a long
#: prompt is prefilled, or a tool call is held back until it is whole, no client waits in silence.
#: The default keep-alive: an SSE comment line, which every SSE parser skips.
KEEPALIVE_COMMENT = b": keep-alive\n\n"


async def stream(run: Generation, first: Token | Done | Accepted, on_frame: Formatter,
                 on_error: Callable[[ApiError], bytes] | None = None, *,
                 on_open: Callable[[Accepted], list[bytes]] | None = None,
                 on_progress: Callable[[PromptProgress], list[bytes]] | None = None,
                 keepalive: bytes = KEEPALIVE_COMMENT) -> AsyncIterator[bytes]:
    """SSE events for every frame of ``run`` (``on_frame`` formats; may return none).

    ``first`` an Accepted (``begin(early=True)``): ``on_open`` gives the dialect's opening
    events at once (Anthropic ``message_start``, the chat role chunk, ``response.created``;
    none given: a keep-alive), before the prompt is prefilled. The PromptProgress frames of a
    Generate with ``return_progress`` are formatted by ``on_progress`` (none given: no event).
    Whenever nothing was sent for the server's ``sse_keepalive_s``, ``keepalive`` is (an SSE
    comment, Anthropic's ``ping``).
    An ApiError mid-stream becomes one error event (``on_error``, default
    :func:`error_event`: OpenAI's shape) and ends the stream."""
    on_error = on_error or error_event
    keepalive_s = run.sse_keepalive_s
    getter: asyncio.Future[Token | Done | Accepted | KVChunk | PromptProgress] | None = None
    try:
        item: Token | Done | Accepted | PromptProgress = first
        sent_at = time.monotonic()  # the response head goes out with the first event
        while True:
            if isinstance(item, Done):
                check_not_cancelled(item)
            if isinstance(item, Accepted):
                events = on_open(item) if on_open is not None else [keepalive]
            elif isinstance(item, PromptProgress):
                events = on_progress(item) if on_progress is not None else []
            else:
                events = await on_frame(item)
            for ev in events:
                yield ev
            if events:
                sent_at = time.monotonic()
            if isinstance(item, Done):
                return
            # the next frame, with a keep-alive whenever none came for keepalive_s. Not asyncio.wait_for:
            # before Python 3.12 it swallows a cancellation that meets a finished frame, and the
            # stream of a client gone (the pump cancelled) would go on
            getter = asyncio.ensure_future(run.next())
            while True:
                done, _ = await asyncio.wait({getter}, timeout=max(0.05, keepalive_s - (time.monotonic() - sent_at)))
                if done:
                    break
                yield keepalive
                sent_at = time.monotonic()
            nxt = getter.result()
            getter = None
            assert not isinstance(nxt, KVChunk)
            item = nxt
    except ApiError as err:
        yield on_error(err)
    except Exception as exc:  # a bug: still end the stream with an error event, not a cut connection
        log.exception("stream of request %s failed", run.id)
        yield on_error(InternalError(f"internal error: {type(exc).__name__}"))
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
        run.close()


def error_event(err: ApiError) -> bytes:
    """The SSE event of an error once the stream has started (``stream``'s ``on_error``)."""
    return sse_event(error_payload(err))


def prompt_progress_of(p: PromptProgress) -> dict[str, Any]:
    """llama-server's ``prompt_progress`` object (tokens; ``time_ms`` whole ms since the prompt's start)."""
    return {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": int(p.time_ms)}


def timings_of(done: Done) -> dict[str, Any]:
    """llama.cpp's ``timings`` object (ms, tokens, tokens/s)."""
    def per_tok(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_s(ms: float, n: int) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0

    # one token came out of the prompt's own pass: no decode step was timed, so there is no
    # generation rate (llama-server reports 0 there, not a figure from a few microseconds)
    predicted_per_second = per_s(done.predicted_ms, done.predicted_n) if done.predicted_n > 1 else 0.0

    return {
        "cache_n": done.cache_n,
        "prompt_n": done.prompt_n,
        "prompt_ms": done.prompt_ms,
        "prompt_per_token_ms": per_tok(done.prompt_ms, done.prompt_n),
        "prompt_per_second": per_s(done.prompt_ms, done.prompt_n),
        "predicted_n": done.predicted_n,
        "predicted_ms": done.predicted_ms,
        "predicted_per_token_ms": per_tok(done.predicted_ms, done.predicted_n),
        "predicted_per_second": predicted_per_second,
    }


def usage_of(done: Done) -> dict[str, Any]:
    """OpenAI's ``usage`` (tokens)."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cache_n},
    }


@dataclass(frozen=True)
class TokenProb:
    """One generated token with its log-probability and the top alternatives
    (``top``: (id, piece bytes, logprob), best first)."""

    id: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]]

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", errors="replace")


def token_probs(tokens: list[Token], n_top: int) -> list[TokenProb]:
    """TokenProb for each token (``n_top`` alternatives kept). Each alternative comes
    with its exact piece bytes in the frame ([id, logprob, piece])."""
    out: list[TokenProb] = []
    for t in tokens:
        top = [(int(alt[0]), alt[2] if len(alt) >= 3 and isinstance(alt[2], bytes) else b"", float(alt[1]))
               for alt in t.top_logprobs[:n_top]]
        lp = t.logprob if t.logprob is not None else 0.0
        out.append(TokenProb(t.token_id, t.piece, float(lp), top))
    return out


def openai_logprob(tp: TokenProb, n_top: int) -> dict[str, Any]:
    """One token's logprob object as OpenAI writes it (chat ``logprobs.content[i]``, the
    Responses API's ``output_text.logprobs[i]``): token, logprob, bytes, top_logprobs."""
    return {
        "token": tp.text,
        "logprob": tp.logprob,
        "bytes": list(tp.piece),
        "top_logprobs": [
            {"token": p.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(p)}
            for _, p, lp in tp.top[:n_top]
        ],
    }


def now_s() -> int:
    return int(time.time())
