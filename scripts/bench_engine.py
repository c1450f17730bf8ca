#!/usr/bin/env python3
"""Benchmark the NumPy engine's Model API on one GGUF file.

Usage::

    .venv/bin/python scripts/bench_engine.py MODEL.gguf [--prompt 512] [--decode 128]
        [--chunk 256] [--repeat 3] [--n-ctx N] [--no-cache-load]

Prints:

* load time without the weight cache (dequantize from the GGUF; measured in a
  child process so it does not inflate this process's RSS), the load of this
  process (cold if the ``.npy`` cache did not exist yet -- it is then written --
  else warm), and a warm load in a child process; each with its phases;
* prefill tokens/s for a ``--prompt``-token prompt fed in ``--chunk``-token
  chunks (as the generate loop does) and in one pass (best of ``--repeat``);
* decode tokens/s for ``--decode`` tokens, one sequence, greedy argmax;
* RSS after load and after the run, peak RSS (psutil / getrusage).

Token ids need no tokenizer: the long greedy prompt of the llama.cpp fixture
for this file when available (repeated as needed), else ``100 + i % 1000``.
OPENBLAS_* variables are left as the environment sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine.loading.gguf_loader import read_gguf  # noqa: E402
from worker.engine.arch.registry import load_model  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_load(path: str, n_ctx: int | None, weight_cache: bool) -> tuple[object, dict[str, float]]:
    t0 = time.perf_counter()
    g = read_gguf(path)
    t_header = time.perf_counter() - t0
    model = load_model(g, n_ctx, weight_cache=weight_cache)
    total = time.perf_counter() - t0
    phases = {"total": total, "header": t_header, **model.load_timings}
    phases["from_cache"] = float(getattr(model, "weights_from_cache", False))
    return model, phases


def fmt_phases(ph: dict[str, float]) -> str:
    keys = [k for k in ph if k not in ("total", "from_cache", "weights")]
    return f"{ph['total']:.2f} s  (" + ", ".join(f"{k} {ph[k]:.2f}" for k in keys) + ")"


def child_load(path: str, n_ctx: int | None, weight_cache: bool) -> dict[str, float]:
    code = ("import json,sys; sys.path.insert(0, %r); from scripts.bench_engine import timed_load; "
            "m, ph = timed_load(%r, %r, %r); import psutil; ph['rss_mib'] = psutil.Process().memory_info().rss/2**20; "
            "print(json.dumps(ph))") % (str(ROOT), path, n_ctx, weight_cache)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def prompt_ids(path: str, n: int, n_vocab: int) -> list[int]:
    name = Path(path).name.lower()
    for fx in FIXTURES.glob("*.shared.json"):
        stem = fx.name.split(".shared")[0].lower()
        if stem.split("-")[0] in name and stem.split("-")[-1].replace("_", "") in name.replace("_", ""):
            data = json.loads(fx.read_text())
            longest = max(data["greedy"], key=lambda e: len(e["prompt_ids"]))["prompt_ids"]
            ids = (longest * (n // len(longest) + 1))[:n]
            if max(ids) < n_vocab:
                return ids
    return [100 + i % 1000 for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length (tokens)")
    ap.add_argument("--decode", type=int, default=128, help="decoded tokens")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    ap.add_argument("--repeat", type=int, default=3, help="prefill repetitions (best reported)")
    ap.add_argument("--n-ctx", type=int, default=None)
    ap.add_argument("--no-cache-load", action="store_true", help="skip the no-cache child load")
    args = ap.parse_args()
    path = args.model
    print(f"model: {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    print(f"numpy {np.__version__}; OPENBLAS_* = "
          f"{ {k: v for k, v in os.environ.items() if k.startswith('OPENBLAS')} }")

    if not args.no_cache_load:
        ph = child_load(path, args.n_ctx, False)
        print(f"load, no weight cache (child):   {fmt_phases(ph)}  rss {ph['rss_mib']:.0f} MiB")
    model, ph = timed_load(path, args.n_ctx, True)
    kind = "warm (from .npy cache)" if ph["from_cache"] else "cold (no .npy cache yet)"
    print(f"load, {kind}: {fmt_phases(ph)}")
    rss_load = rss_mib()
    print(f"rss after load: {rss_load:.0f} MiB")
    if not ph["from_cache"]:
        t0 = time.perf_counter()
        model.wait_weight_cache()
        print(f"  .npy cache written in the background; waited {time.perf_counter() - t0:.2f} s more for it")
        ph2 = child_load(path, args.n_ctx, True)
        print(f"load, warm (child):              {fmt_phases(ph2)}  rss {ph2['rss_mib']:.0f} MiB")

    n_ctx = model.n_ctx
    need = args.prompt + args.decode
    if need > n_ctx:
        print(f"prompt + decode ({need}) exceeds n_ctx {n_ctx}", file=sys.stderr)
        return 2
    ids = prompt_ids(path, args.prompt, model.n_vocab)

    model.reset()
    model.forward(ids[:16])  # warm up BLAS threads and page in weights
    chunked, oneshot = [], []
    for _ in range(args.repeat):
        model.reset()
        t0 = time.perf_counter()
        for i in range(0, len(ids), args.chunk):
            logits = model.forward(ids[i:i + args.chunk])
        chunked.append(time.perf_counter() - t0)
        model.reset()
        t0 = time.perf_counter()
        model.forward(ids)
        oneshot.append(time.perf_counter() - t0)
    print(f"prefill {args.prompt} tokens, chunks of {args.chunk}: {args.prompt / min(chunked):.0f} tok/s "
          f"(best {min(chunked):.3f} s, median {np.median(chunked):.3f} s)")
    print(f"prefill {args.prompt} tokens, one pass:     {args.prompt / min(oneshot):.0f} tok/s "
          f"(best {min(oneshot):.3f} s)")

    tok = int(np.argmax(logits))
    times = []
    for _ in range(args.decode):
        t0 = time.perf_counter()
        logits = model.forward([tok])
        times.append(time.perf_counter() - t0)
        tok = int(np.argmax(logits))
    total = sum(times)
    print(f"decode {args.decode} tokens after a {args.prompt}-token prompt: {args.decode / total:.1f} tok/s "
          f"(median step {np.median(times) * 1000:.1f} ms, p90 {np.percentile(times, 90) * 1000:.1f} ms)")
    model.reset()
    times = []
    tok = ids[0]
    model.forward([tok])
    for _ in range(args.decode):
        t0 = time.perf_counter()
        logits = model.forward([tok])
        times.append(time.perf_counter() - t0)
        tok = int(np.argmax(logits))
    print(f"decode {args.decode} tokens from an empty cache:    {args.decode / sum(times):.1f} tok/s "
          f"(median step {np.median(times) * 1000:.1f} ms)")
    print(f"rss after run: {rss_mib():.0f} MiB; peak rss: {peak_rss_mib():.0f} MiB; "
          f"KV cache reserved {model.cache.nbytes / 2**20:.0f} MiB for n_ctx {n_ctx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
