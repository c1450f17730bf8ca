"""One worker's configuration (:class:`WorkerConfig`, from ``python -m worker``'s arguments), the
engine loader it uses by default, and :class:`ParentWatch` (the worker exits when the process that
started it is gone)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from protocol import WorkerCredentials
from protocol.lifecycle import ModelOptions
from protocol.limits import DEFAULT_KV_BUDGET_MIB

__all__ = ["ParentWatch", "WorkerConfig", "default_loader"]


def default_loader(gguf_path: str, n_ctx: int | None, chat_template: str | None, *, parallel: int = 1,
                   kv_budget_mib: float | None = None, weights: str | None = None, n_ubatch: int | None = None,
                   progress: Callable[[str, int, int], None] | None = None) -> Any:
    """``worker.engine.Engine.load`` (imported lazily: the engine pulls in numpy); no
    ``kv_budget_mib`` -> ``protocol.limits.DEFAULT_KV_BUDGET_MIB``; no ``weights`` -> the engine's
    default (``n_ubatch`` likewise); ``progress`` as Engine.load's."""
    from worker.engine import Engine

    extra: dict[str, Any] = {} if weights is None else {"weights": weights}
    if n_ubatch is not None:
        extra["n_ubatch"] = n_ubatch
    return Engine.load(gguf_path, n_ctx=n_ctx, chat_template=chat_template, parallel=parallel,
                       kv_budget_mib=DEFAULT_KV_BUDGET_MIB if kv_budget_mib is None else kv_budget_mib,
                       progress=progress, **extra)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(ModelOptions):
    """What one worker serves and how it behaves: its model options (``protocol.ModelOptions``,
    the same for a worker started for its model and for a spare given it) and these.

    model: configured model name (echoed in Hello / Ready).
    gguf: path of the GGUF file.
    endpoint: the router's ROUTER endpoint to connect to (``ipc://...`` or ``tcp://host:port``).
    n_ctx: KV cache size in tokens; None -> the engine's default.
    chat_template: template text or known name overriding the GGUF's; None -> the GGUF's.
    max_queue: Generates that may wait behind the running one(s); more -> Error "busy".
    parallel: KV slots: sequences decoded at once (``Ready.max_jobs``).
    kv_budget_mib: KV memory of all sequences and cached prefixes (MiB); None -> protocol.limits.DEFAULT_KV_BUDGET_MIB.
    parent_pid: exit when this process is gone; None -> no watch.
    shutdown_grace_s: after Shutdown, how long to wait for the running generation
        to end (seconds) before exiting anyway.
    parent_gone_grace_s: the same when the parent is gone (seconds; default 0: nobody
        listens any more, and the KV cache dies with the process).
    poll_ms: longest socket poll (ms); bounds how late the parent check runs.
    parent_check_s: interval of the parent check (seconds).
    linger_ms: ZMQ LINGER on exit (ms): how long unsent frames may delay exit.
    credentials: the per-spawn secret proven in Hello and, over tcp, the CURVE keys
        (``protocol.credentials``); None -> an empty secret, no CURVE.
    slot_save_path: directory of SlotAction save / restore files; None -> slot actions refused.
    kv_cache_dir: directory of this model's KV states kept across stops: on Shutdown / SIGTERM
        the idle KV entries are saved there (most recent first, within ``kv_cache_mib``) before
        exiting; at load they are indexed and restored lazily on a prefix match. None -> off.
    kv_cache_mib: disk budget of ``kv_cache_dir`` (MiB).
    kv_events_endpoint: the ZeroMQ PUB endpoint (``tcp://HOST:PORT`` / ``ipc://PATH``) the worker binds
        to publish its KV events (``worker.kvevents``); None -> none.
    kv_events_block_size: tokens per block of those events (>= 1).
    kv_events_to_router: also send them to the router as KvEvents frames.
    """

    endpoint: str
    parent_pid: int | None = None
    shutdown_grace_s: float = 3.0
    parent_gone_grace_s: float = 0.0
    poll_ms: int = 100
    parent_check_s: float = 0.2
    linger_ms: int = 1000
    credentials: WorkerCredentials | None = None

    @property
    def kv_events(self) -> bool:
        """The worker tells its KV events somewhere (a PUB endpoint, the router or both)."""
        return self.kv_events_endpoint is not None or self.kv_events_to_router

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint must be ipc://... or tcp://host:port, got {self.endpoint!r}")
        if self.n_ctx is not None and self.n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive number of tokens, got {self.n_ctx}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {self.parallel}")
        if self.kv_budget_mib is not None and not self.kv_budget_mib > 0:
            raise ValueError(f"kv_budget_mib must be > 0, got {self.kv_budget_mib}")
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"kv_events_endpoint must be ipc://... or tcp://host:port, got {self.kv_events_endpoint!r}")
        if self.kv_events_block_size < 1:
            raise ValueError(f"kv_events_block_size must be >= 1, got {self.kv_events_block_size}")


class ParentWatch:
    """Tells whether process ``pid`` is gone: exited, a zombie, or its pid reused.

    When ``pid`` is our parent at construction, being re-parented also counts
    as gone (the parent died and we were adopted).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._is_parent = pid == os.getppid()
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._proc = None

    def gone(self) -> bool:
        if self._is_parent and os.getppid() != self.pid:
            return True
        if self._proc is None:
            return True
        try:
            if not self._proc.is_running():  # also catches pid reuse (create time differs)
                return True
            return self._proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # access denied and the like: cannot tell, assume alive
            return False
