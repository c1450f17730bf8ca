"""The worker's *text* thread: Tokenize, Detokenize and ApplyTemplate answered off the socket
thread and off the engine thread, in submission order.

So three 7 MB ``/tokenize`` calls never hold up a Generate's preparation (nor, the tokenizer
releasing the GIL on long texts, the socket thread's Pongs and Token relaying). Each answer (the
result, or an Error) goes out as a :class:`~worker.events.FrameOut` through ``post``.
"""

from __future__ import annotations

import ctypes
import logging
import traceback
from collections.abc import Callable
from typing import Any

from protocol import (
    ApplyTemplate,
    ApplyTemplateResult,
    Detokenize,
    DetokenizeResult,
    Message,
    Tokenize,
    TokenizeResult,
)
from worker.engine import EngineError
from worker.events import FrameOut, RunnerEvent
from worker.frames import error_frame, internal_error
from worker.inbox import InboxThread

__all__ = ["LARGE_TEXT_CHARS", "TextOps", "give_back_memory"]

log = logging.getLogger("modelyard.worker")

TextOp = Tokenize | Detokenize | ApplyTemplate

#: A Tokenize text at least this long (chars) gives its memory back once answered.
LARGE_TEXT_CHARS = 1 << 20


class TextOps(InboxThread[TextOp]):
    """The text thread of one loaded engine. ``submit(msg)`` (after :meth:`start`): answer ``msg``
    (a FrameOut with its result or Error), after the ones submitted before; ``stop`` ends it."""

    def __init__(self, post: Callable[[RunnerEvent], None]) -> None:
        super().__init__("text")
        self._post = post

    def _handle(self, msg: TextOp) -> None:
        answer = self._answer(msg)
        large = isinstance(msg, Tokenize) and len(msg.content) >= LARGE_TEXT_CHARS
        self._post(FrameOut(answer))
        del answer
        if large:
            give_back_memory()

    def _answer(self, msg: TextOp) -> Message:
        eng = self._engine
        try:
            if isinstance(msg, Tokenize):
                ids = eng.tokenize(msg.content, add_special=msg.add_special, parse_special=msg.parse_special)
                pieces = [bytes(eng.token_bytes(t)) for t in ids] if msg.with_pieces else None
                return TokenizeResult.of(msg.id, ids, pieces)  # ids packed as int32: one C-level pass
            if isinstance(msg, Detokenize):
                return DetokenizeResult(id=msg.id, content=str(eng.detokenize(msg.tokens.tolist())))
            return ApplyTemplateResult(id=msg.id, prompt=str(eng.apply_template(
                msg.messages, add_generation_prompt=msg.add_generation_prompt, tools=msg.tools,
                template_kwargs=msg.template_kwargs, chat_template=msg.chat_template)))
        except EngineError as e:
            return error_frame(msg.id, e)
        except Exception as e:  # noqa: BLE001 - a request never kills the worker
            log.error("%s %s failed:\n%s", msg.TYPE, msg.id, traceback.format_exc())
            return internal_error(msg.id, e)


def give_back_memory() -> None:
    """Return freed heap to the OS (glibc ``malloc_trim``): a 7 MB text leaves ~800 MB of
    freed tokenizer buffers in malloc's arenas, which RSS would otherwise keep showing."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None)
    return _LIBC
