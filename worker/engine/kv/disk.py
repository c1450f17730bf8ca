"""Caches that survive: a directory of KV state files for one model, within a disk budget.

When a worker stops (unload, eviction, service stop) its most valuable idle KV
entries — most recently used first, skipping any that another saved one
extends — are written here (``worker.engine.kv.state`` format, atomically, one
file each, named by a digest of identity and tokens), and the oldest files are
pruned until the directory fits ``budget_bytes``. When the model loads again,
:meth:`DiskCache.scan` reads only each file's header and token ids (files of
another identity are never used, only counted in the budget and pruned by age);
:meth:`DiskCache.lookup` then tells, for a
prompt, which file holds a longer prefix of it than the KV already does, and
:meth:`DiskCache.load` reads and fully validates that file (a corrupt one is
deleted and never loaded). Restoring is thus lazy: the first request that
matches a saved prefix pays a disk read instead of a prefill.

Thread-safe (one lock): the worker looks up and loads on its prep thread and
saves on its engine thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .state import KVIdentity, KVState, KVStateError, encode_state, read_state_file, read_state_tokens, \
    write_state_file

log = logging.getLogger("modelyard.worker")

__all__ = ["DiskCache", "SUFFIX"]

SUFFIX = ".kvstate"
#: A saved prefix shorter than this (and than half the prompt) is not worth a disk read.
MIN_DISK_PREFIX = 16


@dataclass
class _File:
    path: Path
    tokens: list[int]
    size: int
    mtime: float
    usable: bool = True  # False: a state of another identity (counted in the budget, pruned by age)


class DiskCache:
    """KV states of one model identity in ``directory`` (created if absent), at most
    ``budget_bytes`` of files in all (>= 0; 0 saves nothing)."""

    def __init__(self, directory: str | Path, budget_bytes: int, identity: KVIdentity) -> None:
        self.dir = Path(directory)
        self.budget = max(0, int(budget_bytes))
        self.identity = identity
        self._files: dict[str, _File] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading

    def scan(self) -> int:
        """Index every readable state (header and tokens only); how many are of this identity."""
        self.dir.mkdir(parents=True, exist_ok=True)
        found: dict[str, _File] = {}
        for p in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                ident, tokens, size = read_state_tokens(p)
                mtime = p.stat().st_mtime
            except (KVStateError, OSError) as e:
                log.warning("KV cache %s: skipping %s: %s", self.dir, p.name, e)
                continue
            diff = ident.differences(self.identity)
            if diff:
                log.info("KV cache %s: %s is of another identity (%s differs); not used", self.dir, p.name,
                         ", ".join(d[0] for d in diff))
            found[p.name] = _File(p, tokens, size, mtime, usable=not diff)
        with self._lock:
            self._files = found
        return sum(f.usable for f in found.values())

    @property
    def files(self) -> int:
        """Usable states indexed."""
        with self._lock:
            return sum(f.usable for f in self._files.values())

    def lookup(self, ids: Sequence[int], have: int) -> Path | None:
        """The file holding the longest prefix of ``ids`` (at most all but the last token) when
        it beats ``have`` (what the KV already holds) and is worth reading, else None."""
        limit = len(ids) - 1
        best, best_n = None, have
        with self._lock:
            files = [f for f in self._files.values() if f.usable]
        for f in files:
            n = _common(f.tokens, ids, limit)
            if n > best_n and (n >= MIN_DISK_PREFIX or 2 * n >= len(ids)):
                best, best_n = f.path, n
        return best

    def load(self, path: Path) -> tuple[KVState, int]:
        """``(state, bytes read)``, fully validated. A file that fails is deleted and forgotten.

        Raises: KVStateError.
        """
        try:
            state, n = read_state_file(path, self.identity)
        except KVStateError as e:
            log.warning("KV cache %s: %s refused (%s); deleting it", self.dir, path.name, e.message)
            self._forget(path, delete=True)
            raise
        try:
            os.utime(path)  # recently used: pruned last
        except OSError:
            pass
        return state, n

    # ------------------------------------------------------------------ writing

    def save(self, states: Sequence[KVState], deadline: float | None = None) -> tuple[int, int]:
        """Write ``states`` (most valuable first) within the budget, then prune the directory
        to the budget (oldest first; files another kept file extends go first of all).
        ``deadline`` (time.monotonic()): stop writing new files after it. Returns
        ``(files written, bytes written)``; a file that cannot be written is skipped (logged).
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        chosen: list[KVState] = []
        for st in states:
            if st.n_tokens == 0 or any(_extends(c.tokens, st.tokens) for c in chosen):
                continue
            chosen.append(st)
        used, written, n_bytes = 0, 0, 0
        now = time.time()
        for rank, st in enumerate(chosen):
            size = 16 + 1024 + 64 + 4 * st.n_tokens + st.n_tokens * st.identity.token_bytes  # header ~1 KiB
            if used + size > self.budget:
                continue
            if deadline is not None and time.monotonic() > deadline:
                log.warning("KV cache %s: out of time; %d states not saved", self.dir, len(chosen) - rank)
                break
            name = self._name(st.tokens)
            path = self.dir / name
            with self._lock:
                known = self._files.get(name)
            try:
                if known is None:
                    n = write_state_file(path, encode_state(st.identity, st.tokens, st.k, st.v))
                    written += 1
                    n_bytes += n
                else:
                    n = known.size
                mtime = now - rank * 1e-3  # most valuable = newest
                os.utime(path, (mtime, mtime))
            except OSError as e:
                log.warning("KV cache %s: cannot write %s: %s", self.dir, name, e)
                continue
            used += n
            with self._lock:
                self._files[name] = _File(path, list(st.tokens), n, mtime)
        self._prune()
        return written, n_bytes

    def _prune(self) -> None:
        with self._lock:
            files = sorted(self._files.values(), key=lambda f: -f.mtime)
        keep: list[_File] = []
        used = 0
        for f in files:
            if used + f.size > self.budget or (f.usable and any(k.usable and _extends(k.tokens, f.tokens) for k in keep)):
                self._forget(f.path, delete=True)
                continue
            keep.append(f)
            used += f.size

    def _forget(self, path: Path, delete: bool) -> None:
        with self._lock:
            self._files.pop(path.name, None)
        if delete:
            try:
                path.unlink()
            except OSError:
                pass

    def _name(self, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(repr(sorted(self.identity.to_json().items())).encode())
        h.update(np.asarray(tokens, dtype="<i4").tobytes())
        return h.hexdigest()[:40] + SUFFIX


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    limit = min(limit, len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _extends(longer: Sequence[int], shorter: Sequence[int]) -> bool:
    """True when ``shorter`` is a prefix of ``longer`` (and not the same length)."""
    return len(longer) > len(shorter) and list(longer[:len(shorter)]) == list(shorter)
