"""What a loaded worker keeps resident that it no longer needs, given back after the load.

Two kinds of memory stay in a process's resident set (RSS) after ``Engine.load`` without being
used again:

* **clean pages of a mapped shared library** that only the load ran. numba's JIT is llvmlite's
  ``libllvmlite.so`` (LLVM, ~170 MB on disk); importing numba and loading the cached kernels
  touches ~105 MiB of its code and read-only data (LLVM's static initializers and the kernels'
  linking), but running the loaded kernels calls none of it. :func:`drop_clean_file_pages`
  unmaps those pages from this process with ``madvise(MADV_DONTNEED)``: they stay in the page
  cache, and a later use (e.g. a kernel compiled at run time) faults them back in from it. Only
  read-only mappings that hold no private (copy-on-write) page are touched, so no byte of the
  process's state is lost.
* **freed heap memory glibc keeps** in its arenas (temporaries of the float32 dequantization,
  the GGUF metadata's parsing): :func:`trim_heap` (``malloc_trim(0)``) returns it to the OS.

Both are Linux/glibc facilities; elsewhere the functions do nothing and return 0 / False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

__all__ = ["drop_clean_file_pages", "trim_heap"]

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = None
    return _libc


def _mappings(smaps: str) -> list[tuple[int, int, str, str, int, int]]:
    """``(start, end, perms, path, rss_kib, anonymous_kib)`` per mapping of a ``/proc/PID/smaps`` text."""
    out: list[tuple[int, int, str, str, int, int]] = []
    cur: list = []
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and not head[0].endswith(":"):
            if cur:
                out.append(tuple(cur))  # type: ignore[arg-type]
            lo, hi = head[0].split("-")
            cur = [int(lo, 16), int(hi, 16), head[1], head[5].strip() if len(head) > 5 else "", 0, 0]
        elif cur and head and head[0] in ("Rss:", "Anonymous:"):
            cur[4 if head[0] == "Rss:" else 5] = int(head[1])
    if cur:
        out.append(tuple(cur))  # type: ignore[arg-type]
    return out


def drop_clean_file_pages(name: str) -> int:
    """Unmap from this process the resident pages of every read-only, never-written mapping of a
    file whose path contains ``name`` (e.g. ``"libllvmlite"``), with ``madvise(MADV_DONTNEED)``.

    A mapping is skipped when it is writable or holds any anonymous (copy-on-write) page, such as
    a library's relocated data: dropping those would lose their contents. The pages dropped stay
    in the page cache; touching them again maps them back (a minor fault each).

    Returns: the bytes that were resident in the mappings dropped (0 when none, or not on Linux).
    """
    libc = _c()
    if libc is None:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            maps = _mappings(f.read())
    except OSError:
        return 0
    dropped = 0
    for start, end, perms, path, rss_kib, anon_kib in maps:
        if name not in path or "w" in perms or anon_kib or not rss_kib:
            continue
        if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped += rss_kib * 1024
    return dropped


def trim_heap() -> bool:
    """Return the free memory at the top of glibc's heaps and in its arenas to the OS
    (``malloc_trim(0)``). True when glibc released some; False when none or not glibc."""
    libc = _c()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except AttributeError:  # not glibc
        return False
