#!/usr/bin/env python3
"""Time-to-first-token and tokens/s through the router vs the worker alone, side by side.

    .venv/bin/python scripts/bench_router.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--max-tokens 64] [--runs 3] [--prompt TEXT] [--worker-module worker]

"Worker alone": this script binds a ZeroMQ ROUTER socket, spawns ``python -m
worker`` on it and sends Generate frames itself. "Router": it starts ``python -m
router serve`` (which spawns its own worker) and streams ``POST /completion``.
Both use the same prompt, greedy sampling, ``ignore_eos``, no prompt cache;
both are alive at once and their runs alternate, after one warm-up run each. TTFT is measured from sending the request to
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


class DirectWorker:
    """A worker spawned by this script on its own ROUTER socket (no router in between)."""

    async def start(self, args: argparse.Namespace) -> None:
        tmp = tempfile.mkdtemp(prefix="bench-")
        endpoint = f"ipc://{tmp}/w.sock"
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        cmd = [sys.executable, "-m", args.worker_module, "--model", "bench", "--gguf", str(args.model),
               "--endpoint", endpoint, "--max-queue", "1", "--parent-pid", str(os.getpid())]
        if args.n_ctx:
            cmd += ["--n-ctx", str(args.n_ctx)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT)
        self.ident: bytes | None = None
        while True:
            ident, frame = await asyncio.wait_for(self.sock.recv_multipart(), 600)
            msg = decode(frame)
            if isinstance(msg, Hello):
                self.ident = ident
            elif isinstance(msg, Ready):
                return
            elif isinstance(msg, Error):
                raise SystemExit(f"worker failed to load: {msg.message}")

    async def run(self, args: argparse.Namespace, i: int) -> tuple[float, float, int]:
        """(ttft_s, tokens_per_s, n_tokens) of one generation."""
        assert self.ident is not None
        g = Generate(id=f"bench-{i}", prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0,
                     ignore_eos=True, cache_prompt=False)
        t0 = time.perf_counter()
        await self.sock.send_multipart([self.ident, encode(g)])
        first = last = t0
        n = 0
        while True:
            _, frame = await self.sock.recv_multipart()
            msg = decode(frame)
            if isinstance(msg, Token) and msg.id == g.id:
                last = time.perf_counter()
                first = last if n == 0 else first
                n += 1
            elif isinstance(msg, Done) and msg.id == g.id:
                break
            elif isinstance(msg, Error) and msg.id == g.id:
                raise SystemExit(f"worker error: {msg.code}: {msg.message}")
        return first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0, n

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.sock.close()
        self.ctx.term()


class RoutedWorker:
    """A live ``python -m router serve`` with one model, streamed through ``POST /completion``."""

    async def start(self, args: argparse.Namespace) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
        model = Path(args.model).resolve()
        n_ctx = f"n_ctx = {args.n_ctx}\n" if args.n_ctx else ""
        (tmp / "config.toml").write_text(
            f'[server]\nmodels_dir = "{model.parent}"\n[models.bench]\npath = "{model.name}"\n{n_ctx}')
        port = _free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), MODELYARD_WORKER_MODULE=args.worker_module)
        self.proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(tmp / "config.toml"),
                                      "--port", str(port), "--log-level", "warning"], cwd=ROOT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.AsyncClient(timeout=600)
        deadline = time.monotonic() + 60
        while True:
            try:
                if (await self.client.get(self.url + "/health", timeout=1)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("router did not start")
            await asyncio.sleep(0.1)
        (await self.client.post(self.url + "/admin/models/load", json={"model": "bench"})).raise_for_status()

    async def run(self, args: argparse.Namespace, i: int) -> tuple[float, float, int]:
        body = {"model": "bench", "prompt": args.prompt, "n_predict": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False, "stream": True}
        t0 = time.perf_counter()
        first = last = t0
        n = 0
        async with self.client.stream("POST", self.url + "/completion", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    raise SystemExit(f"router error: {d['error']}")
                if d.get("stop"):
                    break
                last = time.perf_counter()
                first = last if n == 0 else first
                n += 1
        return first - t0, (n - 1) / (last - first) if n > 1 and last > first else 0.0, n

    async def stop(self) -> None:
        await self.client.aclose()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def bench(args: argparse.Namespace) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
    """Both set-ups alive at once, runs alternated (so load changes hit both alike); run 0 is a warm-up."""
    direct, routed = DirectWorker(), RoutedWorker()
    await direct.start(args)
    try:
        await routed.start(args)
        try:
            d, r = [], []
            for i in range(args.runs + 1):
                a = await direct.run(args, i)
                b = await routed.run(args, i)
                if i:
                    d.append(a)
                    r.append(b)
            return d, r
        finally:
            await routed.stop()
    finally:
        direct.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--worker-module", default="worker", help="python -m MODULE for the worker (default: worker)")
    args = p.parse_args()

    direct, routed = asyncio.run(bench(args))

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
