"""Background tasks the router starts and does not await (fire-and-forget sends, reaping a
cancelled run): :func:`spawn` keeps a reference until each ends, so none is collected
half-way (asyncio holds only weak references to tasks)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

_background: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Run ``coro`` in the background, keeping a reference until it ends."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task
