"""Anthropic's answer (``POST /v1/messages``; router.dialects.anthropic_api reads the request):
the ``message`` object, and the stream's named events in Anthropic's order — ``message_start``,
``content_block_start``, ``ping``, ``content_block_delta`` (``text_delta`` / ``input_json_delta``),
``content_block_stop``, ``message_delta`` (``stop_reason``, usage), ``message_stop``; a failure
after the first byte is an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from protocol import Accepted, Done, Token
from router.dialects.call_parser import CallParser
from router.dialects.tools import ToolCall
from router.http.errors import ApiError, anthropic_error_payload
from router.http.sse import sse_named

#: Anthropic's keep-alive event (its streams carry ``ping`` events).
PING = sse_named("ping", {"type": "ping"})


def stop_reason(done: Done, calls: list[ToolCall]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``: ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the
    word) or ``end_turn``."""
    if calls and done.finish_reason == "stop":
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.stop_type == "word":
        return "stop_sequence", done.stopping_word
    return "end_turn", None


def usage(done: Done) -> dict[str, Any]:
    """``usage``: ``input_tokens`` the prompt tokens evaluated, ``cache_read_input_tokens`` those
    reused from the KV cache, ``output_tokens``."""
    return {"input_tokens": done.prompt_tokens - done.cache_n, "output_tokens": done.completion_tokens,
            "cache_read_input_tokens": done.cache_n, "cache_creation_input_tokens": 0}


def _start_usage(first: Token | Done | Accepted) -> dict[str, Any]:
    """``message_start``'s usage, as Anthropic sends it: the prompt's counts (the worker's
    Accepted or the first Token carries them — how much of the prompt the KV cache holds is
    known only later: ``message_delta``'s usage has it; a Done, when nothing was generated)
    and 1 output token."""
    if isinstance(first, Accepted):
        return {"input_tokens": first.prompt_tokens, "output_tokens": 1, "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0}
    if isinstance(first, Done):
        return {**usage(first), "output_tokens": first.completion_tokens}
    return {"input_tokens": first.prompt_tokens - first.cache_n, "output_tokens": 1,
            "cache_read_input_tokens": first.cache_n, "cache_creation_input_tokens": 0}


def message(mid: str, model: str, content: str | None, calls: list[ToolCall], done: Done) -> dict[str, Any]:
    """The whole answer (no stream): ``content`` as a text block, else the calls as ``tool_use``
    blocks (an empty text block when there is neither)."""
    blocks = ([{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in calls]
              if content is None else [{"type": "text", "text": content}])
    if not blocks:
        blocks = [{"type": "text", "text": ""}]
    reason, seq = stop_reason(done, calls)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(done)}


def error_event(err: ApiError) -> bytes:
    """A failure after the first byte: an ``error`` event."""
    return sse_named("error", anthropic_error_payload(err))


class MessageStream:
    """The events of one streamed message, as ``router.serving.generation.stream`` asks for
    them: :meth:`on_open` (the worker accepted the prompt), :meth:`on_frame` (each Token, then
    the Done); :data:`PING` keeps it alive, :func:`error_event` ends a failed one."""

    def __init__(self, mid: str, model: str, parser: CallParser) -> None:
        self.mid = mid
        self.model = model
        self.parser = parser
        self.started = False
        self.block = -1  # the index of the last content block opened
        self.text_open = False
        self.pinged = False
        self.events: list[bytes] = []

    def _open_block(self, block: dict[str, Any]) -> None:
        self.block += 1
        self.events.append(sse_named("content_block_start", {"type": "content_block_start",
                                                             "index": self.block, "content_block": block}))
        if not self.pinged:
            self.pinged = True
            self.events.append(PING)

    def _close_block(self) -> None:
        self.events.append(sse_named("content_block_stop", {"type": "content_block_stop", "index": self.block}))

    def _emit(self, text: str, calls: list[ToolCall]) -> None:
        if text:
            if not self.text_open:
                self.text_open = True
                self._open_block({"type": "text", "text": ""})
            self.events.append(sse_named("content_block_delta", {
                "type": "content_block_delta", "index": self.block,
                "delta": {"type": "text_delta", "text": text}}))
        for c in calls:
            self._open_block({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            self.events.append(sse_named("content_block_delta", {
                "type": "content_block_delta", "index": self.block,
                "delta": {"type": "input_json_delta", "partial_json": c.arguments}}))
            self._close_block()

    def _start(self, item: Token | Done | Accepted) -> None:
        if not self.started:
            self.started = True
            self.events.append(sse_named("message_start", {"type": "message_start", "message": {
                "id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": _start_usage(item)}}))
            if not self.parser.mode == "undecided":  # plain text: the block opens at once, as Anthropic's
                self.text_open = True
                self._open_block({"type": "text", "text": ""})
            elif not self.pinged:
                self.pinged = True
                self.events.append(PING)

    def on_open(self, accepted: Accepted) -> list[bytes]:
        self.events.clear()
        self._start(accepted)  # message_start at once: the prompt's prefill has not begun yet
        return list(self.events)

    async def on_frame(self, item: Token | Done) -> list[bytes]:
        self.events.clear()
        self._start(item)
        self._emit(*self.parser.feed(item.text))
        if isinstance(item, Token):
            return list(self.events)
        self._emit(*self.parser.finish())
        if self.block < 0:
            self.text_open = True
            self._open_block({"type": "text", "text": ""})
        if self.text_open:
            self._close_block()
        reason, seq = stop_reason(item, self.parser.calls)
        self.events.append(sse_named("message_delta", {"type": "message_delta",
                                                       "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                       "usage": usage(item)}))
        self.events.append(sse_named("message_stop", {"type": "message_stop"}))
        return list(self.events)
