"""Counting a prompt's tokens whatever the model's context (``count_tokens``, issue 23).

``POST /v1/messages/count_tokens`` counts by running the prompt as a generation of 0
tokens (exact, and it warms the prefix cache). A prompt beyond the model's context
(500 tools, a long conversation Claude Code wants to measure before compacting) was a
400 ``context_length_exceeded`` there — the context is a limit of *generating*, not of
counting. A count is bounded by what the router lets in at all, the request body
limit (``router.http.params.MAX_BODY_BYTES``), like ``/tokenize``. So when the generation
path refuses the prompt for its length, :func:`count_beyond_context` answers the count:
the worker's own figure when its refusal carries one (it tokenized the prompt), else the
prompt rendered and tokenized on the worker's text thread (``router.serving.calls.prompt_ids``).
"""

from __future__ import annotations

from starlette.requests import Request

from protocol import Generate
from router.http.errors import ApiError, ContextLengthExceeded
from router.serving.calls import call_worker, prompt_ids
from router.serving.models import ServedModel


async def count_prompt_tokens(request: Request, slot: ServedModel, msg: Generate) -> int:
    """The prompt tokens of ``msg`` (messages rendered with the model's template, or its
    prompt), counted on the worker's text thread; any length the body limit admits."""
    ids = await prompt_ids(msg, lambda make: call_worker(request, slot, make, param="messages"))
    return ids.count  # TokenIds: len() is its byte length


def refused_for_length(e: ApiError) -> bool:
    """Whether the generation path refused a prompt for its length (context or KV budget)."""
    return isinstance(e, ContextLengthExceeded) or e.code in ("context_length_exceeded", "kv_budget_exceeded")


async def count_beyond_context(request: Request, slot: ServedModel, msg: Generate, e: ApiError) -> int:
    """The count of a prompt the generation path refused for its length (``e``): the
    worker's figure when its refusal gave one, else :func:`count_prompt_tokens`."""
    n = getattr(e, "n_prompt_tokens", 0)
    return n if n > 0 else await count_prompt_tokens(request, slot, msg)
