"""A warm spare: a worker started before anyone knows which model it will serve.

``python -m worker --spare --endpoint EP [--auth-fd FD] [--parent-pid PID]`` does everything a
worker does before it knows its model — the interpreter's start, the imports (NumPy, the engine,
the socket loop) and the numba kernels that do not depend on a file (:func:`warm_up`) — then
connects, says Hello with ``model`` "" and waits (:func:`wait_for_model`). The router's launcher
keeps one such process (``router.workers.launchers.local``); the first model to load takes it and
sends ``Assign`` with the model's options. From there it is an ordinary worker: it loads the
model (lazily, on that first use, never before), sends LoadProgress and Ready, and serves
(``worker.server.WorkerServer.serve`` on the same socket, so the router's connection and the
proof of its credentials carry over).

While waiting it answers Ping with a Pong (``busy`` false, no slots) and every other request with
Error "busy" ("no model assigned yet"); Shutdown, SIGTERM or its parent's end make it exit 0.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time

import zmq

from protocol import (
    Assign, Cancel, Error, Hello, Message, Ping, Pong, ProtocolError, Shutdown, WorkerCredentials, decode,
    encode,
)
from protocol.errors import ErrorCode

log = logging.getLogger("modelyard.worker")

#: Modules a model's load imports lazily (measured: what ``sys.modules`` gains during a first
#: ``Engine.load`` of SmolLM2 and Gemma 3 after the imports above; ~0.15 s on a busy machine).
LOAD_IMPORTS = ("tokenizers", "jinja2.ext", "encodings.unicode_escape")


def warm_up(kernels: bool = True) -> float:
    """Import what a load needs and load every quantized kernel (``worker.engine.compile_kernels``:
    numba's import, the file-independent kernels and the matmuls of every weight type, from
    numba's on-disk cache; ``kernels`` False: the imports only). Returns the seconds it took.
    Never raises: a kernel that cannot be loaded now is loaded (or reported) by the model's
    load, as without a spare. Measured: ~1.2 s of imports and ~2.5 s of kernels on a busy
    2-core machine with a current numba cache (a stale one, after a kernel source changed,
    compiles every type: minutes); the spare then holds ~210 MiB (the matmuls of every type cost
    ~4 MiB more than the file-independent kernels alone; tokenizers and the architectures ~45 MiB,
    which the model's load would import anyway)."""
    t0 = time.monotonic()
    import numpy  # noqa: F401  - the imports are the point

    import worker.server  # noqa: F401
    from worker import engine

    for name in LOAD_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError as e:  # the load imports (or reports) it itself
            log.warning("spare: cannot import %s: %s", name, e)
    try:  # the architecture modules the registry imports on a model's first load
        from worker.engine.arch.registry import _register_builtin

        _register_builtin()
    except (ImportError, AttributeError) as e:
        log.warning("spare: cannot import the architectures (%s); the load will", e)

    if kernels:
        try:
            engine.compile_kernels(None)
        except Exception as e:  # noqa: BLE001 - the load does the work itself then
            log.warning("spare: kernel warm-up failed (%s: %s); the model's load will do it", type(e).__name__, e)
    return time.monotonic() - t0


class SpareWait:
    """The spare's socket loop before it has a model (main thread only).

    Args:
        endpoint: the router's ROUTER endpoint (``ipc://...`` or ``tcp://host:port``).
        credentials: the per-spawn secret (and CURVE keys) the router handed over, or None.
        watch: ``gone() -> bool`` of the process whose end ends this one (``ParentWatch``), or None.
        poll_ms: the longest socket poll, ms (bounds how late a parent's end or a signal is seen).
    """

    def __init__(self, endpoint: str, credentials: WorkerCredentials | None, watch: object | None = None,
                 poll_ms: int = 100) -> None:
        self.endpoint = endpoint
        self.credentials = credentials
        self.watch = watch
        self.poll_ms = poll_ms
        self.stop = threading.Event()  # set by a signal handler
        self.pid = os.getpid()

    def wait_for_model(self) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], Assign] | int:
        """Connect, say Hello (model ""), and wait. Returns (context, connected socket, the
        Assign) once a model is given, or the exit status (0: Shutdown, signal or parent gone;
        1: the endpoint cannot be connected)."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        creds = self.credentials
        if creds is not None and creds.curve:
            sock.curve_serverkey = str(creds.server_public).encode()
            sock.curve_publickey = str(creds.public).encode()
            sock.curve_secretkey = str(creds.secret_key).encode()
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            log.error("spare: cannot connect to %s: %s", self.endpoint, e)
            sock.close(linger=0)
            ctx.term()
            return 1
        self._send(sock, Hello(id=f"worker-{self.pid}", model="", pid=self.pid,
                               auth=creds.secret if creds is not None else ""))
        log.info("spare worker %s: warm, waiting for a model", self.pid)
        next_check = 0.0
        while True:
            if self.stop.is_set():
                return self._leave(ctx, sock, "stop requested (signal)", 1000)
            now = time.monotonic()
            if self.watch is not None and now >= next_check:
                next_check = now + 0.2
                if self.watch.gone():  # type: ignore[attr-defined]
                    return self._leave(ctx, sock, "parent process is gone", 0)
            if not sock.poll(self.poll_ms, zmq.POLLIN):
                continue
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(parts) != 1:
                continue
            try:
                msg = decode(parts[0])
            except ProtocolError as e:
                self._send(sock, Error(id=e.msg_id or "unknown", code=ErrorCode.PROTOCOL_ERROR, message=e.reason))
                continue
            if isinstance(msg, Assign):
                log.info("spare worker %s: assigned %s (%s)", self.pid, msg.model, msg.gguf)
                return ctx, sock, msg
            if isinstance(msg, Shutdown):
                return self._leave(ctx, sock, "Shutdown received", 1000)
            self._answer_waiting(sock, msg)

    def _answer_waiting(self, sock: zmq.Socket[bytes], msg: Message) -> None:
        if isinstance(msg, Ping):
            self._send(sock, Pong(id=msg.id, busy=False, queue_len=0, pid=self.pid))
        elif isinstance(msg, Cancel):
            return  # nothing runs here
        else:
            self._send(sock, Error(id=msg.id, code=ErrorCode.BUSY,
                                   message=f"this worker has no model yet: {msg.TYPE} needs one (Assign first)"))

    def _leave(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], why: str, linger_ms: int) -> int:
        log.info("spare worker %s exits: %s", self.pid, why)
        sock.close(linger=linger_ms)
        ctx.term()
        return 0

    @staticmethod
    def _send(sock: zmq.Socket[bytes], msg: Message) -> None:
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("spare: cannot send %s: %s", msg.TYPE, e)
