"""A prompt's prefill progress, for a Generate with ``return_progress`` (llama-server's
``prompt_progress``): the PromptProgress frames of one job, on the engine thread.

The engine prefills a prompt in chunks, one per step (``worker.engine.scheduler``: up to
``n_batch`` prompt tokens a forward pass, fewer beside decoding sequences). After each step the
runner reads, from the slots it publishes anyway (``engine.slots()``: the sequence running in
each slot and the tokens its KV holds), how far each reporting job's prompt is: as llama-server
reports after each batch, one frame per chunk. The first report is the prefill's start
(``processed == cache``, ``time_ms`` 0: known once the sequence got its slot and its prefix from
the cache); the last (``processed == total``) is sent just before the first Token, from the
step that finished the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from protocol import PromptProgress

__all__ = ["PrefillProgress"]


class PrefillProgress:
    """The progress reports of one job's prompt (its choice 0's sequence ``seq_id``).

    ``post`` sends a frame; ``total``: the prompt's tokens; ``cache_n()``: the tokens the engine
    reused from its prefix cache (known once the sequence has its slot). Created as the sequence is
    added to the engine (``time_ms`` counts from then); engine thread only."""

    def __init__(self, job_id: str, seq_id: str, total: int, cache_n: Callable[[], int],
                 post: Callable[[PromptProgress], None]) -> None:
        self.job_id, self.seq_id, self.total = job_id, seq_id, total
        self._cache_n, self._post = cache_n, post
        self._t0 = time.perf_counter()
        self._cache = -1  # -1: the start not reported yet
        self._processed = -1
        self.finished = False

    def after_step(self, slots: Sequence[Any]) -> None:
        """Report the prompt's tokens in the KV after a step (``slots``: the runner's snapshot of
        ``engine.slots()``, Pong's maps ``{"id_task", "n_past", ...}``), if it moved; nothing once
        the prompt is done or before it has a slot."""
        if self.finished:
            return
        n_past = next((int(s["n_past"]) for s in slots if s["id_task"] == self.seq_id), None)
        if n_past is None:
            return  # not in a slot yet (waiting for one, or for KV)
        self._start()
        if n_past < self.total:
            self._send(n_past)

    def prompt_done(self) -> None:
        """The prompt is in the KV (its first token was sampled): the last report, once."""
        if self.finished:
            return
        self._start()
        self._send(self.total)
        self.finished = True

    def _start(self) -> None:
        if self._cache < 0:
            self._cache = max(0, min(int(self._cache_n()), self.total))
            self._processed = self._cache
            self._post(PromptProgress(id=self.job_id, total=self.total, cache=self._cache,
                                      processed=self._cache, time_ms=0.0))

    def _send(self, processed: int) -> None:
        if processed <= self._processed:
            return  # no news (the start may have said it all)
        self._processed = processed
        self._post(PromptProgress(id=self.job_id, total=self.total, cache=self._cache, processed=processed,
                                  time_ms=(time.perf_counter() - self._t0) * 1e3))
