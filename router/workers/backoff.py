"""Crash backoff: when may a model whose worker died (or failed to load) start again?

Pure bookkeeping, no I/O and no clock of its own: every method takes ``now``
(monotonic seconds, from the pool's clock), so the decisions are deterministic and
testable with made-up times. ``router.workers.slot.ModelSlot`` owns one :class:`CrashHistory`;
it and its parts are its only writers (``router.workers.loading`` records the failures,
``router.workers.unloading`` applies a reloaded config's policy).

Policy (per model, ``[models.NAME]`` / ``[defaults]`` keys):

* the n-th failure within ``crash_window_s`` makes the next start wait
  ``min(restart_backoff_s * 2**(n-1), restart_backoff_max_s)`` seconds; requests
  during the wait get 503 with ``Retry-After`` = the remaining wait, rounded up;
* the ``max_crashes``-th failure within the window makes the model ``failed``
  for good: requests get 503 ``model_failed`` until an operator loads it
  (``POST /admin/models/load`` or ``POST /models/load``), which clears the window.

A failure is a ready worker that exited unasked or was killed as hung, or a load
that failed (error, exit, ``load_timeout_s``).
"""

from __future__ import annotations

import math
import signal
from collections import deque
from dataclasses import dataclass
from typing import Any

from router.config import ModelConfig
from router.http.errors import ApiError, ModelFailed, RestartBackoff, redact_paths


@dataclass(frozen=True)
class CrashPolicy:
    base_s: float = 1.0  # restart_backoff_s
    max_s: float = 60.0  # restart_backoff_max_s
    max_crashes: int = 5  # within window_s: failed until an operator loads it
    window_s: float = 300.0  # crash_window_s

    def delay(self, n: int) -> float:
        """The wait before the next start after the ``n``-th failure in the window (n >= 1)."""
        if n <= 0 or self.base_s <= 0:
            return 0.0
        return min(self.base_s * 2.0 ** min(n - 1, 60), self.max_s)


def crash_policy(m: ModelConfig) -> CrashPolicy:
    """The crash backoff ``m``'s config asks for."""
    return CrashPolicy(base_s=m.restart_backoff_s, max_s=m.restart_backoff_max_s, max_crashes=m.max_crashes,
                       window_s=m.crash_window_s)


@dataclass(frozen=True)
class Failure:
    """One failure as the operator sees it. ``kind``: "crashed" (a ready worker died or
    was killed as hung) or "load_failed". ``at``: unix time."""

    kind: str
    reason: str
    exit_code: int | None
    at: float

    @property
    def signal(self) -> str | None:
        """The signal that ended the process (``SIGKILL``), if one did."""
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "reason": self.reason, "exit_code": self.exit_code,
                "signal": self.signal, "at": self.at}


class CrashHistory:
    """The failures of one model and the restart gate they set."""

    def __init__(self, policy: CrashPolicy) -> None:
        self.policy = policy
        self.total = 0  # failures ever (crashes + failed loads)
        self.crashes = 0  # of those, ready workers that died
        self.last: Failure | None = None
        self._recent: deque[float] = deque()  # monotonic times of failures within the window
        self._restart_at: float | None = None  # monotonic; None: no wait
        self.given_up = False  # max_crashes within the window: failed until an operator loads it

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0] <= now - self.policy.window_s:
            self._recent.popleft()

    def in_window(self, now: float) -> int:
        self._prune(now)
        return len(self._recent)

    def record(self, now: float, failure: Failure) -> None:
        """A failure happened at ``now``: set the wait (or give up)."""
        self._prune(now)
        self._recent.append(now)
        self.total += 1
        if failure.kind == "crashed":
            self.crashes += 1
        self.last = failure
        n = len(self._recent)
        if n >= self.policy.max_crashes:
            self.given_up = True
            self._restart_at = None
        else:
            d = self.policy.delay(n)
            self._restart_at = now + d if d > 0 else None

    def remaining(self, now: float) -> float:
        """Seconds until a start is allowed (0: now; meaningless once given up)."""
        if self._restart_at is None:
            return 0.0
        return max(0.0, self._restart_at - now)

    def retry_after(self, now: float) -> int:
        """``Retry-After`` for a request refused at ``now``: the remaining wait, rounded up."""
        return max(1, math.ceil(self.remaining(now) - 1e-9))

    def operator_reset(self) -> None:
        """An operator loads the model: the window and the gate start afresh (the
        totals and the last failure stay for /admin/models)."""
        self._recent.clear()
        self._restart_at = None
        self.given_up = False

    def describe(self, now: float) -> dict[str, Any]:
        return {"count": self.total, "crashes": self.crashes, "in_window": self.in_window(now),
                "window_s": self.policy.window_s, "max_crashes": self.policy.max_crashes,
                "restart_in_s": round(self.remaining(now), 3) if not self.given_up else None,
                "given_up": self.given_up, "last": self.last.describe() if self.last else None}


def restart_refusal(h: CrashHistory, model: str, now: float) -> ApiError | None:
    """Why a failed model may not start again at ``now`` (monotonic s) on a request's behalf:
    ModelFailed (given up after ``max_crashes``; until an operator loads it) or RestartBackoff
    (503, Retry-After: the remaining wait); None: it may."""
    last = f" (last: {redact_paths(h.last.reason)})" if h.last is not None else ""
    if h.given_up:
        return ModelFailed(
            f"model '{model}' failed {h.in_window(now)} times within crash_window_s="
            f"{h.policy.window_s:g} s{last}; it stays failed until an operator loads it "
            f"(POST /admin/models/load)")
    left = h.remaining(now)
    if left > 0:
        return RestartBackoff(
            f"model '{model}' failed {h.in_window(now)} time(s) recently{last}; "
            f"it restarts in {left:.1f} s (crash backoff)", retry_after_s=h.retry_after(now))
    return None
