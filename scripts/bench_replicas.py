#!/usr/bin/env python3
"""Replicas and cache-aware routing: multi-round conversations, as production-stack's multi-round QA.

    .venv/bin/python scripts/bench_replicas.py [--users 4] [--rounds 3] [--system-words 300]
        [--max-tokens 16] [--gap 0] [--threads 1] [--parallel 2] [--model smollm2|gemma3]
        [--ray ADDRESS] [--port 8191]

U users talk to the model at once, each for R rounds (a round: its conversation so far plus a
new question; the next round starts when the answer is in, after ``--gap`` s); every user's
conversation starts with the same system prompt (``--system-words`` words). Three setups of
the same GGUF, one after the other, each alone on the machine (the others unloaded):

* ``cache_aware``: ``replicas = 2``, ``routing = "cache_aware"`` (router.serving.routing);
* ``round_robin``: ``replicas = 2``, ``routing = "round_robin"``;
* ``one``: one worker.

Each worker gets ``--threads`` BLAS threads and ``--parallel`` KV slots. Per setup: TTFT p50 / p99
(streamed, first content chunk), the cached-token fraction (``usage.prompt_tokens_details.
cached_tokens`` / prompt tokens), aggregate completion tok/s (all users' tokens / wall time);
then the ratios cache_aware / round_robin and cache_aware / one, and the load average (the
machine may be shared: figures taken under load say so). One JSON line each.

``--ray ADDRESS``: the workers run on that Ray cluster (``[cluster] backend = "ray"``), the
replicas on distinct nodes. Without it, every worker is a child of the router on this host.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
SETUPS = ("cache_aware", "round_robin", "one")
WORDS = ("river stone light window garden paper music winter orange cloud table mountain letter bridge "
         "forest candle harbor silver morning story").split()


def config(args: argparse.Namespace) -> str:
    cluster = f'[cluster]\nbackend = "ray"\naddress = "{args.ray}"\n' if args.ray else ""
    gguf = MODELS[args.model]
    out = (f'[server]\nmodels_dir = "{ROOT / "models"}"\nwarm_spare = false\n{cluster}'
           f'[defaults]\nn_ctx = 4096\nn_threads = {args.threads}\nparallel = {args.parallel}\nmax_queue = 64\n'
           'load_timeout_s = 600\n')
    for name in SETUPS:
        replicas = 1 if name == "one" else 2
        routing = "cache_aware" if name == "one" else name
        out += f'[models.{name}]\npath = "{gguf}"\nreplicas = {replicas}\nrouting = "{routing}"\n'
    return out


def request(port: int, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 900) -> Any:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"{method} {path}: {r.status} {data[:300]!r}")
    return json.loads(data)


def wait_up(port: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited {proc.returncode}")
        try:
            request(port, "GET", "/health", timeout=2)
            return
        except (OSError, RuntimeError):
            time.sleep(0.3)
    raise TimeoutError("router not up")


def stream_turn(port: int, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat turn: its TTFT (s), text, and usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"chat: {r.status} {r.read()[:300]!r}")
    ttft, text, usage = None, [], {}
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(f"stream error: {ev['error']}")
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.monotonic() - t0
                text.append(piece)
        if ev.get("usage"):
            usage = ev["usage"]
    return {"ttft": ttft if ttft is not None else time.monotonic() - t0, "text": "".join(text), "usage": usage}


def run_setup(port: int, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every user's rounds against model ``name``; its figures."""
    system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_words))
    turns: list[dict[str, Any]] = []
    lock = threading.Lock()
    errors: list[str] = []

    def user(u: int) -> None:
        msgs = [{"role": "system", "content": f"Context: {system}. Answer briefly."},
                {"role": "user", "content": f"I am user {u}. Tell me about {WORDS[u % len(WORDS)]}."}]
        for k in range(args.rounds):
            try:
                t = stream_turn(port, name, msgs, args.max_tokens)
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                errors.append(str(e))
                return
            with lock:
                turns.append({**t, "round": k})
            msgs = [*msgs, {"role": "assistant", "content": t["text"]},
                    {"role": "user", "content": f"And what else about {WORDS[(u + k + 1) % len(WORDS)]}?"}]
            time.sleep(args.gap)

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    ttfts = sorted(t["ttft"] for t in turns)
    prompt = sum(t["usage"].get("prompt_tokens", 0) for t in turns)
    cached = sum((t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for t in turns)
    completion = sum(t["usage"].get("completion_tokens", 0) for t in turns)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))] if ttfts else None
    return {"setup": name, "turns": len(turns), "errors": errors[:3], "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": p99, "cached_fraction": cached / prompt if prompt else 0.0,
            "tok_s": completion / wall if wall > 0 else 0.0, "wall_s": wall}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--gap", type=float, default=0.0, help="a user's pause between rounds, s")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--ray", default=None, help="a Ray cluster's address: run the workers there")
    p.add_argument("--port", type=int, default=8191)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    (tmp / "config.toml").write_text(config(args))
    log = (tmp / "router.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(tmp / "config.toml"),
                             "--port", str(args.port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_up(args.port, proc)
        for name in SETUPS:
            for other in SETUPS:  # each setup alone on the machine
                if other != name:
                    request(args.port, "POST", "/admin/models/unload", {"model": other})
            request(args.port, "POST", "/admin/models/load", {"model": name})
            results[name] = run_setup(args.port, name, args)
            print(json.dumps(results[name]), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ca, rr, one = (results.get(n, {}) for n in SETUPS)
    print(json.dumps({
        "ratios": {f"{k}_{a}_vs_{b}": ratio(x.get(k), y.get(k))
                   for k in ("ttft_p50_s", "ttft_p99_s", "cached_fraction", "tok_s")
                   for (a, x), (b, y) in ((("cache_aware", ca), ("round_robin", rr)), (("cache_aware", ca), ("one", one)))},
        "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
        "settings": {k: v for k, v in vars(args).items() if k != "port"}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
