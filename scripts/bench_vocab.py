#!/usr/bin/env python3
"""What the GGUF metadata and the tokenizer keep in memory, by attribute, and how long they take.

    .venv/bin/python scripts/bench_vocab.py [--model smollm2|gemma3|PATH] [--repeat 3]

In one fresh process: the resident set (``/proc/self/smaps_rollup`` Rss and Anonymous, MiB) and
tracemalloc's traced Python allocations after ``read_gguf`` and after ``Tokenizer.from_metadata``
(plus ``malloc_trim``, as ``Engine.load`` does; tracemalloc off), then the deep size of each large metadata value and
each tokenizer attribute (``sys.getsizeof`` over containers, numpy ``nbytes``; an object shared by two
attributes is counted in the first only, so the metadata's values shared with the tokenizer show
under the metadata), and the tokenizer fingerprint; then tracemalloc's traced total after the two steps of a second load (its
own bookkeeping inflates the resident set, so it is not on during the first). ``--repeat`` times the two steps again without
tracemalloc (best of N, seconds), which is what the load's ``reading_gguf`` / ``building_tokenizer``
stages cost.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}


def rollup() -> tuple[float, float]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            p = line.split()
            if len(p) >= 3 and p[-1] == "kB":
                out[p[0].rstrip(":")] = int(p[1]) / 1024
    return out["Rss"], out.get("Anonymous", 0.0)


def deep_size(obj: object, seen: set[int]) -> int:
    """Bytes of ``obj`` and what it references (containers, numpy buffers), each object once."""
    import numpy as np

    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += sys.getsizeof(o)  # includes the data when the array owns it
            if o.base is not None:
                stack.append(o.base)
            continue
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and type(o).__module__.startswith("worker"):
            stack.extend(vars(o).values())
        elif hasattr(type(o), "__slots__") and type(o).__module__.startswith("worker"):
            stack.extend(getattr(o, s) for s in type(o).__slots__ if hasattr(o, s))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    path = Path(a.model) if a.model not in MODELS else ROOT / "models" / MODELS[a.model]

    from worker.engine.loading import resident
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.text.tokenizer import Tokenizer
    import tokenizers  # noqa: F401  (imported before the first mark: its code is not the vocabulary)

    gc.collect()
    resident.trim_heap()
    r0 = rollup()
    g = read_gguf(str(path))
    r1 = rollup()
    tok = Tokenizer.from_metadata(g.metadata)
    gc.collect()
    resident.trim_heap()
    r2 = rollup()
    mib = 2.0 ** 20
    print(f"{path.name}: n_vocab {tok.n_vocab}, model {tok.model}")
    print(f"  read_gguf:             rss {r1[0] - r0[0]:+7.1f}  anon {r1[1] - r0[1]:+7.1f} MiB")
    print(f"  + Tokenizer (trimmed): rss {r2[0] - r0[0]:+7.1f}  anon {r2[1] - r0[1]:+7.1f} MiB")

    seen: set[int] = set()
    rows = []
    for k, v in g.metadata.items():
        s = deep_size(v, seen)
        if s > 64 << 10:
            rows.append((f"metadata[{k!r}]", s))
    for k, v in vars(tok).items():
        s = deep_size(v, seen)
        if s > 64 << 10:
            rows.append((f"tokenizer.{k}", s))
    for name, s in rows:
        print(f"  {name:45s} {s / mib:7.2f} MiB")
    print(f"  fingerprint {tok.fingerprint}")

    del tok
    g.close()
    del g
    gc.collect()
    tracemalloc.start()
    g = read_gguf(str(path))
    t1 = tracemalloc.get_traced_memory()[0]
    tok = Tokenizer.from_metadata(g.metadata)
    gc.collect()
    t2 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"  tracemalloc: read_gguf {t1 / mib:.1f} MiB, + Tokenizer {t2 / mib:.1f} MiB")
    del tok
    g.close()
    del g
    gc.collect()
    best_r = best_t = float("inf")
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        g = read_gguf(str(path))
        t1p = time.perf_counter()
        tok = Tokenizer.from_metadata(g.metadata)
        t2p = time.perf_counter()
        best_r, best_t = min(best_r, t1p - t0), min(best_t, t2p - t1p)
        del tok
        g.close()
        del g
        gc.collect()
    if a.repeat:
        print(f"  time (best of {a.repeat}): read_gguf {best_r:.3f} s, Tokenizer.from_metadata {best_t:.3f} s")


if __name__ == "__main__":
    main()
