"""Worker launchers: where a worker process runs, how it is started, and what it may use.

Starting a worker and talking to it are separate jobs. The connection
(``router.workers.process.WorkerProcess``) binds the router's ZeroMQ socket, makes the
worker's per-spawn credentials, checks its Hello and routes its frames. A :class:`Launcher`
starts the process that connects to that socket, hands it those credentials, and reports on it
through a :class:`WorkerHandle`. Nothing else in the router knows where a worker runs:

* the endpoint the router binds for it (:meth:`Launcher.endpoint`: an ipc socket file, or a tcp
  address the worker's host can reach);
* how the credentials reach it (:meth:`Launcher.start`: an inherited pipe for a local child;
  another host's launcher uses its own private channel);
* how the worker knows its router is gone (a local child watches its parent's pid; a remote
  worker needs its system's equivalent);
* its memory and the host's (:meth:`Launcher.available`, :meth:`Launcher.rss`,
  :meth:`WorkerHandle.rss_bytes`) and the cores CPU sharing divides (:meth:`Launcher.cores`);
* whether a Hello's pid is the started process (:meth:`WorkerHandle.is_own`).

``local.LocalLauncher`` (subprocesses of the router, on this host) is the implementation today;
it also keeps a warm spare (:meth:`Launcher.take_spare`). A launcher that starts workers on
another host (e.g. a Ray actor; ZeroMQ with CURVE stays the data plane) is one more module
implementing this interface; placement still uses the router's own memory estimate.

Units: memory in bytes, times in seconds, exit codes as ``subprocess`` reports them (negative:
killed by that signal).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol import WorkerCredentials

if TYPE_CHECKING:
    from router.config import ModelConfig
    from router.workers.process import WorkerProcess

log = logging.getLogger("modelyard.worker")


class LaunchError(Exception):
    """The launcher could not start the worker (nothing runs). ``reason``: for operators."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WorkerHandle(ABC):
    """One started worker process, as its launcher sees it (not its socket: the connection's)."""

    #: Where it runs: "localhost" for a child of the router, else the host's name.
    host: str

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """Its process id on :attr:`host` (None before it started)."""

    @abstractmethod
    def alive(self) -> bool:
        """The process has not exited (as far as the launcher knows now)."""

    @abstractmethod
    def kill(self) -> None:
        """End it now (SIGKILL for a local child), without grace: the graceful part, a Shutdown
        frame and a wait, is the connection's. No-op once it has exited. Never raises."""

    @abstractmethod
    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(exit_code)`` once, in the event loop that was running when this was
        called, after the process has exited (at once if it already has)."""

    @abstractmethod
    def rss_bytes(self) -> int | None:
        """Its resident memory now, bytes (None: gone or unknown)."""

    @abstractmethod
    def is_own(self, pid: int) -> bool:
        """Whether ``pid`` (from a Hello) is this process or one of its descendants."""


class ExitWatchingHandle(WorkerHandle):
    """A handle's exit bookkeeping, shared by the launchers: :meth:`on_exit` callbacks run once,
    in the event loop, after :meth:`_exited`; a subclass starts learning of the exit in
    :meth:`_watch` (called once, at the first :meth:`on_exit`)."""

    def __init__(self) -> None:
        self._code: int | None = None
        self._callbacks: list[Callable[[int], None]] = []
        self._watching = False

    def on_exit(self, callback: Callable[[int], None]) -> None:
        loop = asyncio.get_running_loop()
        if self._code is not None:
            loop.call_soon(callback, self._code)
            return
        self._callbacks.append(callback)
        if not self._watching:
            self._watching = True
            self._watch(loop)

    @abstractmethod
    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arrange for :meth:`_exited` to be called in ``loop`` once the process has exited."""

    def _exited(self, code: int) -> None:
        """The process exited with ``code``: run the callbacks (once; a second report is ignored)."""
        if self._code is not None:
            return
        self._code = code
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(code)
            except Exception:  # pragma: no cover - a bug in a callback must not stop the others
                log.exception("worker exit callback failed")


@dataclass(frozen=True)
class Launched:
    """What :meth:`Launcher.start` hands back: the endpoint the worker connects to, the
    credentials it was given, the handle of its process, and its command line (for logs and
    llama.cpp's ``/models`` ``args``; no secrets in it)."""

    endpoint: str
    credentials: WorkerCredentials
    handle: WorkerHandle
    command: tuple[str, ...]


class Launcher(ABC):
    """Starts workers on one host and knows that host's resources (see the module docstring).

    One per :class:`router.workers.pool.Pool`; every method runs on the event loop.
    """

    #: Where its workers run ("localhost" for this machine).
    host: str

    @abstractmethod
    def endpoint(self) -> str:
        """The ZeroMQ endpoint the router binds for the next worker (``ipc://PATH`` or
        ``tcp://ADDRESS:0``, the port then chosen at bind). A fresh one per call."""

    @abstractmethod
    async def start(self, model: ModelConfig | None, endpoint: str, credentials: WorkerCredentials) -> Launched:
        """Start a worker for ``model`` (None: a warm spare, given its model later with Assign)
        that connects to ``endpoint`` (already bound) and proves ``credentials``. Returns once
        the process runs, not once it is ready. Raises LaunchError if it cannot be started."""

    @abstractmethod
    def cores(self) -> int:
        """Cores the workers may use together (what CPU sharing divides), >= 1."""

    @abstractmethod
    def available(self) -> int:
        """Memory available for a new worker on the host now, bytes."""

    @abstractmethod
    def rss(self, pid: int | None, model: str) -> int | None:
        """Resident memory of ``model``'s worker process ``pid`` on the host, bytes (None: gone)."""

    # ------------------------------------------------------------------ warm spare (optional)

    def take_spare(self, model: ModelConfig) -> WorkerProcess | None:
        """A started worker without a model, now ``model``'s (its connection, Hello already
        proven), or None when there is none to take. Its ``start()`` then sends Assign instead
        of starting a process. Default: no spares."""
        return None

    def spare_pid(self) -> int | None:
        """The pid of the spare :meth:`take_spare` would hand out now (None: none). Placement
        counts its memory (:meth:`rss`) as free for the next load, which takes it."""
        return None

    def describe_spare(self) -> dict[str, Any] | None:
        """The spare for ``/admin/models`` (None: this launcher keeps none)."""
        return None

    def begin(self) -> None:
        """The router is serving (the event loop runs): start what runs in the background."""

    async def close(self) -> None:
        """Stop everything this launcher started that no model owns (its spare), and release
        its resources. The models' workers are stopped by their owners first. Idempotent."""


__all__ = ["ExitWatchingHandle", "LaunchError", "Launched", "Launcher", "WorkerHandle"]
