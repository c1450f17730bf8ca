"""What the runner's threads tell the socket loop (``worker.server``), through the ``post`` callable
it handed in: one event per fact, in the order they happened (the loop sends the frames they
carry and keeps its own state from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol import Done, Error, Message

__all__ = ["FrameOut", "JobFinished", "KvBatch", "LoadFailed", "LoadStep", "Loaded", "Persisted",
           "RunnerEvent", "StateOut"]


@dataclass(frozen=True)
class FrameOut:
    """A frame for the router (a Token of the running job)."""

    msg: Message


@dataclass(frozen=True)
class JobFinished:
    """The job ended: ``final`` is its last frame (Done or Error); the runner is free for another.

    One event, so the socket thread sends the last frame and marks the job
    finished in one step (a Ping right after the Done never sees it running).
    """

    job_id: str
    final: Done | Error


@dataclass(frozen=True)
class LoadStep:
    """A step of ``Engine.load`` (its ``progress`` callback, thinned out: every stage's
    first and last step, at most one in ``worker.runner.LOAD_STEP_INTERVAL_S`` between them)."""

    stage: str
    done: int
    total: int


@dataclass(frozen=True)
class Loaded:
    """The engine is loaded. ``load_ms``: wall time of ``Engine.load`` (ms)."""

    engine: Any
    load_ms: float


@dataclass(frozen=True)
class LoadFailed:
    """``Engine.load`` raised; ``reason`` says why ("<code>: <message>")."""

    reason: str


@dataclass(frozen=True)
class Persisted:
    """The idle KV entries were saved to the KV cache directory (or there was nothing to do):
    ``files`` written, ``n_bytes`` written, ``ms`` wall time."""

    files: int = 0
    n_bytes: int = 0
    ms: float = 0.0


@dataclass(frozen=True)
class StateOut:
    """A ``stream_state`` generation ended: ``state`` is its KV entry (a copy, taken in the step
    it ended), ``final`` its Done; the socket thread streams the state, then sends ``final``.
    Like JobFinished, it frees the runner for another job."""

    job_id: str
    state: Any
    final: Done


@dataclass(frozen=True)
class KvBatch:
    """What entered and left the KV cache in one engine step (or slot action): ``events``
    (``protocol.kv_events``), taken at ``ts`` (unix seconds); for ``worker.kvevents``."""

    ts: float
    events: list[Any]


RunnerEvent = FrameOut | JobFinished | KvBatch | LoadStep | Loaded | LoadFailed | Persisted | StateOut
