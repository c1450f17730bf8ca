"""One-shot calls to a model's worker (tokenize, detokenize, apply-template, slot actions):
the serving layer's door for requests that take no job slot.

The model is kept from being idle while the call waits for its load or its answer
(``ModelSlot.holding``), so placement never evicts it for a later request.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from protocol import Error, Message, ProtocolError, encode
from protocol.errors import ErrorCode
from router.http.errors import BadGateway, BadRequest, from_worker_error, unsendable
from router.http.sse import until_disconnect
from router.workers.pool import ModelSlot
from router.workers.connection import WorkerUnreachable

#: How long a tokenize / detokenize / apply-template call may take, s. Liveness is the ping
#: loop's (router.workers.liveness: a silent worker is unresponsive, then killed, and the call ends with
#: it); this bounds only a live worker that never answers the call. Three 7 MB /tokenize
#: calls queue on the worker's text thread: the last waits for the two before it.
CALL_TIMEOUT_S = 600.0


async def model_ready(slot: ModelSlot) -> None:
    """Wait until the model serves, loading it: with replicas, until one is ready, every replica
    started (``router.workers.replicas``); else until its worker is. Raises what the load failed
    with (ApiError)."""
    replicas = slot.replica_set()
    if replicas is not None:
        if replicas.ready():
            return
        replicas.start_others(slot)
    await slot.ready_worker()


async def call_worker(request: Request, slot: ModelSlot, make: Any, timeout_s: float = CALL_TIMEOUT_S,
                param: str | None = None) -> Message:
    """Send a one-shot request (``make(id)``: tokenize, detokenize, apply-template, a slot action)
    to the model's worker, loading it if needed; its answer, or the mapped ApiError.
    A request the protocol cannot carry is a 400 (checked before the model is loaded). ``param``:
    the request field a worker's 400 that names none is about (``tokens`` for an id outside the
    vocabulary), as the generation routes name ``prompt`` / ``messages``."""
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
