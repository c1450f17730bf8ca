#!/usr/bin/env python3
"""How long huge /tokenize calls pause a running stream on the same model, and the router's loop.

    .venv/bin/python scripts/bench_tokenize_stall.py [--model smollm2|gemma3] [--mb 7] [--calls 3]
        [--quiet-s 15] [--log FILE]

Starts a router (real models, n_ctx 512) on a free port, keeps one temperature-0 stream of
that model running (in a process of its own, so the callers' work cannot pause its
reader), and then: ``--quiet-s`` seconds with no other request (the baseline), ``--calls``
concurrent /tokenize calls of an ``--mb`` MB text (from another process), and again
``--quiet-s`` seconds quiet. Prints, as one JSON line: the worst and median gap between
the stream's tokens in each phase (ms), the router's longest event-loop lag in each phase
(``modelyard_event_loop_lag_max_seconds`` and the lag histogram's count over 50 ms), whether
the worker's pid stayed the same, and the load average (``os.getloadavg``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.router.conftest import GEMMA, MODELS, SMOLLM2, LiveRouter  # noqa: E402

NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m"}
CONFIG = f"""
[server]
models_dir = "{MODELS}"
[defaults]
n_ctx = 512
load_timeout_s = 300
[models.SmolLM2-135M-Instruct]
path = "{SMOLLM2.name}"
[models.gemma-3-270m]
path = "{GEMMA.name}"
"""


def stream(url: str, model: str, stop: mp.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Stream until ``stop``; put the arrival time (monotonic s) of every token chunk."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        out.put((last, now))
                    last = now
                    if stop.is_set():
                        break
    out.put(None)


def tokenize_calls(url: str, model: str, mb: float, calls: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import asyncio

    text = ("The quick brown fox jumps over the lazy dog; 12345 tokens, s'il vous plaît. " * 200_000)
    text = text[:int(mb * 1_000_000)]

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=1800) as c:
            rs = await asyncio.gather(*(c.post("/tokenize", json={"model": model, "content": text})
                                        for _ in range(calls)))
        return [r.status_code for r in rs]

    out.put(asyncio.run(main()))


def lag(url: str) -> tuple[float, dict[str, float]]:
    """(max lag so far, cumulative lag-histogram bucket counts so far) from /metrics."""
    m = httpx.get(url + "/metrics", timeout=60).text
    mx, buckets = 0.0, {}
    for line in m.splitlines():
        if line.startswith("modelyard_event_loop_lag_max_seconds "):
            mx = float(line.split()[1])
        elif line.startswith("modelyard_event_loop_lag_seconds_bucket{"):
            buckets[line.split('"')[1]] = float(line.split()[1])
    return mx, buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(NAMES), default="smollm2")
    ap.add_argument("--mb", type=float, default=7.0)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--quiet-s", type=float, default=15.0)
    ap.add_argument("--log", type=Path, help="copy the router's log (workers' output included) here")
    a = ap.parse_args()
    name = NAMES[a.model]
    with tempfile.TemporaryDirectory() as tmp:
        router = LiveRouter(Path(tmp), CONFIG, real=True)
        try:
            httpx.post(router.url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1},
                       timeout=600).raise_for_status()
            pid0 = router.admin(name)["pid"]
            ctx = mp.get_context("spawn")
            stop, gaps_q, res_q = ctx.Event(), ctx.Queue(), ctx.Queue()
            streamer = ctx.Process(target=stream, args=(router.url, name, stop, gaps_q))
            streamer.start()
            router.wait_for(lambda: router.admin(name)["in_flight"], what="the stream running")
            marks = {"start": time.monotonic()}
            lags = {"start": lag(router.url)}
            time.sleep(a.quiet_s)
            marks["probe"] = time.monotonic()
            lags["probe"] = lag(router.url)
            caller = ctx.Process(target=tokenize_calls, args=(router.url, name, a.mb, a.calls, res_q))
            caller.start()
            statuses = res_q.get(timeout=3600)
            caller.join()
            marks["after"] = time.monotonic()
            lags["after"] = lag(router.url)
            time.sleep(a.quiet_s)
            marks["end"] = time.monotonic()
            lags["end"] = lag(router.url)
            stop.set()
            pairs = []
            while (item := gaps_q.get(timeout=900)) is not None:
                pairs.append(item)
            streamer.join()
            pid1 = router.admin(name)["pid"]
        finally:
            router.stop(timeout=60)
            router.kill()
            if a.log:
                a.log.write_bytes(router.log_path.read_bytes())

    def phase(lo: str, hi: str) -> dict[str, float]:
        gs = [b - a_ for a_, b in pairs if marks[lo] <= b < marks[hi]]
        return {"gap_max_ms": round(max(gs) * 1000) if gs else -1,
                "gap_median_ms": round(statistics.median(gs) * 1000) if gs else -1, "tokens": len(gs)}

    def lag_hist(b0: dict[str, float], b1: dict[str, float]) -> dict[str, int]:
        cum = {k: int(b1[k] - b0.get(k, 0)) for k in b1}
        keys, out_, prev = list(cum), {}, 0
        for k in keys:
            if cum[k] - prev:
                out_[k] = cum[k] - prev
            prev = cum[k]
        return out_

    out = {"model": name, "mb": a.mb, "calls": a.calls, "statuses": statuses,
           "probe_s": round(marks["after"] - marks["probe"], 1),
           "before": phase("start", "probe"), "during": phase("probe", "after"), "after": phase("after", "end"),
           "loop_lag_max_ms_so_far": {k: round(v[0] * 1000) for k, v in lags.items()},
           # lags during the probe by bucket (upper bound, s -> count), empty buckets left out
           "loop_lags_during": lag_hist(lags["probe"][1], lags["after"][1]),
           "same_pid": pid0 == pid1, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
