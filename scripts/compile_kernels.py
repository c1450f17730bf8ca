#!/usr/bin/env python3
"""Compile the quantized path's numba kernels into numba's disk cache, so that no load compiles.

numba keeps compiled kernels in ``__pycache__`` beside ``worker/engine/kernels/*_kernels.py`` (or in
``NUMBA_CACHE_DIR``), keyed by each source file's size and mtime: a fresh checkout (or a changed
kernel file) starts with nothing there, and the first ``weights = "quantized"`` load then compiles
every kernel signature it runs (~30 s of one core here) — on a model's first request, since
models load lazily. This compiles the same set for every weight type with a kernel
(``worker.engine.compile_kernels``) ahead of time; with a current cache it only loads them.

``scripts/_bootstrap.sh`` (``./scripts/serve``, ``./scripts/test``, CI) runs it when a
``worker/engine`` source or the install is newer than its stamp ``.venv/.modelyard-kernels`` (or
the stamp names another ``NUMBA_CACHE_DIR``); ``MODELYARD_COMPILE_KERNELS=0`` skips that (the first quantized load then
compiles). Run it by hand, e.g. in an image build, as ``.venv/bin/python scripts/compile_kernels.py``.

Prints one line: the time taken and how many signatures were compiled vs loaded from the cache.
Exit status 0 on success, 1 on failure (numba's error on stderr).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


#: Seconds between two progress lines while compiling.
PROGRESS_S = 15.0


def _counts(mods: tuple[object, ...]) -> tuple[int, int]:
    """(signatures compiled, loaded from the cache) so far, from numba's dispatcher stats."""
    hits = misses = 0
    for mod in mods:
        for obj in list(vars(mod).values()):
            stats = getattr(obj, "stats", None)
            if stats is not None and hasattr(stats, "cache_hits"):
                hits += sum(dict(stats.cache_hits).values())
                misses += sum(dict(stats.cache_misses).values())
    return misses, hits


def _ticker(t0: float, done: threading.Event) -> None:
    """A line every PROGRESS_S while compiling: a silent minute looks like a hang."""
    while not done.wait(PROGRESS_S):
        mods = tuple(m for m in (sys.modules.get("worker.engine.kernels.quant_kernels"),
                                 sys.modules.get("worker.engine.kernels.attn_kernels"),
                                 sys.modules.get("worker.engine.kernels.decode_kernels")) if m is not None)
        misses, hits = _counts(mods)
        print(f"[setup]   still compiling kernels: {time.perf_counter() - t0:.0f} s, {misses} signatures "
              f"compiled and {hits} loaded so far", flush=True)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    done = threading.Event()
    threading.Thread(target=_ticker, args=(t0, done), daemon=True).start()
    try:
        from worker.engine.kernels import attn_kernels, decode_kernels, quant_kernels
        from worker.engine import compile_kernels

        compile_kernels()
    except Exception:  # noqa: BLE001 - reported, exit status 1
        traceback.print_exc()
        print("[setup] compiling the quantized kernels FAILED (a quantized load will try again)", file=sys.stderr)
        return 1
    finally:
        done.set()
    misses, hits = _counts((quant_kernels, attn_kernels, decode_kernels))
    print(f"[setup] quantized kernels ready in {time.perf_counter() - t0:.1f} s "
          f"({misses} signatures compiled, {hits} loaded from numba's cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
