"""One worker's connection: the mechanism under a model's state machine
(``router.workers.lifecycle``, applied by ``router.workers.slot.ModelSlot`` alone).

:class:`WorkerProcess` has the launcher (``router.workers.launchers``) start the worker at the
endpoint its socket is bound to, waits for its Ready, and reports the process's exit; its
socket, the Hello check (the peer that proves the per-spawn secret the launcher handed it
privately, ``protocol.credentials``, and whose pid the launcher's handle owns) and the frames
routed by request id are its base's (``router.workers.connection.WorkerChannel``). When the
process exits every open request queue receives a :class:`WorkerGone` at once. A warm spare's
connection is made by the launcher before any model wants it; the model that takes it
(:meth:`WorkerProcess.adopt`) sends Assign from :meth:`WorkerProcess.start` instead of
starting a process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from protocol import Error, LoadProgress, Message, ProtocolError, Ready, Shutdown
from protocol.kv_events import KvEvents
from router.config import ModelConfig
from router.workers.connection import CurveKeypair, WorkerChannel, WorkerGone, WorkerUnreachable
from router.workers.launchers import LaunchError, Launcher, WorkerHandle
from router.workers.options import assign_for, option_args

log = logging.getLogger("modelyard.worker")


#: The exit code a worker gets when its connection is lost (as a SIGKILLed child's).
LOST_EXIT_CODE = -9

class LoadFailed(Exception):
    """The worker did not become ready. ``exit_code`` is set when the process exited."""

    def __init__(self, reason: str, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


class WorkerProcess(WorkerChannel):
    """One worker and its socket. Create, ``await start()``, use, ``await stop()``.

    ``model`` None: a warm spare (made by its launcher: :meth:`start_spare`, then
    :meth:`adopt` by the model that takes it). Not a state owner: ``router.workers.slot.ModelSlot``
    decides; this object executes.
    """

    def __init__(self, model: ModelConfig | None, ctx: zmq.asyncio.Context, launcher: Launcher,
                 curve_server: CurveKeypair | None = None) -> None:
        super().__init__(ctx, curve_server)
        self.model = model
        self._launcher = launcher
        self.command: list[str] = []
        self._handle: WorkerHandle | None = None
        self._ready: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        self.kill_reason: str | None = None  # set when we killed it (hung, stop)
        self._stop_requested = False
        self.ready: Ready | None = None
        self._late_fingerprint = ""  # from a second Ready (sent when the file's hash finished after load)
        self.started_at = time.time()
        self.from_spare = False  # started as a warm spare, then given this model (adopt)
        self.start_ended = asyncio.Event()  # start() has returned or raised (the launcher's replacement waits for it)
        # its KV events' reader (the replica's prefix index, router.workers.prefix_index); None: dropped
        self.on_kv_events: Callable[[KvEvents], None] | None = None
        self._exit_callbacks: list[Callable[[WorkerProcess], None]] = []
        self._on_load_step: Callable[[LoadProgress], None] | None = None

    # ------------------------------------------------------------------ facts

    @property
    def name(self) -> str:
        """The model's name, or "(spare)" before a spare is adopted (for logs)."""
        return self.model.name if self.model is not None else "(spare)"

    @property
    def pid(self) -> int | None:
        return self._handle.pid if self._handle is not None else None

    @property
    def host(self) -> str:
        """Where it runs: its process's host once started (a Ray node), else its launcher's."""
        return self._handle.host if self._handle is not None else self._launcher.host

    @property
    def alive(self) -> bool:
        return self._handle is not None and not self.exited.is_set()

    @property
    def max_jobs(self) -> int:
        """Generations the worker runs at once (1: the depth-one job queue)."""
        return max(1, self.ready.max_jobs) if self.ready is not None else 1

    def rss_bytes(self) -> int | None:
        """Resident memory of the worker process, bytes (None if gone)."""
        return self._handle.rss_bytes() if self._handle is not None and self.alive else None

    def exit_description(self) -> str:
        if self.kill_reason:
            return self.kill_reason
        code = self.exit_code
        if code is None:
            return "worker process is gone"
        if code < 0:
            return f"worker process was killed by signal {-code}"
        return f"worker process exited with code {code}"

    def on_exit(self, callback: Callable[[WorkerProcess], None]) -> None:
        """Call ``callback(self)`` (in the event loop) once the process has exited."""
        self._exit_callbacks.append(callback)

    # ------------------------------------------------------------------ lifecycle

    async def _launch(self) -> None:
        """Bind the socket at the launcher's endpoint, make this spawn's credentials, and have
        the launcher start the worker (``self.model``'s, or a spare). Raises LoadFailed."""
        endpoint = self._launcher.endpoint()
        try:
            self._bind(endpoint)
        except zmq.ZMQError as e:
            self.exited.set()
            raise LoadFailed(f"cannot bind the worker socket {endpoint}: {e}") from None
        assert self._credentials is not None
        try:
            launched = await self._launcher.start(self.model, self.endpoint, self._credentials)
        except LaunchError as e:
            self._close_socket()
            self.exited.set()
            raise LoadFailed(e.reason) from None
        self._handle = launched.handle
        self.command = list(launched.command)
        launched.handle.on_exit(self._on_exit)

    async def start_spare(self, timeout_s: float) -> bool:
        """Start this connection's worker as a warm spare (no model) and wait for its Hello.
        True once it is warm; False if it could not start, exited, or said no Hello within
        ``timeout_s`` seconds (then it is still running: the caller kills it)."""
        try:
            await self._launch()
        except LoadFailed as e:
            self.kill_reason = e.reason
            return False
        hello = asyncio.ensure_future(self._hello.wait())
        exited = asyncio.ensure_future(self.exited.wait())
        try:
            await asyncio.wait({hello, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hello.cancel()
            exited.cancel()
        return self.warm and not self.exited.is_set()

    def adopt(self, model: ModelConfig) -> None:
        """This warm spare is ``model``'s from now on: its :meth:`start` sends Assign."""
        assert self.model is None and self._handle is not None, "only a started spare is adopted"
        self.model = model
        self.from_spare = True
        self.command = [*self.command, *option_args(model)]  # what it runs, as a worker started for it

    async def start(self, timeout_s: float, progress: Callable[[str, dict[str, Any]], None] | None = None) -> Ready:
        """Start the worker (or, an adopted spare, send it Assign) and wait for Hello then Ready.
        ``progress(stage, fields)`` hears ``spawned`` (``pid``; ``spare`` True for an adopted
        spare), ``connected`` (the worker's Hello: it is loading) and each LoadProgress the
        worker sends (its ``stage``; ``done``, ``total``).

        Raises LoadFailed on Error(load_failed), process exit, or no Ready
        within ``timeout_s`` seconds (the process is then killed).
        """
        try:
            return await self._start(timeout_s, progress)
        finally:
            self.start_ended.set()

    async def _start(self, timeout_s: float, progress: Callable[[str, dict[str, Any]], None] | None) -> Ready:
        assert self.model is not None, "a spare starts with start_spare()"
        adopted = self._handle is not None
        if not adopted:
            await self._launch()
        if progress is not None:
            progress("spawned", {"pid": self.pid, **({"spare": True} if adopted else {})})
            self._on_hello = lambda: progress("connected", {})
            self._on_load_step = lambda m: progress(m.stage, {"done": m.done, "total": m.total})
        if adopted:
            if self._on_hello is not None:
                self._on_hello()
            try:
                await self.send(assign_for(self.model, self.new_call_id("assign")))
            except (WorkerUnreachable, ProtocolError) as e:
                self.kill("could not be assigned its model")
                await self._wait_exited(5.0)
                raise LoadFailed(f"cannot give the warm spare its model: {e}", self.exit_code) from None
        exited = asyncio.ensure_future(self.exited.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {self._ready, exited}
            done, _ = await asyncio.wait(waiters, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None:
            self.ready = self._ready.result()
            if not self.ready.fingerprint and self._late_fingerprint:
                self.ready = dataclasses.replace(self.ready, fingerprint=self._late_fingerprint)
            return self.ready
        if self._ready.done() and not self._ready.cancelled():
            err = self._ready.exception()
            if not await self._wait_exited(2.0):  # the worker exits 1 after Error(load_failed)
                self.kill("load failed")
                await self._wait_exited(5.0)
            raise LoadFailed(str(err), self.exit_code)
        if self.exited.is_set():
            raise LoadFailed(f"{self.exit_description()} before it was ready", self.exit_code)
        self.kill(f"not ready within load_timeout_s={timeout_s:g}")
        await self._wait_exited(5.0)
        raise LoadFailed(f"worker was not ready within load_timeout_s={timeout_s:g} s; killed", self.exit_code)

    def _on_exit(self, code: int) -> None:
        if self.exited.is_set():  # declared lost already (_connection_lost); its launcher's news comes later
            return
        self.exit_code = code
        self.exited.set()
        # Frames the worker sent before it died are delivered before the news of its death.
        gone = WorkerGone(self.exit_description(), code)
        log.log(logging.INFO if self._stop_requested else logging.WARNING, "worker %s (pid %s) for %s: %s",
                self.serial, self.pid, self.name, gone.reason)
        self._end_streams(gone)
        for cb in self._exit_callbacks:
            try:
                cb(self)
            except Exception:  # pragma: no cover - a bug in a callback must not stop the others
                log.exception("worker exit callback failed")
        self._close_socket()

    def _connection_lost(self) -> None:
        """The worker's connection dropped: it is gone, as if it had exited (its streams end with
        their error at once; it is killed through its launcher, whose later exit report is
        ignored). A worker on another host is so known to be gone within the heartbeat timeout,
        whatever its launcher learns and when."""
        if self._stop_requested or self.exited.is_set():
            return
        self.kill("its connection was lost (host or network gone)")
        log.warning("worker %s (pid %s on %s) for %s: connection lost", self.serial, self.pid, self.host, self.name)
        self._on_exit(LOST_EXIT_CODE)

    def kill(self, reason: str | None = None) -> None:
        """End the process now (its launcher's kill: SIGKILL for a local child; no-op if gone).
        ``reason`` becomes its exit description."""
        if reason and not self.kill_reason and not self.exited.is_set():
            self.kill_reason = reason
        if self._handle is not None:
            self._handle.kill()

    async def stop(self, grace_s: float) -> None:
        """Shutdown frame, up to ``grace_s`` seconds to exit, then kill. Idempotent."""
        self._stop_requested = True
        if self._handle is None:
            self._close_socket()
            return
        if not self.exited.is_set():
            if self._identity is None:  # not connected (still starting): nothing to ask
                self.kill("stopped before it connected")
            try:
                await self.send(Shutdown(id=f"shutdown-{self.serial}"))
            except WorkerUnreachable:
                pass
            if not await self._wait_exited(grace_s):
                log.warning("worker %s for %s ignored Shutdown for %.1f s; killing", self.pid,
                            self.name, grace_s)
                self.kill(f"killed after ignoring Shutdown for {grace_s:g} s")
                await self._wait_exited(10.0)
        self._close_socket()

    async def _wait_exited(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.exited.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ frames

    def _unrouted(self, msg: Message) -> None:
        """Its frames for no open request: LoadProgress, Ready (twice: the second carries the
        fingerprint the worker was still computing), a load's Error, KvEvents."""
        if isinstance(msg, LoadProgress):
            if not self._ready.done() and self._on_load_step is not None:
                self._on_load_step(msg)
            return
        if isinstance(msg, Ready):
            if not self._ready.done():
                self._ready.set_result(msg)
            elif msg.fingerprint:  # the second Ready: the fingerprint the worker was still computing
                self._late_fingerprint = msg.fingerprint
                if self.ready is not None and not self.ready.fingerprint:
                    self.ready = dataclasses.replace(self.ready, fingerprint=msg.fingerprint)
            return
        if isinstance(msg, KvEvents):
            if self.on_kv_events is not None:
                self.on_kv_events(msg)
            return
        if isinstance(msg, Error) and not self._ready.done():
            self._ready.set_exception(LoadFailed(f"{msg.code}: {msg.message}"))
            return
        log.debug("frame %s for unknown request %s from %s's worker", msg.TYPE, msg.id, self.name)

    def _is_own(self, pid: int) -> bool:
        return self._handle is not None and self._handle.is_own(pid)
