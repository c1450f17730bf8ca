#!/usr/bin/env python3
"""Time-to-first-token and tokens/s through the router vs the worker alone, side by side.

    .venv/bin/python scripts/bench_router.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--max-tokens 64] [--runs 3] [--prompt TEXT] [--worker-module worker]

"Worker alone": this script binds a ZeroMQ ROUTER socket, spawns ``python -m
worker`` on it and sends Generate frames itself. "Router": it starts ``python -m
router serve`` (which spawns its own worker) and streams ``POST /completion``.
Both use the same prompt, greedy sampling, ``ignore_eos``, no prompt cache, and
a warm-up run first (not counted). TTFT is measured from sending the request to
the first token (a Token frame / the first SSE event with a token); tokens/s is
generated tokens after the first divided by the time from the first to the last
token. Figures are medians over ``--runs``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol import Done, Error, Generate, Hello, Ready, Token, decode, encode  # noqa: E402

PROMPT = ("The history of the city begins with a small settlement on the banks of a river, "
          "where farmers and traders")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def bench_worker(args: argparse.Namespace) -> list[tuple[float, float, int]]:
    """(ttft_s, tokens_per_s, n_tokens) per run, talking to the worker directly."""
    tmp = tempfile.mkdtemp(prefix="bench-")
    endpoint = f"ipc://{tmp}/w.sock"
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    cmd = [sys.executable, "-m", args.worker_module, "--model", "bench", "--gguf", str(args.model),
           "--endpoint", endpoint, "--max-queue", "1", "--parent-pid", str(os.getpid())]
    if args.n_ctx:
        cmd += ["--n-ctx", str(args.n_ctx)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        ident = None
        while True:
            ident_, frame = await asyncio.wait_for(sock.recv_multipart(), 600)
            msg = decode(frame)
            if isinstance(msg, Hello):
                ident = ident_
            elif isinstance(msg, Ready):
                break
            elif isinstance(msg, Error):
                raise SystemExit(f"worker failed to load: {msg.message}")
        assert ident is not None
        results = []
        for i in range(args.runs + 1):
            g = Generate(id=f"bench-{i}", prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0,
                         ignore_eos=True, cache_prompt=False)
            t0 = time.perf_counter()
            await sock.send_multipart([ident, encode(g)])
            first = last = None
            n = 0
            while True:
                _, frame = await sock.recv_multipart()
                msg = decode(frame)
                if isinstance(msg, Token) and msg.id == g.id:
                    last = time.perf_counter()
                    first = first or last
                    n += 1
                elif isinstance(msg, Done) and msg.id == g.id:
                    break
                elif isinstance(msg, Error) and msg.id == g.id:
                    raise SystemExit(f"worker error: {msg.code}: {msg.message}")
            if i and first is not None and last is not None:
                results.append((first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0, n))
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        sock.close()
        ctx.term()


def bench_router(args: argparse.Namespace) -> list[tuple[float, float, int]]:
    """(ttft_s, tokens_per_s, n_tokens) per run through a live router (SSE /completion)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model = Path(args.model).resolve()
    n_ctx = f"n_ctx = {args.n_ctx}\n" if args.n_ctx else ""
    (tmp / "config.toml").write_text(
        f'[server]\nmodels_dir = "{model.parent}"\n[models.bench]\npath = "{model.name}"\n{n_ctx}')
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), MODELYARD_WORKER_MODULE=args.worker_module)
    proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(tmp / "config.toml"),
                             "--port", str(port), "--log-level", "warning"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("router did not start")
            time.sleep(0.1)
        httpx.post(url + "/admin/models/load", json={"model": "bench"}, timeout=600).raise_for_status()
        results = []
        body = {"model": "bench", "prompt": args.prompt, "n_predict": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False, "stream": True}
        with httpx.Client(timeout=600) as c:
            for i in range(args.runs + 1):
                t0 = time.perf_counter()
                first = last = None
                n = 0
                with c.stream("POST", url + "/completion", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        d = json.loads(line[6:])
                        if "error" in d:
                            raise SystemExit(f"router error: {d['error']}")
                        if d.get("stop"):
                            break
                        last = time.perf_counter()
                        first = first or last
                        n += 1
                if i and first is not None and last is not None:
                    results.append((first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0, n))
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--worker-module", default="worker", help="python -m MODULE for the worker (default: worker)")
    args = p.parse_args()

    direct = asyncio.run(bench_worker(args))
    routed = bench_router(args)

    def med(rows: list[tuple[float, float, int]], k: int) -> float:
        return statistics.median(r[k] for r in rows)

    print(f"model {Path(args.model).name}, {args.max_tokens} tokens, greedy, median of {args.runs} runs")
    print(f"{'':14}{'TTFT (ms)':>12}{'tokens/s':>12}")
    print(f"{'worker alone':14}{med(direct, 0) * 1000:12.1f}{med(direct, 1):12.1f}")
    print(f"{'via router':14}{med(routed, 0) * 1000:12.1f}{med(routed, 1):12.1f}")
    print(f"{'difference':14}{(med(routed, 0) - med(direct, 0)) * 1000:+12.1f}"
          f"{(med(routed, 1) / med(direct, 1) - 1) * 100 if med(direct, 1) else 0:+11.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
