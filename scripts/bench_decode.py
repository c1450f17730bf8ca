#!/usr/bin/env python3
"""Single-stream decode in this process, taken apart: where a token's time goes and how many bytes
of weights per second the matmuls move.

    .venv/bin/python scripts/bench_decode.py [--gguf PATH | --shape llama-1b --qtype Q4_K_M]
        [--threads 1,2,2f] [--tokens 32] [--repeat 3] [--ctx 64] [--busy N]

Loads the model (``weights = "quantized"``, no weight cache unless ``--weight-cache``), feeds a
``--ctx``-token prompt, then decodes ``--tokens`` greedy tokens with ``Model.forward`` one at a
time, for each thread count in ``--threads`` in turn, alternating, ``--repeat`` rounds (best
round kept). A count N is the ceiling of the run-time choice (worker/engine/kernels/threadctl.py, as a
worker runs by default); ``Nf`` runs every pass on N threads (the choice off). Per thread count it prints one JSON line: wall ms per token, the matmuls' share
(every ``QWeight.matmul`` timed, grouped by matrix: qkv, wo, wgu, wdown, output) with each
group's GB/s of weight bytes, the rest (norms, RoPE, attention, Python) as ``other_ms``, CPU
ms per token (``time.process_time``) and the load average. The kernels compute the same bits
whatever the thread count; only time is measured.

``--gguf`` a model file, or ``--shape`` / ``--qtype`` one of ``make_bench_models.py``'s
(written first when not cached).

``--busy N``: N CPU-bound processes (Python busy loops) run beside the measured rounds (started
after the load and the warm-up, stopped at the end), e.g. ``--busy 2`` on 2 cores for "two busy
processes take the cores". Each thread count keeps its own run-time choice across the rounds (as
a worker does). A last JSON line sums the run up: per thread count the median over rounds of
tok/s, its ratio to ``1``'s in the same round (median), the busy processes and the load average.
For a busy-machine comparison of the default against ``n_threads = 1`` (issue 26), e.g.:

    .venv/bin/python scripts/bench_decode.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --threads 2,1 --busy 2 --tokens 64 --repeat 5 --no-split
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--qtype", default="Q4_K_M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--weight-cache", action="store_true")
    ap.add_argument("--no-split", action="store_true", help="time whole tokens only (no per-matmul timing)")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes run beside the measured rounds")
    a = ap.parse_args()
    if a.gguf is None:
        from make_bench_models import ensure
        a.gguf = ensure(a.shape, a.qtype)
    from bench_batching import start_busy, stop

    from worker.engine.kernels import quant
    from worker.engine.kernels.threadctl import ThreadGovernor
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.arch.registry import load_model

    t0 = time.monotonic()
    m = load_model(read_gguf(str(a.gguf)), n_ctx=a.ctx + a.tokens * 2 + 8, weights="quantized",
                   weight_cache=a.weight_cache)
    load_s = time.monotonic() - t0
    names = {}
    for k, w in m.w.items():
        kind = k.split(".")[-1]
        names[id(w)] = {"tok_embd": "output", "output": "output"}.get(kind, kind)
    totals: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    cpu_totals: dict[str, float] = defaultdict(float)   # the calling thread's CPU time (all of it at 1 thread)
    orig = {cls: cls.matmul for cls in (quant.QWeight, quant.QConcat)}

    def timed(cls):
        f = orig[cls]

        def mm(self, x):
            t, c = time.perf_counter(), time.thread_time()
            r = f(self, x)
            g = names.get(id(self), "other")
            totals[g] += time.perf_counter() - t
            cpu_totals[g] += time.thread_time() - c
            nbytes[g] += self.nbytes
            return r
        return mm

    if not a.no_split:
        for cls in orig:
            cls.matmul = timed(cls)
    threads = [v.strip() for v in a.threads.split(",") if v.strip()]   # "2": the governor's choice up to 2; "2f": all 2

    governors: dict[str, ThreadGovernor] = {}

    def apply(spec: str) -> None:
        m.threads = governors.setdefault(spec, ThreadGovernor(adaptive=not spec.endswith("f")))
        quant.set_num_threads(int(spec.rstrip("f")))

    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 1000, a.ctx)
    best: dict[str, dict] = {}
    per_round: dict[str, list[float]] = defaultdict(list)   # tok/s of every round
    for n in threads:                                   # warm-up: kernels loaded, pages touched
        apply(n)
        m.reset()
        m.forward(prompt[:8])
        m.forward([int(prompt[0])])
    busy = start_busy(a.busy)
    try:
        rounds(a, m, threads, apply, prompt, best, per_round, totals, nbytes, cpu_totals)
    finally:
        for p in busy:
            stop(p)
    wbytes = sum(w.nbytes for w in m.w.values() if hasattr(w, "nbytes"))
    print(json.dumps({"model": a.gguf.name, "load_s": round(load_s, 1), "weight_mib": round(wbytes / 2**20)}))
    for n in threads:
        print(json.dumps(best[n]), flush=True)
    summary: dict = {"summary": a.gguf.name, "busy": a.busy, "rounds": a.repeat, "tokens": a.tokens,
                     "tok_s_median": {n: round(statistics.median(v), 2) for n, v in per_round.items()}}
    if "1" in per_round:
        summary["vs_t1_median"] = {n: round(statistics.median(x / y for x, y in zip(v, per_round["1"])), 3)
                                   for n, v in per_round.items() if n != "1"}
    summary["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(summary), flush=True)
    return 0


def rounds(a, m, threads, apply, prompt, best, per_round, totals, nbytes, cpu_totals) -> None:
    """The measured rounds: every thread count in turn, ``a.repeat`` times (see the docstring)."""
    for _ in range(a.repeat):
        for n in threads:
            apply(n)
            m.reset()
            m.forward(prompt)
            totals.clear()
            nbytes.clear()
            cpu_totals.clear()
            tok = int(prompt[-1])
            w0, c0, tc0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(a.tokens):
                tok = int(np.argmax(m.forward([tok])))
            wall = (time.perf_counter() - w0) / a.tokens
            cpu = (time.process_time() - c0) / a.tokens
            tcpu = (time.thread_time() - tc0) / a.tokens
            mm = {g: round(v / a.tokens * 1e3, 3) for g, v in totals.items()}
            gbs = {g: round(nbytes[g] / totals[g] / 1e9, 1) for g in totals if totals[g] > 0}
            row = {"model": a.gguf.name, "threads": n, "ms_per_token": round(wall * 1e3, 2),
                   "tok_s": round(1 / wall, 2), "cpu_ms_per_token": round(cpu * 1e3, 2),
                   "weights_gb_s": round(sum(nbytes.values()) / a.tokens / wall / 1e9, 2) if nbytes else None,
                   "matmul_ms": mm, "matmul_gb_s": gbs,
                   "other_ms": round(wall * 1e3 - sum(mm.values()), 2) if mm else None,
                   # the calling thread's CPU time: at 1 thread every kernel's, whatever else runs
                   "thread_cpu_ms_per_token": round(tcpu * 1e3, 2),
                   "matmul_thread_cpu_ms": {g: round(v / a.tokens * 1e3, 3) for g, v in cpu_totals.items()},
                   "matmul_cpu_gb_s": {g: round(nbytes[g] / v / 1e9, 1) for g, v in cpu_totals.items() if v > 0},
                   "other_thread_cpu_ms": round((tcpu - sum(cpu_totals.values()) / a.tokens) * 1e3, 2),
                   "governor": {"adaptive": m.threads.adaptive, "state": m.threads.state(),
                                "passes": dict(m.threads.passes), "switches": m.threads.switches},
                   "loadavg": [round(v, 2) for v in os.getloadavg()]}
            m.threads.passes.clear()
            per_round[n].append(row["tok_s"])
            key = "thread_cpu_ms_per_token" if n == "1" else "ms_per_token"
            if n not in best or row[key] < best[n][key]:
                best[n] = row


if __name__ == "__main__":
    sys.exit(main())
