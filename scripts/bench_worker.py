#!/usr/bin/env python3
"""Tokens/s through the worker's socket vs the engine alone, and cancel latency.

    .venv/bin/python scripts/bench_worker.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--n-ctx 2048] [--max-tokens 64] [--runs 3] [--prefill-words 1000]

1. **Engine alone**: ``Engine.load`` in this process; ``generate`` with greedy
   sampling, ``ignore_eos``, ``cache_prompt=False``; timestamps from ``on_token``.
2. **Through the socket**: this script binds a ZeroMQ ROUTER socket (ipc://),
   spawns ``python -m worker`` on it and sends the same request as a Generate
   frame; timestamps are Token frame arrivals. Runs of 1. and 2. alternate (never
   at the same time), so a busy machine slows both alike.

   For both: TTFT = request sent -> first token (ms); decode tok/s = tokens after
   the first / time from the first to the last token. A warm-up run is not counted.

3. **Cancel latency** through the socket, Cancel sent -> Done received (ms):
   mid-decode (at a random point of the forward pass after the 5th token of a long
   generation; the engine checks the cancel flag before each token) and mid-prefill (a prompt of
   ``--prefill-words`` words, cancelled ~0.2 s after the worker started it; the
   prefill runs in chunks of 256 tokens and the cancel flag is checked between
   chunks). Also the Ping -> Pong round trip while a prefill chunk is computing.

Figures are printed as median [min..max] over ``--runs``. Run it on a quiet
machine; the test suite never asserts on these numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol import Cancel, Done, Error, Generate, Hello, Message, Ping, Pong, Ready, Shutdown, Token, decode, encode  # noqa: E402

PROMPT = ("The history of the city begins with a small settlement on the banks of a river, "
          "where farmers and traders")
FILLER = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
          "father had taught him, and wound the great clockwork that turned the lens. ").split()


def long_prompt(n_words: int) -> str:
    return " ".join(f"{FILLER[i % len(FILLER)]}{'' if i % 7 else str(i)}" for i in range(n_words))


def summary(xs: list[float], fmt: str = "{:.1f}") -> str:
    if not xs:
        return "n/a"
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}..{fmt.format(max(xs))}]"


def rates(t_sent: float, stamps: list[float]) -> tuple[float, float]:
    """(TTFT ms, decode tok/s) from the send time and per-token arrival times (s)."""
    ttft = (stamps[0] - t_sent) * 1e3
    tps = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0
    return ttft, tps


# ----------------------------------------------------------------------------- through the socket


class Router:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.ident: bytes | None = None

    def recv(self, timeout_s: float = 300.0) -> tuple[float, Message]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no frame from the worker")
        ident, payload = self.sock.recv_multipart()
        t = time.perf_counter()
        msg = decode(payload)
        if isinstance(msg, Hello):
            self.ident = ident
        return t, msg

    def until(self, pred: Callable[[Message], bool], timeout_s: float = 300.0) -> tuple[float, Message]:
        while True:
            t, m = self.recv(timeout_s)
            if isinstance(m, Error) and m.id != "bench-ping":
                raise RuntimeError(f"worker error: {m.code}: {m.message}")
            if pred(m):
                return t, m

    def send(self, msg: Message) -> float:
        assert self.ident is not None
        self.sock.send_multipart([self.ident, encode(msg)])
        return time.perf_counter()

    def stream(self, rid: str) -> tuple[list[float], Done]:
        stamps: list[float] = []
        while True:
            t, m = self.until(lambda m: m.id == rid)
            if isinstance(m, Token):
                stamps.append(t)
            elif isinstance(m, Done):
                return stamps, m


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from worker.engine import Engine, SamplingParams

    t0 = time.perf_counter()
    engine = Engine.load(str(args.model), n_ctx=args.n_ctx)
    e_load_ms = (time.perf_counter() - t0) * 1e3
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, cache_prompt=False)
    tmp = tempfile.mkdtemp(prefix="bw-")
    endpoint = f"ipc://{tmp}/w.sock"
    r = Router(endpoint)
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--model", "bench", "--gguf", str(args.model),
                             "--endpoint", endpoint, "--n-ctx", str(args.n_ctx)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MODELYARD_WORKER_LOG": "WARNING"})
    out: dict[str, Any] = {"ttft": [], "tps": [], "e_ttft": [], "e_tps": [], "e_load_ms": e_load_ms,
                           "cancel_decode": [], "cancel_prefill": [], "pong_prefill": [], "prefill_done": []}
    try:
        r.until(lambda m: isinstance(m, Hello))
        _, ready = r.until(lambda m: isinstance(m, Ready))
        assert isinstance(ready, Ready)
        out["load_ms"] = ready.load_ms
        for run in range(args.runs + 1):  # engine alone and through the socket, alternately (same load)
            stamps: list[float] = []
            t_sent = time.perf_counter()
            engine.generate(PROMPT, params, on_token=lambda ev: stamps.append(time.perf_counter()) or True)
            if run:  # run 0 is the warm-up
                ttft, tps = rates(t_sent, stamps)
                out["e_ttft"].append(ttft)
                out["e_tps"].append(tps)
            rid = f"gen{run}"
            t_sent = r.send(Generate(id=rid, prompt=PROMPT, max_tokens=args.max_tokens, temperature=0.0,
                                     ignore_eos=True, cache_prompt=False))
            stamps, _ = r.stream(rid)
            if run:
                ttft, tps = rates(t_sent, stamps)
                out["ttft"].append(ttft)
                out["tps"].append(tps)
        del engine
        gc.collect()
        gap_s = 1.0 / statistics.median(out["tps"]) if out["tps"] and min(out["tps"]) > 0 else 0.05
        rng = random.Random(0)
        for run in range(args.runs):
            rid = f"cd{run}"
            r.send(Generate(id=rid, prompt=PROMPT, max_tokens=1000, temperature=0.0, ignore_eos=True))
            for _ in range(5):
                r.until(lambda m: isinstance(m, Token) and m.id == rid)
            # A Cancel sent the instant a Token arrives often beats the engine back from on_token
            # (latency ~0): cancel at a random point of the next forward pass instead.
            time.sleep(rng.uniform(0, gap_s))
            t_cancel = r.send(Cancel(id=rid))
            t_done, done = r.until(lambda m: isinstance(m, Done) and m.id == rid)
            assert isinstance(done, Done) and done.finish_reason == "cancelled"
            out["cancel_decode"].append((t_done - t_cancel) * 1e3)
        prompt = long_prompt(args.prefill_words)
        for run in range(args.runs):
            rid = f"cp{run}"
            r.send(Generate(id=rid, prompt=prompt, max_tokens=8, temperature=0.0, cache_prompt=False))
            while True:  # until the worker has started it
                r.send(Ping(id="bench-ping"))
                _, pong = r.until(lambda m: isinstance(m, Pong))
                if isinstance(pong, Pong) and rid in pong.running_ids:
                    break
            time.sleep(0.2)
            t_ping = r.send(Ping(id="bench-ping"))
            t_pong, _ = r.until(lambda m: isinstance(m, Pong))
            out["pong_prefill"].append((t_pong - t_ping) * 1e3)
            t_cancel = r.send(Cancel(id=rid))
            n_tok = 0
            while True:
                t_done, m = r.until(lambda m: m.id == rid)
                if isinstance(m, Token):
                    n_tok += 1
                elif isinstance(m, Done):
                    break
            assert isinstance(m, Done)
            out["cancel_prefill"].append((t_done - t_cancel) * 1e3)
            out["prefill_done"].append((m.prompt_n, m.prompt_tokens, n_tok, m.finish_reason))
        r.send(Shutdown(id="bye"))
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        r.sock.close(linger=0)
        r.ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-words", type=int, default=1000)
    args = ap.parse_args()

    s = bench(args)
    e_ttft, e_tps, e_load = s["e_ttft"], s["e_tps"], s["e_load_ms"]
    print(f"model {args.model.name}, n_ctx {args.n_ctx}, {args.max_tokens} tokens greedy, {args.runs} runs "
          f"(median [min..max]); {os.cpu_count()} CPUs")
    print(f"{'':28s}{'TTFT ms':>24s}{'decode tok/s':>24s}{'load ms':>10s}")
    print(f"{'engine alone':28s}{summary(e_ttft):>24s}{summary(e_tps):>24s}{e_load:>10.0f}")
    print(f"{'worker through the socket':28s}{summary(s['ttft']):>24s}{summary(s['tps']):>24s}{s['load_ms']:>10.0f}")
    if e_tps and s["tps"]:
        print(f"socket / engine decode speed: {statistics.median(s['tps']) / statistics.median(e_tps) * 100:.1f} %")
    print(f"Cancel -> Done mid-decode (ms):  {summary(s['cancel_decode'])}   "
          f"(one decode step: {1e3 / statistics.median(s['tps']):.0f} ms)")
    print(f"Cancel -> Done mid-prefill (ms): {summary(s['cancel_prefill'])}   "
          f"(prompt_n/prompt_tokens, tokens, finish: {s['prefill_done']})")
    print(f"Ping -> Pong during prefill (ms): {summary(s['pong_prefill'])}")


if __name__ == "__main__":
    main()
