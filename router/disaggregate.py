"""Disaggregated prefill/decode: a model whose prompts another worker prefills.

A model with ``prefill_model = "P"`` (config) runs in three phases per request,
all inside :func:`router.generation.begin` so every dialect gets them:

1. **prefill** on P's worker: the same prompt (text, token ids or messages: P's
   worker renders and tokenizes it as the decode worker will) as a Generate of one
   greedy token, admitted on P's own queue, with ``save_slot_to``: as it ends, in
   the same engine step (no other sequence can take its entry over first), P's
   worker saves its KV entry to ``slot_save_path`` (``worker.engine.kv_state``
   format: identity, checksums; written atomically) and then sends its Done.
2. **transfer**: the decode worker restores that file into its prefix cache (``id_slot`` -1), which
   checks the identity in full before a byte reaches its KV; the file is removed.
3. **decode**: the request runs on this model's worker as usual; its prompt
   extends the restored tokens, so only the last prompt token is evaluated there
   (``cache_n`` = prompt - 1) and its running streams never wait for a long
   prefill chunk.

The transfer goes through a file both workers see, not through the router: the
state is tens of MB for a few thousand tokens; a local file moves it through the
page cache once, with no frame-size chunking, no copy through the router's event
loop (which also serves every other stream) and no numpy in the router, and it
reuses the slot-action path with its identity checks. Correctness never rests on
the hand-over: the decode worker reuses only a verified common prefix, so a
missing or shorter state costs prefill time, never a wrong token.

Cancel: a client leaving in phase 1 cancels P's generation (``Run.close``); in
phase 2 the slot actions in flight finish (each is one file write / read) and
nothing more is started; in phase 3 it is the usual cancel. A failure in any
phase is the request's error (before any byte is sent to the client).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from starlette.requests import Request

from protocol import Done, Error, Generate, Message, SlotAction, SlotActionResult, Token
from protocol.errors import ErrorCode
from router.errors import ApiError, BadGateway, Unavailable, from_worker_error
from router.pool import ModelSlot
from router.process import WorkerProcess, WorkerUnreachable
from router.run import Run

log = logging.getLogger("modelyard.disaggregate")

#: Longest a save or restore of the hand-over may take (s).
TRANSFER_TIMEOUT_S = 120.0


def prefill_slot(request: Request, slot: ModelSlot) -> ModelSlot | None:
    """The slot of ``slot``'s prefill model, or None when it is not split."""
    name = slot.model.prefill_model
    if name is None:
        return None
    return request.app.state.pool.get(name)


async def prefill_and_hand_over(pre: ModelSlot, slot: ModelSlot, msg: Generate,
                                timings: dict[str, Any] | None = None) -> None:
    """Phases 1 and 2 for ``msg`` (then the caller runs it on ``slot``). ``timings`` (if
    given) gets ``prefill_ms``, ``save_ms``, ``restore_ms``, ``n_transferred``, ``bytes``.

    Raises the ApiError of a failed phase (the worker's own error, mapped; BadGateway when a
    worker is unreachable or silent); a cancel (CancelledError) stops at once.
    """
    t0 = time.monotonic()
    filename = f"xfer-{msg.id}.kvstate"
    assert pre.model.slot_save_path is not None
    path = pre.model.slot_save_path / filename
    pmsg = dataclasses.replace(msg, id=f"{msg.id}-prefill", max_tokens=1, n=1, temperature=0.0, n_probs=0,
                               json_schema=None, grammar=None, stop=[], logit_bias=[], ignore_eos=False,
                               save_slot_to=filename)
    try:
        run = Run(pre, pmsg.id)
        try:
            await run.start(pmsg)
            item: Token | Done = await run.next()
            while isinstance(item, Token):
                item = await run.next()
            done = item  # sent once the state file is written (Generate.save_slot_to)
        finally:
            run.close()
        if done.finish_reason == "cancelled":
            raise Unavailable("the prefill was cancelled by the server (model unloading or shutting down)",
                              code="cancelled")
        t1 = t2 = time.monotonic()
        n_bytes = path.stat().st_size if path.exists() else 0
        worker = await slot.ready_worker()
        restored = await _act(worker, slot, SlotAction(id="x", action="restore", id_slot=-1, filename=filename))
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    t3 = time.monotonic()
    log.info("request %s: prefilled and saved %d tokens (%d bytes) on %s in %.0f ms; restored in %.0f ms",
             msg.id, restored.n_tokens, n_bytes, pre.model.name, (t1 - t0) * 1e3, (t3 - t2) * 1e3)
    if timings is not None:
        timings.update(prefill_ms=(t1 - t0) * 1e3, restore_ms=(t3 - t2) * 1e3, n_transferred=restored.n_tokens,
                       bytes=n_bytes)


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
