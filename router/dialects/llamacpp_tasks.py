"""Several prompts of one /completion request run at once, as llama-server runs the tasks of one
request: their results gathered in order (:func:`gather`), or their streams interleaved as they
come (:func:`merge`), the first failure ending them all; runs begun for nothing are closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from protocol import Accepted, Done, Token
from router.serving.server import Generation

T = TypeVar("T")


def drop(starts: Sequence[asyncio.Future[tuple[Generation, Token | Done | Accepted]]]) -> None:
    """Cancel the ``begin`` calls still waiting; close the runs of those done."""
    for t in starts:
        if not t.done():
            t.cancel()
        elif not t.cancelled() and t.exception() is None:
            t.result()[0].close()


async def gather(coros: list[Coroutine[Any, Any, T]], discard: Callable[[T], None] | None = None) -> list[T]:
    """Run ``coros`` at once; their results in order. The first to fail (the lowest index of those
    failed by then) cancels the others and is raised; the results of those that had finished
    are given to ``discard`` (runs begun for nothing are closed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # this handler cancelled (client gone, shutdown): nothing is left running
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if discard is not None and not t.cancelled() and t.exception() is None:
                discard(t.result())
        raise
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if not failed:
        return [t.result() for t in tasks]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if discard is not None:
        for t in tasks:
            if not t.cancelled() and t.exception() is None:
                discard(t.result())
    exc = failed[0].exception()
    assert exc is not None
    raise exc


async def merge(streams: list[AsyncIterator[bytes]], stop: Callable[[], bool]) -> AsyncIterator[bytes]:
    """The events of ``streams`` interleaved as they come, until every one has ended or ``stop()``
    turns true after an event. Each stream is read only while fewer than ``len(streams)`` events
    wait to be sent: a reader that takes nothing holds them all back (router.http.sse's pacing)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=len(streams))

    async def pump(events: AsyncIterator[bytes]) -> None:
        async for ev in events:
            await queue.put(ev)
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        ended = 0
        while ended < len(tasks):
            ev = await queue.get()
            if ev is None:
                ended += 1
                continue
            yield ev
            if stop():
                return
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:  # a stream whose pump waited to put an event: its generator is suspended
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
