"""One request's total work, bounded before it reaches a worker (issue 23).

A generation request asks for ``n`` choices of at most ``max_tokens`` tokens each, and the
worker holds every choice (its copy of the prompt and its answer) in a KV sequence of its
own. Without a bound, ``n: 16, max_tokens: 8192`` took every slot of a model. So, before
the request is admitted (:func:`check_request_budget`, called by ``router.serving.generation.begin``
for every dialect, ``/v1/decode`` and background Responses included):

* the ceiling of one request is the model's ``max_request_tokens``, or when that is 0 its
  context (``n_ctx``: the worker's, once it has announced one, else the configured one) —
  one request never asks for more than one full context's worth — and never more than the
  worker's KV budget (``Ready.kv_budget_tokens``) when it is known;
* ``n`` > 1 with ``n`` x ``max_tokens`` beyond the ceiling: 400
  ``request_too_large_for_model`` naming ``n`` (the message gives the figures);
* ``n`` > 1 without ``max_tokens`` ("until the context is full"): each choice may use
  ``ceiling // n`` tokens (its ``max_tokens`` is set to that; the answer ends with
  finish_reason ``length``);
* ``n`` = 1: a ``max_tokens`` beyond an explicit ``max_request_tokens`` is clamped to it
  (as a ``max_tokens`` beyond the room the prompt leaves is, README); otherwise the
  worker's own rules apply unchanged (clamped to the room the prompt leaves, a 400
  ``kv_budget_exceeded`` beyond its KV budget).

The prompt is the worker's to count (the router does not tokenize): the worker refuses
a request whose ``n`` x (prompt + answer) cannot fit its KV budget
(``kv_budget_exceeded``, ``worker.runner``). Background work has its own bounds per model
and per key (``router.dialects.background``).
"""

from __future__ import annotations

import dataclasses

from protocol import Generate
from protocol.limits import DEFAULT_MAX_CTX
from router.http.errors import BadRequest
from router.gguf_meta import n_ctx_train
from router.serving.models import ServedModel


class RequestTooLarge(BadRequest, code="request_too_large_for_model"):
    """400: ``n`` x ``max_tokens`` beyond what one request may ask of this model."""


def request_ceiling(slot: ServedModel) -> tuple[int | None, str]:
    """``(tokens, what bounds it)`` one request of ``slot``'s model may ask for in all,
    or ``(None, ...)`` when nothing is known yet (no configured n_ctx, no worker)."""
    m = slot.model
    ready = slot.ready_info
    n_ctx = ready.n_ctx if ready is not None else m.n_ctx
    if m.max_request_tokens > 0:
        ceiling, why = m.max_request_tokens, f"max_request_tokens={m.max_request_tokens}"
    elif n_ctx:
        ceiling, why = n_ctx, f"max_request_tokens=0: the model's n_ctx, {n_ctx}"
    else:
        return None, "unknown"
    if ready is not None and 0 < ready.kv_budget_tokens < ceiling:
        ceiling, why = ready.kv_budget_tokens, f"the model's KV budget, {ready.kv_budget_tokens} tokens"
    return ceiling, why


def check_request_budget(slot: ServedModel, msg: Generate) -> Generate:
    """``msg`` within its model's request ceiling (see the module docstring). Raises
    RequestTooLarge (400, ``param`` ``n``)."""
    n = max(1, int(msg.n))
    if n == 1:  # the worker's own rules hold (room left by the prompt, KV budget); only an explicit ceiling clamps
        cap = slot.model.max_request_tokens
        if cap > 0 and msg.max_tokens is not None and msg.max_tokens > cap:
            return dataclasses.replace(msg, max_tokens=cap)
        return msg
    ceiling, why = request_ceiling(slot)
    if ceiling is None:
        return msg
    if msg.max_tokens is None:
        share = ceiling // n
        if share < 1:
            raise RequestTooLarge(f"n={n} choices cannot share this request's ceiling of {ceiling} tokens "
                                  f"({why}) for model '{slot.model.name}'", param="n")
        return dataclasses.replace(msg, max_tokens=share)
    total = n * msg.max_tokens
    if total > ceiling:
        raise RequestTooLarge(
            f"n x max_tokens = {n} x {msg.max_tokens} = {total} tokens is beyond what one request may ask of "
            f"model '{slot.model.name}': {ceiling} tokens ({why}; set max_request_tokens to allow more). "
            f"Ask for fewer choices or fewer tokens", param="n")
    return msg


def context_size(slot: ServedModel) -> tuple[int | None, int | None]:
    """``(n_ctx, n_ctx_train)`` of a model, without loading it: its worker's when ready, else
    the configured ``n_ctx`` or the worker's default (``min(n_ctx_train, DEFAULT_MAX_CTX)``),
    with ``n_ctx_train`` from the GGUF header (None when unreadable)."""
    m = slot.model
    ready = slot.ready_info
    train = ready.n_ctx_train if ready is not None else n_ctx_train(m.path)
    if ready is not None:
        return ready.n_ctx, train
    if m.n_ctx is not None:
        return m.n_ctx, train
    return (min(train, DEFAULT_MAX_CTX) if train else None), train
