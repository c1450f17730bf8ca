"""The CPU share: how many BLAS threads each model's worker uses when its config names none.

The cores not taken by busy models with their own ``n_threads`` are divided among the busy
ones without (at least 1 each). One busy model gets them all; two on 2 cores get one each
(OpenBLAS's one-per-core threads fighting over the cores made two busy models slower
together than one alone). Idle ones get the share too, ready for their turn. The pool
decides (:func:`share`, whenever a model starts or stops being busy); each slot's
:class:`ThreadShare` sends its worker the number once per change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from protocol import Ping

if TYPE_CHECKING:
    from router.workers.process import WorkerProcess
    from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.pool")


def share(slots: Iterable[ModelSlot], cores: int) -> int:
    """The BLAS threads each sharing worker gets now (see the module docstring)."""
    busy = [s for s in slots if s.busy]
    fixed = sum(s.model.n_threads or 0 for s in busy)
    sharing = sum(1 for s in busy if s.model.n_threads is None)
    return max(1, (cores - fixed) // max(1, sharing))


class ThreadShare:
    """The BLAS threads last sent to one model's worker."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._sent: tuple[WorkerProcess, int] | None = None

    def send(self, wp: WorkerProcess, n: int) -> None:
        """``wp`` uses ``n`` BLAS threads from now on (a Ping carrying them; once per change)."""
        if self._sent == (wp, n):
            return
        self._sent = (wp, n)
        log.info("model %s: %d BLAS thread(s) (share of the cores)", self._model_name, n)
        wp.send_nowait(Ping(id=wp.new_call_id("threads"), threads=n))

    def of(self, wp: WorkerProcess | None) -> int | None:
        """The share last sent to ``wp`` (None: none, or it went to another worker)."""
        return self._sent[1] if self._sent is not None and self._sent[0] is wp else None
