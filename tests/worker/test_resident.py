"""worker.engine.loading.resident: clean file pages dropped from the resident set, never a written one."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest

from worker.engine.loading import resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise")

PAGE = mmap.PAGESIZE


def mapping_kib(path: Path) -> tuple[int, int]:
    """(Rss, Anonymous) KiB of this process's mappings of ``path``."""
    with open("/proc/self/smaps") as f:
        maps = resident._mappings(f.read())
    rows = [m for m in maps if m[3] == str(path)]
    assert rows, f"{path} is not mapped"
    return sum(m[4] for m in rows), sum(m[5] for m in rows)


def test_mappings_parse_smaps_text() -> None:
    text = ("7f00-7f10 r-xp 00000000 08:01 12 /lib/libx.so\nSize: 64 kB\nRss: 40 kB\nAnonymous: 0 kB\n"
            "7f10-7f20 rw-p 00000000 00:00 0 \nRss: 8 kB\nAnonymous: 8 kB\n")
    assert resident._mappings(text) == [(0x7f00, 0x7f10, "r-xp", "/lib/libx.so", 40, 0),
                                       (0x7f10, 0x7f20, "rw-p", "", 8, 8)]


def test_clean_read_only_pages_are_dropped_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "lib-clean.bin"
    data = bytes(range(256)) * (64 * PAGE // 256)
    path.write_bytes(data)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        assert m[:] == data                                # every page touched
        assert mapping_kib(path)[0] >= 64 * PAGE // 1024
        assert resident.drop_clean_file_pages("lib-clean.bin") >= 64 * PAGE
        assert mapping_kib(path)[0] == 0
        assert m[:] == data                                # faulted back in from the file, same bytes
    finally:
        m.close()


def test_written_or_writable_mappings_are_kept(tmp_path: Path) -> None:
    """A private mapping with a written (copy-on-write) page, even made read-only afterwards the way
    a loader write-protects relocated data, keeps its pages and its contents."""
    path = tmp_path / "lib-dirty.bin"
    path.write_bytes(b"\0" * (4 * PAGE))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        m[0:5] = b"moved"                                  # a private copy of page 0
        m[PAGE:PAGE + 1]                                   # a clean page next to it
        assert resident.drop_clean_file_pages("lib-dirty.bin") == 0   # writable: untouched
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.mprotect(addr, 4 * PAGE, mmap.PROT_READ) == 0
        assert mapping_kib(path)[1] > 0                    # holds an anonymous page
        assert resident.drop_clean_file_pages("lib-dirty.bin") == 0
        assert m[0:5] == b"moved"
        libc.mprotect(addr, 4 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        m.close()
