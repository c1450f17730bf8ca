"""The local launcher: workers are child processes of the router, on this host, with a warm spare.

Start: ``python -m worker`` (or ``$MODELYARD_WORKER_MODULE``; :func:`worker_command`) in its own
session, stdin closed, with ``--parent-pid`` this router (the worker exits within ~0.2 s of the
router's end, even a SIGKILL: ``worker.server.ParentWatch``) and ``--auth-fd``: the read end of a
pipe holding its credentials (``protocol.credentials``; never on the command line or in the
environment, which other local processes can read). Its endpoint is an ipc socket file in this
router's private directory (``router.workers.sockdir``) or, with ``transport = "tcp"``,
``tcp://127.0.0.1:0`` (loopback only; CURVE-encrypted).
Resources: the host's available memory and a process's RSS through psutil; the cores of this
process's CPU affinity.

Warm spare (``[server] warm_spare``, default on): one worker started without a model
(``python -m worker --spare``: its interpreter start, imports and every numba kernel done; it says
Hello and waits). The first model to start takes it (:meth:`LocalLauncher.take_spare`; the model
is loaded then, into that process, never before) and a replacement starts
:data:`SPARE_REPLACE_DELAY_S` after the taken worker's start has ended (so the new spare's
imports do not compete with the first request for the cores). Only a spare that has said Hello
(warm) is taken: one still warming is left to finish, and the model starts its own process.
A spare that exits or does not say Hello within :data:`SPARE_START_TIMEOUT_S` is replaced after
a backoff: 1 s doubling per consecutive failure up to :data:`SPARE_BACKOFF_MAX_S` (reset once a
spare is taken or has stayed up for :data:`SPARE_BACKOFF_MAX_S`). The router's shutdown stops it
(Shutdown, then SIGKILL); a SIGKILLed router's spare exits by its parent watch like any worker.
States (``describe_spare``): ``off``, ``starting`` (a spare process is warming up), ``warm``,
``pending`` (the last one was taken; the next starts once that load has ended), ``backoff``
(the last one failed; the next starts at ``retry_in_s``), ``stopped`` (the router is stopping).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from protocol import WorkerCredentials, write_credentials
from router.config import ModelConfig, ServerConfig
from router.workers.launchers import LaunchError, Launched, Launcher, WorkerHandle
from router.workers.options import option_args
from router.workers.sockdir import make_socket_dir, remove_socket_dir

if TYPE_CHECKING:
    import zmq.asyncio

    from router.workers.connection import CurveKeypair
    from router.workers.process import WorkerProcess

log = logging.getLogger("modelyard.worker")

#: The worker module run as ``python -m MODULE``; tests point it at the fake worker.
WORKER_MODULE_ENV = "MODELYARD_WORKER_MODULE"
#: A spare that has not said Hello this long after its start is killed and replaced (s).
SPARE_START_TIMEOUT_S = 120.0
#: After a spare is taken, its replacement starts this long after the taken worker's start ended (s).
SPARE_REPLACE_DELAY_S = 2.0
#: The longest wait before a failed spare is replaced (s); also how long a spare must stay up to
#: count as healthy (the backoff starts again from 1 s).
SPARE_BACKOFF_MAX_S = 60.0
#: How a spare is named where a model's name would be (logs, memory figures).
SPARE_NAME = "(spare)"


def worker_command(model: ModelConfig | None, endpoint: str, module: str | None = None,
                   auth_fd: int | None = None) -> list[str]:
    """The exact command line (argument list, no shell) of ``model``'s worker, or of a warm
    spare when ``model`` is None. ``auth_fd`` is the inherited pipe with its credentials (only
    the descriptor's number is here)."""
    cmd = [sys.executable, "-m", module or os.environ.get(WORKER_MODULE_ENV) or "worker"]
    cmd += ["--spare"] if model is None else option_args(model)
    cmd += ["--endpoint", endpoint, "--parent-pid", str(os.getpid())]
    if auth_fd is not None:
        cmd += ["--auth-fd", str(auth_fd)]
    return cmd


def local_cores() -> int:
    """Cores this process may run on (its CPU affinity), >= 1."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class LocalHandle(WorkerHandle):
    """A child process (``subprocess.Popen``) of the router; psutil for its memory and children."""

    host = "localhost"

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        try:
            self._ps: psutil.Process | None = psutil.Process(proc.pid)
        except psutil.Error:
            self._ps = None
        self._code: int | None = None
        self._callbacks: list[Callable[[int], None]] = []
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def alive(self) -> bool:
        return self._code is None and self._proc.returncode is None

    def kill(self) -> None:
        if self._proc.returncode is None:
            try:
                self._proc.kill()
            except OSError:
                pass

    def on_exit(self, callback: Callable[[int], None]) -> None:
        loop = asyncio.get_running_loop()
        if self._code is not None:
            loop.call_soon(callback, self._code)
            return
        self._callbacks.append(callback)
        if self._watcher is None:  # a thread blocked in Popen.wait: the exit is known at once
            self._watcher = threading.Thread(target=self._wait, args=(loop,), daemon=True,
                                             name=f"worker-wait-{self._proc.pid}")
            self._watcher.start()

    def _wait(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self._proc.wait()
        try:
            loop.call_soon_threadsafe(self._exited, code)
        except RuntimeError:  # loop closed: the router is going away
            pass

    def _exited(self, code: int) -> None:
        self._code = code
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(code)
            except Exception:  # pragma: no cover - a bug in a callback must not stop the others
                log.exception("worker exit callback failed")

    def rss_bytes(self) -> int | None:
        try:
            return int(self._ps.memory_info().rss) if self._ps is not None and self.alive() else None
        except (psutil.Error, OSError):
            return None

    def is_own(self, pid: int) -> bool:
        if pid == self._proc.pid:
            return True
        try:
            return any(c.pid == pid for c in psutil.Process(self._proc.pid).children(recursive=True))
        except psutil.Error:
            return False


class LocalLauncher(Launcher):
    """Workers as children of this router (see the module docstring).

    Args:
        server: ``[server]``: ``transport`` (ipc or tcp endpoints) and ``warm_spare``.
        ctx: the pool's ZeroMQ context (a spare's connection binds in it).
        curve: the service's CURVE keypair (tcp), else None.
        module: the worker module (``python -m MODULE``); None: ``$MODELYARD_WORKER_MODULE`` or ``worker``.
    """

    host = "localhost"

    def __init__(self, server: ServerConfig, *, ctx: zmq.asyncio.Context, curve: CurveKeypair | None = None,
                 module: str | None = None) -> None:
        self.transport = server.transport
        self.module = module
        # ipc sockets: a private directory named after this router (stale ones of dead routers are swept)
        self.socket_dir: Path | None = make_socket_dir() if self.transport == "ipc" else None
        self._endpoints = 0
        self._ctx = ctx
        self._curve = curve
        self.warm_spare = server.warm_spare
        self._spare: WorkerProcess | None = None  # started, not taken (warming or warm)
        self._spare_task: asyncio.Task[None] | None = None  # a spare's start waiting for its delay (backoff)
        self._spare_since = 0.0  # monotonic s the current spare said Hello
        self._spare_failures = 0  # consecutive spares that died or never said Hello
        self._retry_at: float | None = None  # monotonic s the next spare starts (backoff)
        self._closing = False
        self.spares_started = 0
        self.spares_taken = 0
        self.spare_last_error: str | None = None

    # ------------------------------------------------------------------ Launcher

    def endpoint(self) -> str:
        self._endpoints += 1
        if self.transport == "tcp":
            return "tcp://127.0.0.1:0"
        assert self.socket_dir is not None
        return f"ipc://{self.socket_dir}/w{self._endpoints}.sock"

    async def start(self, model: ModelConfig | None, endpoint: str, credentials: WorkerCredentials) -> Launched:
        auth_fd = write_credentials(credentials)
        try:
            cmd = worker_command(model, endpoint, self.module, auth_fd)
            log.info("spawning %s: %s", f"worker for {model.name}" if model is not None else "a warm spare",
                     " ".join(cmd))
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(auth_fd,))
        except OSError as e:
            raise LaunchError(f"cannot spawn worker: {e}") from None
        finally:
            os.close(auth_fd)  # the child has its copy; no other process gets one
        return Launched(endpoint, credentials, LocalHandle(proc), tuple(cmd))

    def cores(self) -> int:
        return local_cores()

    def available(self) -> int:
        return int(psutil.virtual_memory().available)

    def rss(self, pid: int | None, model: str) -> int | None:
        if pid is None:
            return None
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except (psutil.Error, OSError):
            return None

    # ------------------------------------------------------------------ warm spare

    def begin(self) -> None:
        if self.warm_spare:
            self._want_spare(0.0)

    def spare_pid(self) -> int | None:
        """The pid of the spare :meth:`take_spare` would hand out now (warm), else None."""
        wp = self._spare
        return wp.pid if wp is not None and wp.warm and wp.alive else None

    def take_spare(self, model: ModelConfig) -> WorkerProcess | None:
        wp = self._spare
        if wp is None or not wp.warm or not wp.alive or self._closing:
            return None
        self._spare = None
        self.spares_taken += 1
        self._spare_failures = 0
        wp.adopt(model)
        log.info("model %s: takes the warm spare (pid %s)", model.name, wp.pid)

        async def replace() -> None:
            await wp.start_ended.wait()
            self._want_spare(SPARE_REPLACE_DELAY_S)

        asyncio.get_running_loop().create_task(replace(), name="spare-replace")
        return wp

    def describe_spare(self) -> dict[str, Any]:
        wp = self._spare
        now = time.monotonic()
        if not self.warm_spare:
            state = "off"
        elif self._closing:
            state = "stopped"
        elif wp is not None:
            state = "warm" if wp.warm else "starting"
        elif self._spare_failures > 0:
            state = "backoff"  # the last one failed: the next starts at retry_in_s
        else:
            state = "pending"  # the last one was taken: the next starts once that load has ended
        live = wp is not None and wp.alive
        return {"enabled": self.warm_spare, "state": state, "pid": wp.pid if live and wp is not None else None,
                "rss_bytes": (self.rss(wp.pid, SPARE_NAME) if live and wp is not None else None),
                "started": self.spares_started, "taken": self.spares_taken,
                "consecutive_failures": self._spare_failures,
                "retry_in_s": (round(max(0.0, self._retry_at - now), 3)
                               if wp is None and self._retry_at is not None else None),
                "last_error": self.spare_last_error}

    def _want_spare(self, delay_s: float) -> None:
        """Start a spare after ``delay_s`` seconds unless one exists or is on its way."""
        if self._closing or not self.warm_spare or self._spare is not None:
            return
        if self._spare_task is not None and not self._spare_task.done():
            return
        self._retry_at = time.monotonic() + delay_s
        self._spare_task = asyncio.get_running_loop().create_task(self._start_spare(delay_s), name="spare-start")

    async def _start_spare(self, delay_s: float) -> None:
        from router.workers.process import WorkerProcess  # the connection (it imports this package)

        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if self._closing or self._spare is not None:
            return
        self._retry_at = None
        self._spare_task = None  # from here the spare itself says it is on its way
        wp = WorkerProcess(None, self._ctx, self, curve_server=self._curve)
        self._spare = wp
        self.spares_started += 1
        wp.on_exit(self._spare_exited)
        try:
            warm = await wp.start_spare(SPARE_START_TIMEOUT_S)
        except asyncio.CancelledError:
            wp.kill("router shutting down")
            raise
        if warm:
            self._spare_since = time.monotonic()
            log.info("warm spare ready (pid %s, %s)", wp.pid, _mib(self.rss(wp.pid, SPARE_NAME)))
        elif self._spare is wp:  # not taken, not gone: no Hello within the bound, or it never started
            if wp.pid is None:  # never started: no exit will be reported
                self._spare_failed(wp, wp.kill_reason or "could not start")
            else:  # its exit is reported (_spare_exited replaces it)
                wp.kill(f"no Hello within {SPARE_START_TIMEOUT_S:g} s")

    def _spare_exited(self, wp: WorkerProcess) -> None:
        if wp is self._spare:  # taken ones are their model's
            self._spare_failed(wp, wp.exit_description())

    def _spare_failed(self, wp: WorkerProcess, why: str) -> None:
        self._spare = None
        if self._closing:
            return
        if self._spare_since and time.monotonic() - self._spare_since >= SPARE_BACKOFF_MAX_S:
            self._spare_failures = 0  # it had been up long enough: a fresh failure, not a streak
        self._spare_since = 0.0
        self._spare_failures += 1
        self.spare_last_error = why
        delay = min(2.0 ** (self._spare_failures - 1), SPARE_BACKOFF_MAX_S)
        log.warning("warm spare (pid %s) is gone: %s; another starts in %.0f s (failure %d in a row)",
                    wp.pid, why, delay, self._spare_failures)
        self._want_spare(delay)

    async def close(self) -> None:
        self._closing = True
        if self._spare_task is not None:
            self._spare_task.cancel()
        wp, self._spare = self._spare, None
        if wp is not None:
            await wp.stop(2.0)
        if self.socket_dir is not None:
            remove_socket_dir(self.socket_dir)


def _mib(n: int | None) -> str:
    return "RSS unknown" if n is None else f"{n / 2**20:.0f} MiB RSS"


__all__ = ["LocalHandle", "LocalLauncher", "SPARE_NAME", "WORKER_MODULE_ENV", "local_cores", "worker_command"]
