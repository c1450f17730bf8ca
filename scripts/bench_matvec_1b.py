#!/usr/bin/env python3
"""Each quantized matvec of a bench model's decode step timed alone, at 1 and 2 threads, as GB/s of
weights read: splits "a kernel below the memory bandwidth" from "overhead between kernels".

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_matvec_1b.py [--model llama-1b-Q4_K_M] [--reps 20]

Per weight name (``wqkv``, ``wo``, ``wgu``, ``wdown``, and ``output``) the matmul of one activation
row (``QWeight.matmul`` / ``QConcat.matmul``, as the decode step calls it) runs over every layer's
matrix in turn (so the weights come from DRAM, not the caches: 16 layers are far beyond the L3),
``--reps`` times; the figure is the best pass's bytes / seconds. Also prints the same for the whole
set of a step's matvecs back to back (the bound a step's weight traffic alone sets) and numpy's
streaming read of an array as big (the machine's bandwidth).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def best_pass(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b-Q4_K_M")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    from make_bench_models import ensure

    from worker.engine.arch.registry import load_model
    from worker.engine.kernels import quant
    from worker.engine.loading.gguf_loader import read_gguf

    shape, qtype = a.model.rsplit("-", 1)            # llama-1b-Q4_K_M -> llama-1b, Q4_K_M
    m = load_model(read_gguf(str(ensure(shape, qtype))), n_ctx=64, weights="quantized")
    names = ("wqkv", "wo", "wgu", "wdown")
    idx = {"wqkv": 1, "wo": 2, "wgu": 4, "wdown": 5}
    rng = np.random.default_rng(0)
    groups = {n: [layer[idx[n]] for layer in m.layers] for n in names}
    out_w = m.w["output"] if "output" in m.w else m.w["tok_embd"]
    groups["output"] = [out_w]
    xs = {n: rng.standard_normal((1, ws[0].shape[1])).astype(np.float32) for n, ws in groups.items()}
    big = np.ones(sum(int(w.nbytes) for ws in groups.values() for w in ws) // 4, np.float32)
    for nt in (1, 2):
        quant.use_threads(nt)
        total_b = total_s = 0.0
        for n, ws in groups.items():
            x = xs[n]
            nb = sum(int(w.nbytes) for w in ws)
            kinds = sorted({getattr(p, "kind", "f32") for w in ws for p in getattr(w, "parts", [w])})

            def run(ws=ws, x=x):
                for w in ws:
                    w.matmul(x)
            run()
            s = best_pass(run, a.reps if n != "output" else max(5, a.reps // 2))
            total_b += nb
            total_s += s
            print(f"threads {nt}  {n:<7} {len(ws):>2} x {list(ws[0].shape)!s:<14} {'/'.join(kinds):<10} "
                  f"{nb / len(ws) / 2**20:7.2f} MiB each  {1e3 * s / len(ws):7.3f} ms each  {nb / s / 1e9:6.1f} GB/s")
        print(f"threads {nt}  all matvecs of a step: {total_b / 2**20:.0f} MiB in {1e3 * total_s:.2f} ms  "
              f"-> {total_b / total_s / 1e9:.1f} GB/s, {1 / total_s:.1f} tok/s if nothing else ran")
    s = best_pass(lambda: big.sum(), 5)
    print(f"numpy read of {big.nbytes / 2**20:.0f} MiB (np.sum, 1 thread): {big.nbytes / s / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
