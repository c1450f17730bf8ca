#!/usr/bin/env python3
"""Time to the first SSE byte vs time to the first token, per dialect, on a long prompt.

    .venv/bin/python scripts/bench_first_byte.py [--model gemma-3-270m] [--tokens 16000]
        [--n-ctx 32768] [--runs 1] [--routes /api/chat,/api/generate]

Starts ``modelyard serve`` on a temporary config (the shipped model file, ``n_ctx``
large enough), loads the model, then for each streaming dialect — chat completions,
completions, Responses, Anthropic Messages, ``/completion``, Ollama's ``/api/chat`` and
``/api/generate`` (NDJSON: one event a line) — sends a prompt of about
``--tokens`` tokens (a different one each time, so no prefix cache helps) and reports,
from the moment the request was sent: the first byte of the response body (the
stream's opening event or a keep-alive), and the first token. With streams opened at
the worker's Accepted frame, the first is well under a second while the second is the
whole prefill. The machine's load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("river city market bridge stone garden winter harbor lantern music orchard copper tide "
         "library mountain village letter candle meadow thunder").split()

#: route -> (body, is the event a token?)
DIALECTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/completion",
            "/api/chat", "/api/generate")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _text(n_tokens: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(int(n_tokens * 0.95)))


def _body(route: str, model: str, text: str) -> dict[str, object]:
    msgs = [{"role": "user", "content": text}]
    if route == "/v1/chat/completions":
        return {"model": model, "messages": msgs, "max_tokens": 4, "stream": True}
    if route == "/v1/messages":
        return {"model": model, "messages": msgs, "max_tokens": 4, "stream": True}
    if route == "/v1/responses":
        return {"model": model, "input": msgs, "max_output_tokens": 4, "stream": True}
    if route == "/v1/completions":
        return {"model": model, "prompt": text, "max_tokens": 4, "stream": True}
    if route == "/api/chat":  # Ollama: streams by default
        return {"model": model, "messages": msgs, "options": {"num_predict": 4}}
    if route == "/api/generate":
        return {"model": model, "prompt": text, "options": {"num_predict": 4}}
    return {"model": model, "prompt": text, "n_predict": 4, "stream": True}


def _is_token(route: str, event: bytes) -> bool:
    s = event.decode("utf-8", "replace")
    if route.startswith("/api/"):  # an NDJSON line; the opening and keep-alive lines carry no text
        obj = json.loads(s)
        return bool(obj.get("response") or (obj.get("message") or {}).get("content")
                    or (obj.get("message") or {}).get("tool_calls") or obj.get("done"))
    if route == "/v1/messages":
        return "content_block_delta" in s
    if route == "/v1/responses":
        return "response.output_text.delta" in s
    if route == "/v1/chat/completions":
        return '"content":"' in s or '"tool_calls"' in s
    if route == "/v1/completions":
        return '"text":"' in s and s.startswith("data: {")
    return '"content":"' in s and s.startswith("data: {")


def measure(url: str, route: str, body: dict[str, object], first_byte_only: bool = False) -> tuple[float, float]:
    """(first byte s, first token s) of one streamed request; ``first_byte_only``: the stream is
    closed at its first byte (the request is cancelled, no prefill waited for; first token nan)."""
    t0 = time.monotonic()
    first_byte = first_token = float("nan")
    sep = b"\n" if route.startswith("/api/") else b"\n\n"  # NDJSON lines, SSE events
    with httpx.stream("POST", url + route, json=body, timeout=600) as r:
        r.raise_for_status()
        buf = b""
        for data in r.iter_raw():
            if first_byte != first_byte:
                first_byte = time.monotonic() - t0
                if first_byte_only:
                    break
            buf += data
            while sep in buf:
                ev, buf = buf.split(sep, 1)
                if first_token != first_token and _is_token(route, ev):
                    first_token = time.monotonic() - t0
    return first_byte, first_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m", help="a model name of the shipped config.toml")
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--n-ctx", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--routes", default=",".join(DIALECTS), help="comma-separated routes to measure")
    ap.add_argument("--first-byte-only", action="store_true",
                    help="close each stream at its first byte (cancels it: no prefill waited for)")
    args = ap.parse_args()
    import tomllib

    shipped = tomllib.loads((ROOT / "config.toml").read_text())["models"][args.model]
    models_dir = Path(os.environ.get("MODELYARD_MODELS_DIR", ROOT / "models")).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="bench-first-byte-"))
    port = _free_port()
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in shipped.items() if k in ("path", "chat_template"))
    (tmp / "config.toml").write_text(f'[server]\nport = {port}\nmodels_dir = "{models_dir}"\n'
                                     f"[models.{args.model}]\n{table}\nn_ctx = {args.n_ctx}\nparallel = 1\n")
    proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(tmp / "config.toml")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / "router.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        httpx.post(url + "/admin/models/load", json={"model": args.model}, timeout=600)
        measure(url, "/completion", _body("/completion", args.model, "warm up"))
        print(f"{args.model}, prompt ~{args.tokens} tokens, n_ctx {args.n_ctx}; load average {os.getloadavg()}")
        print(f"{'route':24} {'first byte s':>13} {'first token s':>14}")
        seed = 0
        for route in args.routes.split(","):
            for _ in range(args.runs):
                seed += 1
                fb, ft = measure(url, route, _body(route, args.model, _text(args.tokens, seed)), args.first_byte_only)
                print(f"{route:24} {fb:13.3f} {ft:14.3f}", flush=True)
        print(f"load average {os.getloadavg()}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
