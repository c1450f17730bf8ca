"""One-shot calls to a model's worker (tokenize, detokenize, apply-template, slot actions):
the serving layer's door for requests that take no job slot; and :func:`prompt_ids`, a
generation's prompt rendered and tokenized as one call (counting a prompt, routing among replicas).

The model is kept from being idle while the call waits for its load or its answer
(``ModelSlot.holding``), so placement never evicts it for a later request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from protocol import ApplyTemplate, ApplyTemplateResult, Error, Generate, Message, ProtocolError, TokenIds, Tokenize
from protocol import TokenizeResult, encode
from protocol.errors import ErrorCode
from router.http.errors import BadGateway, BadRequest, from_worker_error, unsendable
from router.http.sse import until_disconnect
from router.serving.models import ServedModel, slot_of
from router.workers.connection import WorkerUnreachable

#: How long a tokenize / detokenize / apply-template call may take, s. Liveness is the ping
#: loop's (router.workers.liveness: a silent worker is unresponsive, then killed, and the call ends with
#: it); this bounds only a live worker that never answers the call. Three 7 MB /tokenize
#: calls queue on the worker's text thread: the last waits for the two before it.
CALL_TIMEOUT_S = 600.0


async def model_ready(model: ServedModel) -> None:
    """Wait until the model serves, loading it: with replicas, until one is ready, every replica
    started (``router.workers.replicas``); else until its worker is. Raises what the load failed
    with (ApiError)."""
    slot = slot_of(model)
    replicas = slot.replica_set()
    if replicas is not None:
        if replicas.ready():
            return
        replicas.start_others(slot)
    await slot.ready_worker()


async def worker_ready(model: ServedModel) -> None:
    """Wait until ``model``'s own worker is ready, loading it (the model is not idle meanwhile: never
    evicted for a later request), for a fact only its Ready gives (n_ctx when none is configured).
    Raises what the load failed with (ApiError)."""
    await slot_of(model).ready_worker()


async def call_worker(request: Request, model: ServedModel, make: Any, timeout_s: float = CALL_TIMEOUT_S,
                      param: str | None = None) -> Message:
    """Send a one-shot request (``make(id)``: tokenize, detokenize, apply-template, a slot action)
    to the model's worker, loading it if needed; its answer, or the mapped ApiError.
    A request the protocol cannot carry is a 400 (checked before the model is loaded). ``param``:
    the request field a worker's 400 that names none is about (``tokens`` for an id outside the
    vocabulary), as the generation routes name ``prompt`` / ``messages``."""
    slot = slot_of(model)
    try:
        encode(make("check"))
    except ProtocolError as e:
        raise unsendable(e.reason) from None
    with slot.holding():  # not evicted for another model while this call waits or runs
        worker = await until_disconnect(request.receive, slot.ready_worker())
        msg = make(worker.new_call_id("call"))
        try:
            ans = await until_disconnect(request.receive, worker.call(msg, timeout_s))
        except ProtocolError as e:
            raise unsendable(e.reason) from None
        except WorkerUnreachable as e:
            raise BadGateway(f"model '{slot.model.name}' worker is unreachable: {e}", code="worker_crashed") from None
        except TimeoutError:
            raise BadGateway(f"model '{slot.model.name}' worker did not answer within {timeout_s:g} s",
                             code="worker_timeout") from None
    if isinstance(ans, Error):
        if ans.code == ErrorCode.WORKER_GONE:
            raise BadGateway(f"model '{slot.model.name}' worker failed: {ans.message}", code="worker_crashed")
        err = from_worker_error(ans.code, ans.message, n_prompt_tokens=ans.n_prompt_tokens, n_ctx=ans.n_ctx)
        if isinstance(err, BadRequest) and err.param is None:
            err.param = param
        raise err
    return ans


#: How one worker call is made: given ``make(id)`` (the message for a call id), its answer.
Call = Callable[[Callable[[str], Message]], Awaitable[Message]]


async def prompt_ids(msg: Generate, call: Call) -> TokenIds:
    """``msg``'s prompt as token ids: given, or its messages rendered with the model's template
    (``ApplyTemplate``: its tools, template variables, a preset's template) and the text tokenized
    (``Tokenize``) through ``call`` on the worker's text thread — never its engine. Tokenized as the
    worker tokenizes a Generate: a chat with BOS (its template markup special), a text prompt with
    BOS as ``add_special`` asks. (The worker tokenizes a chat's markup and contents apart, so a
    content that spells a special token is counted here as that token.) Raises what ``call``
    raises, BadGateway for an answer of another type."""
    if isinstance(msg.prompt, list):
        return TokenIds.of(msg.prompt)
    text = msg.prompt or ""
    if msg.messages is not None:
        messages = msg.messages
        ans = await call(lambda i: ApplyTemplate(id=i, messages=messages, tools=msg.tools,
                                                 template_kwargs=msg.template_kwargs, chat_template=msg.chat_template))
        if not isinstance(ans, ApplyTemplateResult):
            raise BadGateway(f"unexpected {ans.TYPE} answer to apply_template")
        text = ans.prompt
    tok = await call(lambda i: Tokenize(id=i, content=text, parse_special=True,
                                        add_special=msg.add_special or msg.messages is not None))
    if not isinstance(tok, TokenizeResult):
        raise BadGateway(f"unexpected {tok.TYPE} answer to tokenize")
    return tok.tokens
