"""The Ray launcher's remote half: a Ray actor that starts one worker process on its node.

Ray places the actor (:class:`WorkerHost`) on a node that has the resources the model asks for;
the actor then starts ``python -m worker`` there as its own child, exactly as the local launcher
does on the router's host: in its own session, stdin closed, its credentials on an inherited
pipe (``--auth-fd``; never on the command line or in the environment), ``--parent-pid`` the
actor's pid (so the worker exits within ~0.2 s of the actor, whether the actor was killed by the
router, by Ray, or lost with its node). The worker then connects to the router's tcp endpoint
itself: ZeroMQ with CURVE stays the data plane, Ray only places and starts.

The credentials reach the actor as an argument of :meth:`WorkerHost.start`, i.e. through Ray's
own channel between the router (the Ray driver) and the node: run Ray with TLS
(``RAY_USE_TLS``) on a network you do not trust (docs/operations.md).

This module runs inside the actor on the worker's node: it imports the standard library,
psutil and ``protocol`` (Ray's runtime context only inside :meth:`WorkerHost.start`; never the
router's app or numpy), so that placing the actor costs little more than its interpreter.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import psutil

from protocol import WorkerCredentials, write_credentials


class WorkerHost:
    """One worker process on this node (the actor's state). Methods are called through Ray;
    :meth:`wait` blocks, so the actor runs with a few threads (``max_concurrency``).

    Units: memory in bytes; exit codes as ``subprocess`` reports them (negative: the signal).
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, module: str, args: list[str], credentials: bytes) -> dict[str, Any]:
        """Start ``python -m module *args --parent-pid <this actor> --auth-fd N`` with this node's
        interpreter. Returns ``{"pid", "host", "node_id", "command"}``. Raises OSError if it
        cannot start and RuntimeError when this actor already started one."""
        import ray  # inside the actor: Ray is there by definition

        if self._proc is not None:
            raise RuntimeError("this WorkerHost already started its worker")
        fd = write_credentials(WorkerCredentials.from_bytes(credentials))
        cmd = [sys.executable, "-m", module, *args, "--parent-pid", str(os.getpid()), "--auth-fd", str(fd)]
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(fd,))
        finally:
            os.close(fd)
        return {"pid": self._proc.pid, "host": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(), "command": cmd}

    def wait(self) -> int:
        """Block until the worker exits; its exit code."""
        assert self._proc is not None
        return self._proc.wait()

    def kill(self) -> None:
        """SIGKILL the worker (no-op once it exited)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.kill()
            except OSError:
                pass

    def status(self) -> dict[str, Any]:
        """``{"rss_bytes": int | None, "pids": [the worker's pid and its descendants']}`` now
        (``rss_bytes`` None and ``pids`` empty once it has exited)."""
        if self._proc is None or self._proc.poll() is not None:
            return {"rss_bytes": None, "pids": []}
        try:
            ps = psutil.Process(self._proc.pid)
            return {"rss_bytes": int(ps.memory_info().rss),
                    "pids": [self._proc.pid, *(c.pid for c in ps.children(recursive=True))]}
        except (psutil.Error, OSError):
            return {"rss_bytes": None, "pids": [self._proc.pid]}


def node_memory_available() -> int:
    """This node's available memory now (psutil), bytes: what placement may still use there."""
    return int(psutil.virtual_memory().available)


__all__ = ["WorkerHost", "node_memory_available"]
