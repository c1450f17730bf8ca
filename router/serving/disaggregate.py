"""Disaggregated prefill/decode: a model whose prompts another worker prefills.

A model with ``prefill_model = "P"`` (config) runs in three phases per request,
all inside :func:`router.serving.generation.begin` so every dialect gets them:

1. **prefill** on P's worker: the same prompt (text, token ids or messages: P's
   worker renders and tokenizes it as the decode worker will) as a Generate of one
   greedy token, admitted on P's own queue. As it ends, in the same engine step (no
   other sequence can take its entry over first), P's worker takes a copy of its KV
   entry (``worker.engine.kv.state`` format: identity, checksums).
2. **transfer** of that state to this model's (the decode) worker, which checks the
   identity in full before a byte reaches its KV and installs it in its prefix
   cache only once the whole state is validated. Two ways (``kv_transfer``):

   * ``"wire"`` (the default): ``Generate.stream_state``; P's worker streams the state
     as KVChunk frames (``protocol.KV_CHUNK_BYTES`` each, far within the frame limit)
     before its Done, and this module relays the *bytes* to the decode worker under a
     transfer id, without decoding them (no numpy here). Flow control end to end: P
     may run ``protocol.KV_WINDOW`` chunks ahead of the decode worker's last KVAck,
     which is relayed to P as its credit, so the router never holds more than a window
     of one transfer, and it yields to the event loop after every chunk, so the other
     streams it serves are not stalled. The decode worker validates chunk by chunk
     (``worker.kvstream``) and answers a SlotActionResult once the state is installed.
     Chosen as the default because it needs nothing shared between the workers but
     their router connections, so it works for workers on other hosts too; its price
     is one copy of the state through the router (tens of MB for a few thousand tokens).
   * ``"file"``: ``Generate.save_slot_to``; P's worker writes the state to
     ``slot_save_path`` before its Done, the decode worker restores that file (a slot
     action with ``id_slot`` -1) and the file is removed. Needs a directory both
     workers see (same host); moves the state once through the page cache.
3. **decode**: the request runs on this model's worker as usual; its prompt
   extends the installed tokens, so only the last prompt token is evaluated there
   (``cache_n`` = prompt - 1) and its running streams never wait for a long
   prefill chunk.

Correctness never rests on the hand-over: the decode worker reuses only a verified
common prefix, so a missing or shorter state costs prefill time, never a wrong token.

Cancel: a client leaving in phase 1 cancels P's generation (``Generation.close``; the
engine abandons the forward pass running now); during a wire transfer it cancels P's
stream and sends Cancel with the transfer id to the decode worker, which drops the
partial state (nothing was installed); during a file transfer the slot actions in
flight finish (each is one file write / read) and nothing more is started; in phase 3
it is the usual cancel. A failure in any phase (a worker's Error — e.g. the decode
worker refusing the state, naming the field —, a worker dying, a silent worker) is
the request's error before any byte is sent to the client, and leaves no half-loaded slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from starlette.requests import Request

from protocol import (
    KV_STREAM_IDLE_S,
    KV_WINDOW,
    Accepted,
    Done,
    Error,
    Generate,
    KVAck,
    KVChunk,
    Message,
    SlotAction,
    SlotActionResult,
    Token,
)
from protocol.errors import ErrorCode
from router.http.errors import ApiError, BadGateway, Unavailable, from_worker_error
from router.workers.pool import ModelSlot, Pool
from router.workers.connection import WorkerGone, WorkerUnreachable
from router.workers.process import WorkerProcess
from router.serving.server import submit

log = logging.getLogger("modelyard.disaggregate")

#: Longest a save or restore of the hand-over may take (s).
TRANSFER_TIMEOUT_S = 120.0


def prefill_slot(request: Request, slot: ModelSlot) -> ModelSlot | None:
    """The slot of ``slot``'s prefill model, or None when it is not split."""
    name = slot.model.prefill_model
    if name is None:
        return None
    pool: Pool = request.app.state.pool
    return pool.get(name)


