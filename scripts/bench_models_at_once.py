#!/usr/bin/env python3
"""Decode tokens/s of two models generating at the same time, per ``n_threads`` setting.

    .venv/bin/python scripts/bench_models_at_once.py [--threads default,1] [--max-tokens 64] [--runs 2]

For each ``n_threads`` value (``default``: the key left out, so the environment
decides — OpenBLAS uses one thread per core) this starts ``python -m router serve``
with SmolLM2 and Gemma 3, loads both, then runs each model alone and then both at
once (``POST /completion``, greedy, ``ignore_eos``, no prompt cache) and prints the
decode rate the worker reports (``timings.predicted_per_second``, tokens/s; median
over ``--runs``). All settings run in this one invocation, so the figures compare.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models")
PROMPT = "The history of the city begins with a small settlement on the banks of a river, where"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(threads: str) -> str:
    extra = "" if threads == "default" else f"n_threads = {int(threads)}\n"
    return (f'[server]\nmodels_dir = "{MODELS}"\n[defaults]\n{extra}'
            '[models.smol]\npath = "SmolLM2-135M-Instruct.Q4_1.gguf"\n'
            '[models.gemma]\npath = "gemma-3-270m-q4_k_m.gguf"\nchat_template = "gemma"\n')


async def _rate(c: httpx.AsyncClient, model: str, n: int) -> float:
    r = await c.post("/completion", json={"model": model, "prompt": PROMPT, "n_predict": n, "temperature": 0,
                                          "ignore_eos": True, "cache_prompt": False})
    r.raise_for_status()
    return float(r.json()["timings"]["predicted_per_second"])


async def _measure(url: str, n: int, runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"smol alone": [], "gemma alone": [], "smol (both)": [], "gemma (both)": []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for m in ("smol", "gemma"):
            (await c.post("/admin/models/load", json={"model": m})).raise_for_status()
            await _rate(c, m, 8)  # warm-up
        for _ in range(runs):
            out["smol alone"].append(await _rate(c, "smol", n))
            out["gemma alone"].append(await _rate(c, "gemma", n))
            a, b = await asyncio.gather(_rate(c, "smol", n), _rate(c, "gemma", n))
            out["smol (both)"].append(a)
            out["gemma (both)"].append(b)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="default,1", help="comma-separated n_threads values ('default': unset)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    results: dict[str, dict[str, float]] = {}
    for threads in args.threads.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="bench-at-once-"))
        (tmp / "config.toml").write_text(_config(threads))
        port = _free_port()
        log = (tmp / "router.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(tmp / "config.toml"),
                                 "--port", str(port), "--log-level", "warning"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            got = asyncio.run(_measure(url, args.max_tokens, args.runs))
            results[threads] = {k: statistics.median(v) for k, v in got.items()}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            log.close()
    keys = ["smol alone", "gemma alone", "smol (both)", "gemma (both)"]
    print(f"decode tokens/s (median of {args.runs}, {args.max_tokens} tokens, greedy)")
    print("n_threads     " + "".join(f"{k:>15}" for k in keys))
    for threads, r in results.items():
        print(f"{threads:<14}" + "".join(f"{r[k]:>15.1f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
