"""What OpenAI's chat and text completion routes write alike: the envelope of every object and
chunk, the ``n`` choices' finals, the end of a stream (timings, the usage chunk, ``[DONE]``),
``stream_options.include_usage`` and the ``system_fingerprint``."""

from __future__ import annotations

from typing import Any

from protocol import Done, Ready
from router.http.errors import BadRequest
from router.http.params import get_bool
from router.http.sse import sse_event
from router.serving.generation import timings_of, usage_of


def wants_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage`` of a streaming request. Without ``stream`` the
    field is ignored, as llama.cpp does (OpenAI refuses it; litellm and pr-agent send it)."""
    opts = body.get("stream_options")
    if opts is None or not get_bool(body, "stream", False):
        return False
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return get_bool(opts, "include_usage", False)


def usage_null(include_usage: bool) -> dict[str, Any]:
    """What every chunk before the final usage chunk carries: with
    ``stream_options.include_usage`` OpenAI sends ``"usage": null`` in each of them."""
    return {"usage": None} if include_usage else {}


def fingerprint(ready: Ready | None) -> str | None:
    """The ``system_fingerprint`` of the worker's model (its GGUF content hash)."""
    if ready is None:
        return None
    fp = ready.fingerprint  # "" while the worker is still hashing a file it never saw
    return f"fp_{fp[:12]}" if fp else None


def envelope(rid: str, obj: str, created: int, model: str, fp: str | None) -> dict[str, Any]:
    """The fields that open every completion object and chunk, in OpenAI's order."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp}


def choice_finals(done: Done, n: int) -> list[tuple[str, str]]:
    """``(held-back text, finish_reason)`` of each of the ``n`` choices, by index."""
    if n == 1 or not done.choices:
        return [(done.text, done.finish_reason)]
    by_index = {int(c["index"]): c for c in done.choices}
    return [(str(by_index[i].get("text", "")), str(by_index[i].get("finish_reason", done.finish_reason)))
            if i in by_index else ("", done.finish_reason) for i in range(n)]


def final_events(final: dict[str, Any], done: Done, head: dict[str, Any], include_usage: bool) -> list[bytes]:
    """The end of a stream: ``final`` (the last chunk) with llama.cpp ``timings``; with
    ``include_usage`` a chunk ``head`` + no choices + ``usage``; then ``[DONE]``."""
    final["timings"] = timings_of(done)
    out = [sse_event(final)]
    if include_usage:
        out.append(sse_event({**head, "choices": [], "usage": usage_of(done), "timings": timings_of(done)}))
    out.append(sse_event("[DONE]"))
    return out