async def prefill_and_hand_over(pre: ModelSlot, slot: ModelSlot, msg: Generate,
                                timings: dict[str, Any] | None = None) -> None:
    """Phases 1 and 2 for ``msg`` (then the caller runs it on ``slot``), by ``slot``'s
    ``kv_transfer``. ``timings`` (if given) gets ``prefill_ms`` (until the state starts
    moving), ``transfer_ms``, ``n_transferred`` (tokens), ``bytes`` and ``transfer``.

    Raises the ApiError of a failed phase (the worker's own error, mapped; BadGateway when a
    worker is unreachable or silent); a cancel (CancelledError) stops at once.
    """
    pmsg = dataclasses.replace(msg, id=f"{msg.id}-prefill", max_tokens=1, n=1, temperature=0.0, n_probs=0,
                               json_schema=None, grammar=None, stop=[], logit_bias=[], ignore_eos=False)
    if slot.model.kv_transfer == "file":
        out = await _by_file(pre, slot, pmsg)
    else:
        out = await _by_wire(pre, slot, pmsg)
    log.info("request %s: prefilled on %s in %.0f ms; %d tokens (%d bytes) handed over by %s in %.0f ms", msg.id,
             pre.model.name, out["prefill_ms"], out["n_transferred"], out["bytes"], out["transfer"],
             out["transfer_ms"])
    if timings is not None:
        timings.update(out)


async def _prefill_done(done: Done) -> None:
    if done.finish_reason == "cancelled":
        raise Unavailable("the prefill was cancelled by the server (model unloading or shutting down)",
                          code="cancelled")


async def _by_wire(pre: ModelSlot, slot: ModelSlot, pmsg: Generate) -> dict[str, Any]:
    """P streams its state (KVChunk), relayed chunk by chunk to the decode worker (see above)."""
    t0 = time.monotonic()
    t1 = t0
    pmsg = dataclasses.replace(pmsg, stream_state=True)
    run = submit(pre, pmsg.id)
    dworker: WorkerProcess | None = None
    xid = ""
    qd: asyncio.Queue[Any] | None = None
    installed = False
    n_recv, acked, n_bytes = 0, -1, 0  # chunks relayed, highest seq the decode worker took, bytes
    p_done: Done | None = None
    result: SlotActionResult | None = None

    async def from_decoder(item: Any) -> None:
        nonlocal acked, result
        if isinstance(item, KVAck):
            acked = max(acked, item.seq)
            if p_done is None:  # P's credit: it may run KV_WINDOW ahead of this
                try:
                    await run.ack_state(item.seq)
                except WorkerUnreachable:
                    pass  # P is gone: its stream says so
        elif isinstance(item, SlotActionResult):
            result = item
        elif isinstance(item, WorkerGone):
            raise BadGateway(f"model '{slot.model.name}' worker failed during the KV hand-over: {item.reason}",
                             code="worker_crashed")
        elif isinstance(item, Error):
            raise from_worker_error(item.code, f"KV hand-over to '{slot.model.name}': {item.message}")

    try:
        await run.start(pmsg)
        while p_done is None or result is None:
            while qd is not None and not qd.empty():  # the decode worker's answers so far
                await from_decoder(qd.get_nowait())
            if p_done is not None and result is not None:
                break
            if p_done is None and n_recv - (acked + 1) < KV_WINDOW:  # P has credit: its next frame
                item = await run.next()
                if isinstance(item, Done):
                    await _prefill_done(item)
                    p_done = item
                    if qd is None:
                        raise BadGateway(f"model '{pre.model.name}' worker ended its prefill without a KV state")
                elif isinstance(item, KVChunk):
                    if item.seq != n_recv:
                        raise BadGateway(f"model '{pre.model.name}' worker sent KV chunk {item.seq}, "
                                         f"expected {n_recv}")
                    if dworker is None:  # the first chunk: the prefill is over
                        t1 = time.monotonic()
                        dworker = await slot.ready_worker()
                        xid = dworker.new_call_id("xfer")
                        qd = dworker.open_stream(xid)
                    try:
                        await dworker.send(KVChunk(id=xid, seq=item.seq, data=item.data, last=item.last))
                    except WorkerUnreachable as e:
                        raise BadGateway(f"model '{slot.model.name}' worker is unreachable: {e}",
                                         code="worker_crashed") from None
                    n_recv += 1
                    n_bytes += len(item.data)
                    await asyncio.sleep(0)  # one chunk at a time: the other streams go on between them
                continue  # (a Token: the one prefill token, not needed)
            if qd is None:
                raise BadGateway(f"model '{pre.model.name}' worker ended its prefill without a KV state")
            try:  # P is out of credit (or done): the decode worker's next answer
                await from_decoder(await asyncio.wait_for(qd.get(), KV_STREAM_IDLE_S))
            except asyncio.TimeoutError:
                raise BadGateway(f"model '{slot.model.name}' worker did not take the KV state within "
                                 f"{KV_STREAM_IDLE_S:g} s", code="worker_timeout") from None
        installed = True
    finally:
        run.close()  # a no-op once its Done came; else P's stream is cancelled
        if dworker is not None:
            dworker.close_stream(xid)
            if not installed:
                dworker.cancel(xid)  # the decode worker drops the partial state
    t2 = time.monotonic()
    return {"prefill_ms": (t1 - t0) * 1e3, "transfer_ms": (t2 - t1) * 1e3, "n_transferred": result.n_tokens,
            "bytes": n_bytes, "transfer": "wire"}


