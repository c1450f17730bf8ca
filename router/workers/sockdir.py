"""The private directory holding one router's ipc sockets, and the sweep of stale ones.

Every router's directory lives under one parent, :func:`socket_parent`:
``$XDG_RUNTIME_DIR/modelyard`` when that runtime directory is usable (a
directory owned by this user), else ``<tempdir>/modelyard-<uid>``. The parent
and each directory are private (mode 0700, owned by this user; a parent that
is a symlink or someone else's is never used — then a fresh ``mkdtemp`` is).

A directory's name says whose it is: ``<pid>-<create time, 1/100 s>-<random>``.
A router removes its own directory when it stops; one that was SIGKILLed
cannot, so at start (:func:`make_socket_dir`) every sibling whose owner is no
longer running is removed. "Running" means a process with that pid exists
*and* started at the recorded time — a pid reused by another process does not
keep a stale directory alive. Names that do not follow the pattern are left
alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger("modelyard.sockdir")

_NAME = re.compile(r"^(\d+)-(\d+)-[A-Za-z0-9_]+$")


def _create_stamp(pid: int) -> int | None:
    """The start time of process ``pid`` in 1/100 s (the kernel's tick), or None if gone."""
    try:
        return round(psutil.Process(pid).create_time() * 100)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:  # exists, but not ours to inspect: treat as alive with an unknown time
        return -1


def owner_alive(pid: int, stamp: int) -> bool:
    """Whether the process that made a directory named ``<pid>-<stamp>-...`` still runs."""
    if not psutil.pid_exists(pid):
        return False
    now = _create_stamp(pid)
    if now is None:
        return False
    if now == -1:
        return True
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        pass
    return abs(now - stamp) <= 1  # the same process (a reused pid starts later)


def _private_dir(path: Path) -> bool:
    """Create ``path`` (0700) if missing; True if it is a real directory owned by us, 0700."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    if stat.S_IMODE(st.st_mode) & 0o077:
        try:
            path.chmod(0o700)
        except OSError:
            return False
    return True


def socket_parent(env: dict[str, str] | None = None) -> Path | None:
    """The shared parent of every router's socket directory (created if needed),
    or None if no safe one is available."""
    e = os.environ if env is None else env
    runtime = e.get("XDG_RUNTIME_DIR", "")
    if runtime:
        try:
            st = os.stat(runtime)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                p = Path(runtime) / "modelyard"
                if _private_dir(p):
                    return p
        except OSError:
            pass
    p = Path(tempfile.gettempdir()) / f"modelyard-{os.getuid()}"
    return p if _private_dir(p) else None


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the socket directories under ``parent`` whose router is gone. Returns them."""
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = _NAME.match(d.name)
        if m is None:
            continue
        try:
            if not stat.S_ISDIR(d.lstat().st_mode):
                continue
        except OSError:
            continue
        if owner_alive(int(m.group(1)), int(m.group(2))):
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
            log.info("removed stale socket directory %s (its router is gone)", d)
    return removed


#: A socket path (``<dir>/w<n>.sock``) must fit ``sun_path`` (108 bytes on Linux, 104 on
#: macOS); this leaves room for the file name.
MAX_DIR_CHARS = 88


def make_socket_dir(env: dict[str, str] | None = None) -> Path:
    """This router's private socket directory, after sweeping stale siblings.
    A parent too long for socket paths falls back to ``/tmp/modelyard-<uid>``."""
    pid = os.getpid()
    stamp = _create_stamp(pid)
    name_len = len(f"/{pid}-{stamp}-") + 8
    parent = socket_parent(env)
    if parent is not None and len(str(parent)) + name_len > MAX_DIR_CHARS:
        short = Path("/tmp") / f"modelyard-{os.getuid()}"
        parent = short if os.path.isdir("/tmp") and _private_dir(short) else None
    if parent is None:  # no safe shared parent: a private temp dir as before (no sweep)
        return Path(tempfile.mkdtemp(prefix="modelyard-"))
    sweep_stale(parent)
    return Path(tempfile.mkdtemp(prefix=f"{pid}-{stamp if stamp and stamp > 0 else 0}-", dir=parent))


def remove_socket_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
