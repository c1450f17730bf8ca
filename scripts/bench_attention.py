#!/usr/bin/env python3
"""Decode attention of the quantized path alone, in-process: one query row over ``n_past`` keys as
llama.cpp's CPU flash attention computes it (``attention.ggml_attention``: split-KV from 512 cells),
the kernel (``attn_kernels.fa_vec``) against its scalar reference (``tests/worker/attn_reference.py``'s
``fa_vec_ref``, the same bits),
measured alternately so that a change of the machine's load shows in both.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_attention.py [--n-past 256,1024,4096]
        [--shape 9,3,64] [--threads 1,2] [--rounds 7]

``--shape n_head,n_kv_head,head_dim`` (default SmolLM2's). Per n_past and thread count: each
kernel's best and median microseconds per call (one layer), nanoseconds per (key, query head),
and the median over rounds of each round's ratio ref / kernel. One JSON line each, with the load
average. K/V of one layer (float32 holding f16 values, as the KV cache) stay in the CPU caches
here: in a model's decode each layer's come from memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-past", default="256,1024,4096")
    ap.add_argument("--shape", default="9,3,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import numba
    import numpy as np

    from tests.worker.attn_reference import fa_vec_ref
    from worker.engine import attention as A
    from worker.engine.kernels import attn_kernels as ak

    n_head, n_kv, hd = (int(x) for x in a.shape.split(","))
    rng = np.random.default_rng(0)
    for n_past in (int(x) for x in a.n_past.split(",")):
        S = n_past + 1
        q = (rng.standard_normal((1, n_head, hd)) * 1.5).astype(np.float32)
        k = rng.standard_normal((n_kv, S, hd)).astype(np.float16).astype(np.float32)
        v = (rng.standard_normal((n_kv, S, hd)) * 0.5).astype(np.float16).astype(np.float32)
        mode, n_cells = A.ggml_fa_mode(1, S)
        args = (q, k, v, n_past, 0, 0, np.float32(1 / np.sqrt(hd)), np.float32(0), mode, n_cells,
                A.GGML_DECODE_THREADS)
        for threads in (int(x) for x in a.threads.split(",")):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            times: dict[str, list[float]] = {"kernel": [], "ref": []}
            outs = {}
            reps = max(3, 40000 // S)
            for _ in range(a.rounds):
                for name, fn in (("kernel", ak.fa_vec), ("ref", fa_vec_ref)):
                    out = np.empty((1, n_head * hd), np.float32)
                    fn(*args, out)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(*args, out)
                    times[name].append((time.perf_counter() - t0) / reps)
                    outs[name] = out
            row: dict = {"n_past": n_past, "shape": a.shape, "threads": numba.get_num_threads(), "mode": int(mode)}
            for name, ts in times.items():
                row[f"{name}_us"] = {"best": round(min(ts) * 1e6, 1), "median": round(statistics.median(ts) * 1e6, 1)}
                row[f"{name}_ns_per_key_head"] = round(min(ts) * 1e9 / (S * n_head), 2)
            row["ref/kernel"] = round(statistics.median(r / k_ for r, k_ in zip(times["ref"], times["kernel"])), 2)
            row["same_bits"] = bool(np.array_equal(outs["kernel"].view(np.uint32), outs["ref"].view(np.uint32)))
            row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