async def _by_file(pre: ModelSlot, slot: ModelSlot, pmsg: Generate) -> dict[str, Any]:
    """P writes its state to the shared slot_save_path; the decode worker restores that file."""
    t0 = time.monotonic()
    filename = f"xfer-{pmsg.id}.kvstate"
    assert pre.model.slot_save_path is not None
    path = pre.model.slot_save_path / filename
    pmsg = dataclasses.replace(pmsg, save_slot_to=filename)
    try:
        run = submit(pre, pmsg.id)
        try:
            await run.start(pmsg)
            item = await run.next()
            while not isinstance(item, Done):
                item = await run.next()
            done = item  # sent once the state file is written (Generate.save_slot_to)
        finally:
            run.close()
        await _prefill_done(done)
        t1 = time.monotonic()
        n_bytes = path.stat().st_size if path.exists() else 0
        worker = await slot.ready_worker()
        restored = await _act(worker, slot, SlotAction(id="x", action="restore", id_slot=-1, filename=filename))
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    t2 = time.monotonic()
    return {"prefill_ms": (t1 - t0) * 1e3, "transfer_ms": (t2 - t1) * 1e3, "n_transferred": restored.n_tokens,
            "bytes": n_bytes, "transfer": "file"}


async def _act(worker: WorkerProcess, slot: ModelSlot, action: SlotAction) -> SlotActionResult:
    msg = dataclasses.replace(action, id=worker.new_call_id("xfer"))
    try:
        ans: Message = await worker.call(msg, TRANSFER_TIMEOUT_S)
    except WorkerUnreachable as e:
        raise BadGateway(f"model '{slot.model.name}' worker is unreachable: {e}", code="worker_crashed") from None
    except asyncio.TimeoutError:
        raise BadGateway(f"model '{slot.model.name}' worker did not {action.action} the KV state within "
                         f"{TRANSFER_TIMEOUT_S:g} s", code="worker_timeout") from None
    if isinstance(ans, Error):
        if ans.code == ErrorCode.WORKER_GONE:
            raise BadGateway(f"model '{slot.model.name}' worker failed: {ans.message}", code="worker_crashed")
        err: ApiError = from_worker_error(ans.code, f"KV hand-over ({action.action} on '{slot.model.name}'): "
                                          f"{ans.message}")
        raise err
    if not isinstance(ans, SlotActionResult):
        raise BadGateway(f"unexpected {ans.TYPE} answer to a KV {action.action}")
    return ans
