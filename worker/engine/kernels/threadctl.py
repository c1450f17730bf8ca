"""The thread count of each forward pass on the quantized path, chosen at run time from measured
pass times, so that outside load does not make the threads slower than one.

The numba kernels split each matmul's rows statically over their threads and wait for all of
them at the end (an OpenMP barrier). On a quiet machine two threads halve a pass's time; when
other processes keep the cores busy, one of the threads is often descheduled while the other
waits for it at every barrier (hundreds per token), and two threads run far slower than one
(measured here with two CPU-bound processes beside SmolLM2: 9.2 tok/s against 53.0 with one
thread). A fixed count cannot be right for both, so :class:`ThreadGovernor` picks per pass:

* passes are grouped by their row count (``rows.bit_length()``: decode steps of one stream,
  of 2-3 streams, ..., prefill chunks), each group with its own choice, since a memory-bound
  decode and a compute-bound prefill gain differently from threads; a new group starts at the
  count the last switch of any group chose (before any: one thread when the 1-minute load
  average already exceeds the cores by the ceiling, else the ceiling);
* a group runs its current count and keeps its last :data:`WINDOW` pass times (seconds per row);
  a group of short passes (decode steps) probes right after its first one;
* from time to time it *probes* a neighbouring count (the next lower or higher one of 1, 2,
  4, ..., the ceiling) for up to :data:`PROBE_PASSES` passes and takes it when its best time is
  :data:`MARGIN` faster than the current count's best recent time; a probe that loses doubles
  the wait to the next one (from :data:`BASE_INTERVAL_S` to :data:`MAX_INTERVAL_S`), and a probe
  never costs more than :data:`PROBE_SHARE` of the time since the last one, judged by the
  probed count's last known time, or when the group never ran it, by the current count's time
  times how much slower that count was in the other groups (so a prefill pass of a second, or
  two threads that took 30x one thread's time under load, are probed rarely); a probe pass
  much slower than the current count (x :data:`ABORT_RATIO`) ends the probe at once;
* when every one of the current count's last :data:`WINDOW` passes is slower than another
  count's last known time by :data:`MARGIN`, it switches at once (load arrived): that count's
  next passes then refresh its time;
* when they are all faster than when the last probe started (by :data:`SLOWER_RATIO`: the machine
  got quieter), the group probes without waiting for its interval, a known probe cost being
  scaled by that speed-up (a 2x jitter of a busy machine then costs at most twice the share);
* when they are all slower than the best the current count did (x :data:`SLOWER_RATIO`), the
  group probes without waiting for its interval (within the share); when another group has just
  switched (then after one fresh pass at its count), it probes at once, interval and share
  aside, what it knew being stale (the machine changed; a long prefill pass under new load need
  not wait many seconds to learn it).

The ceiling is the share the worker was given (:func:`.quant.set_num_threads`, the router's
share or ``--threads``), or numba's thread count; the governor never uses more.
``MODELYARD_ADAPTIVE_THREADS=0`` turns it off (every pass at the ceiling). The kernels compute
the same bits whatever the thread count (each output row by one thread, in one order), so the
choice changes only time. Only time is measured here; nothing depends on it but the choice.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

#: environment switch: ``0`` runs every pass at the ceiling (no measuring, no probing)
ENV = "MODELYARD_ADAPTIVE_THREADS"
#: recent pass times kept per group (the current count's estimate is their minimum)
WINDOW = 3
#: passes a probe runs at most (its estimate: their minimum; the first pass after a change of
#: thread count also wakes the pool's threads)
PROBE_PASSES = 2
#: a count is taken when it is this much faster (relative) than the current one
MARGIN = 0.08
#: first wait between probes of a group, and its cap after losing probes (doubling), seconds
BASE_INTERVAL_S = 0.5
MAX_INTERVAL_S = 8.0
#: a probe may cost at most this share of the time since the group's last probe
PROBE_SHARE = 0.015
#: a probe pass slower than the current count's estimate times this ends the probe
ABORT_RATIO = 1.5
#: the current count's recent passes all this much slower than its best: probe at once
SLOWER_RATIO = 1.3
#: a group of passes of fewer rows (decode steps) probes right after its first pass: a busy
#: machine is found out after one slow step, not three
FIRST_PROBE_ROWS = 16


def enabled() -> bool:
    """False when :data:`ENV` turns the governor off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def busy_machine(ceiling: int) -> bool:
    """Whether the 1-minute load average already exceeds the cores by ``ceiling`` (other
    processes would take the threads' cores): the start before any pass was measured."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1) + max(1, ceiling)
    except OSError:
        return False


def candidates(ceiling: int) -> list[int]:
    """Thread counts tried under ``ceiling``: 1, 2, 4, ... below it, and the ceiling."""
    out, n = [], 1
    while n < ceiling:
        out.append(n)
        n *= 2
    out.append(max(1, ceiling))
    return out


class _Group:
    __slots__ = ("current", "recent", "known", "best", "ref", "interval", "last_probe", "probe_n", "probe_left",
                 "probe_best", "probe_up", "nudged")

    def __init__(self, current: int, now: float) -> None:
        self.current = current
        self.recent: deque[float] = deque(maxlen=WINDOW)   # seconds per row at ``current``
        self.known: dict[int, float] = {}                   # last estimate of every count measured
        self.best = float("inf")                            # best time at ``current`` since the last probe
        self.ref = float("inf")                             # its time when the last probe started
        self.nudged = False                                 # another group switched: probe soon
        self.interval = BASE_INTERVAL_S
        self.last_probe = now
        self.probe_n = 0                                    # the count being probed (0: none)
        self.probe_left = 0
        self.probe_best = float("inf")
        self.probe_up = False                               # direction of the next probe


class ThreadGovernor:
    """Chooses the thread count of each pass (see the module docstring). One per model; not
    thread-safe (a model runs one pass at a time).

    Use: ``n = g.choose(ceiling, rows)``, run the pass with ``n`` threads, then
    ``g.record(ceiling, rows, n, seconds)`` (skip it for a pass that did not complete).
    ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, adaptive: bool | None = None) -> None:
        self._clock = clock
        self.adaptive = enabled() if adaptive is None else adaptive
        self._ceiling = 0
        self._groups: dict[int, _Group] = {}
        self._hint = 0                                      # the count of the last switch (0: none yet)
        #: passes run per thread count, and switches made (for benchmarks and /admin views)
        self.passes: dict[int, int] = {}
        self.switches = 0

    def _group(self, ceiling: int, rows: int) -> _Group:
        if ceiling != self._ceiling:                        # a new share: start over at it
            self._ceiling = ceiling
            self._groups.clear()
            self._hint = 0
        key = max(1, int(rows)).bit_length()
        g = self._groups.get(key)
        if g is None:                                       # starts where the last decision went
            if not self._hint and busy_machine(ceiling):
                self._hint = 1
            g = self._groups[key] = _Group(min(self._hint or ceiling, ceiling), self._clock())
        return g

    def choose(self, ceiling: int, rows: int) -> int:
        """The thread count for a pass of ``rows`` rows (1 <= n <= ``ceiling``)."""
        ceiling = max(1, int(ceiling))
        if ceiling == 1 or not self.adaptive:
            return ceiling
        g = self._group(ceiling, rows)
        if g.probe_n:
            return g.probe_n
        if g.recent:
            rows = max(1, rows)
            now = self._clock()
            since = now - g.last_probe
            n = self._neighbour(g, ceiling, flip=False)
            triggered = g.nudged or (len(g.recent) == WINDOW and min(g.recent) > g.best * SLOWER_RATIO) \
                or (not g.known.keys() - {g.current} and rows < FIRST_PROBE_ROWS)
            faster = len(g.recent) == WINDOW and max(g.recent) * SLOWER_RATIO < g.ref
            known = g.known.get(n)
            if g.nudged:                                    # another group saw the machine change
                affordable = triggered = True
            elif known is not None:                         # a probe's known cost fits in the share,
                scale = min(1.0, min(g.recent) / g.ref)     # scaled as the current count sped up since
                affordable = since * PROBE_SHARE >= known * rows * scale
                triggered = triggered or faster
            else:                                           # unknown: the current count's time, times
                ratio = self._ratio(g, n)                   # how much slower n was in other groups
                affordable = triggered or since * PROBE_SHARE >= min(g.recent) * rows * ratio
            if n != g.current and affordable and (triggered or since >= g.interval):
                g.nudged = False
                g.best = g.ref = min(g.recent)              # a rise or a fall is judged from here on
                self._neighbour(g, ceiling, flip=True)
                g.probe_n, g.probe_left, g.probe_best = n, PROBE_PASSES, float("inf")
                return n
        return g.current

    def _ratio(self, g: _Group, n: int) -> float:
        """How many times slower (at least 1) count ``n`` was than ``g``'s current count in the
        other groups that measured both: an unknown probe's cost is judged by it."""
        r = 1.0
        for h in self._groups.values():
            if h is not g and n in h.known and g.current in h.known:
                r = max(r, h.known[n] / h.known[g.current])
        return r

    def _neighbour(self, g: _Group, ceiling: int, flip: bool) -> int:
        c = candidates(ceiling)
        i = c.index(g.current) if g.current in c else len(c) - 1
        up = g.probe_up if 0 < i < len(c) - 1 else i == 0
        if flip:
            g.probe_up = not up
        return c[min(i + 1, len(c) - 1)] if up else c[max(i - 1, 0)]

    def record(self, ceiling: int, rows: int, n: int, seconds: float) -> None:
        """A completed pass of ``rows`` rows that ran ``n`` threads in ``seconds`` (wall)."""
        ceiling = max(1, int(ceiling))
        self.passes[n] = self.passes.get(n, 0) + 1
        if ceiling == 1 or not self.adaptive:
            return
        g = self._group(ceiling, rows)
        per = max(float(seconds), 1e-9) / max(1, rows)
        if g.probe_n and n == g.probe_n:
            g.probe_best = min(g.probe_best, per)
            g.probe_left -= 1
            cur = min(g.recent) if g.recent else None
            if g.probe_left > 0 and (cur is None or per <= cur * ABORT_RATIO):
                return
            g.probe_n = 0
            g.last_probe = self._clock()
            g.known[n] = g.probe_best
            log.debug("probe of %d thread(s) for %d-row passes: %.3g ms per row against %.3g at %d",
                      n, rows, 1e3 * g.probe_best, 1e3 * (cur or 0.0), g.current)
            if cur is None or g.probe_best < cur * (1 - MARGIN):
                self._switch(g, n, g.probe_best)
                g.interval = BASE_INTERVAL_S
            else:
                g.interval = min(g.interval * 2, MAX_INTERVAL_S)
            return
        if n != g.current:                                  # e.g. a pass chosen before a probe ended
            return
        g.recent.append(per)
        g.known[n] = min(g.recent)
        g.best = min(g.best, per)
        if g.ref == float("inf") and len(g.recent) == WINDOW:   # after a switch: the new count's level
            g.ref = min(g.recent)
        if len(g.recent) == WINDOW:
            worst_recent = min(g.recent)                    # every recent pass was at least this slow
            best = min(((v, k) for k, v in g.known.items() if k != n), default=None)
            if best is not None and best[0] < worst_recent * (1 - MARGIN):
                self._switch(g, best[1], None)

    def _switch(self, g: _Group, n: int, est: float | None) -> None:
        log.info("passes of %d+ rows: %d thread(s) from now on, was %d (%.3g vs %.3g ms per row)",
                 1 << (self._key(g) - 1), n, g.current, 1e3 * (est if est is not None else g.known.get(n, 0.0)),
                 1e3 * (min(g.recent) if g.recent else g.known.get(g.current, 0.0)))
        g.current = n
        self._hint = n
        g.recent.clear()
        g.best = float("inf") if est is None else est
        g.ref = g.best
        if est is not None:
            g.recent.append(est)
        self.switches += 1
        for other in self._groups.values():                 # the machine changed: the others look too,
            if other is not g and not other.probe_n:        # after one fresh pass at their count
                other.nudged = True
                other.recent.clear()

    def _key(self, g: _Group) -> int:
        return next((k for k, v in self._groups.items() if v is g), 1)

    def state(self) -> dict[int, int]:
        """The current thread count of every row group (key: ``rows.bit_length()``)."""
        return {k: g.current for k, g in sorted(self._groups.items())}


__all__ = ["ENV", "ThreadGovernor", "candidates", "enabled"]
