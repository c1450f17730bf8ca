#!/usr/bin/env python3
"""Concurrency inside one worker vs llama-server, side by side on the same GGUF.

    .venv/bin/python scripts/bench_batching.py [--model smollm2|gemma3] [--conc 1,4,8,16,32]
        [--max-tokens 64] [--llama-server PATH] [--skip-llama] [--gap] [--turn2] [--weights f32|quantized] [--port 8181]

Both servers are started by this script and are alive at once; each
measurement runs on llama-server first, then on modelyard, one after the other
(never at the same time). Load: ``../shared/tools/loadgen.py`` (CONC streaming
``/v1/completions`` at once, temperature 0, ignore_eos): aggregate completion
tok/s, median TTFT, median per-stream tok/s. Servers: llama-server with
``-np P -c P*n_ctx -t 2`` and modelyard with ``parallel = P`` (P = 8 for
concurrency <= 8, else 32), n_ctx 2048 per sequence.

``--gap``: the worst inter-token gap of a running stream while a ~2,000-token
prompt arrives (the stream's chunks timed on arrival).
``--turn2``: TTFT of turn 2 / turn 1 of a ~2,000-token chat with another
conversation interleaved between the turns (prefix cache across conversations).

Prints one JSON line per measurement and the load average. OPENBLAS_* are left
as the machine sets them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADGEN = ROOT.parent / "shared" / "tools" / "loadgen.py"
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
N_CTX = 2048


def wait_http(port: int, path: str, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"port {port} {path} not ready")


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status} {data[:300]!r}")
    return json.loads(data)


def start_llama(srv: str, gguf: Path, parallel: int, port: int) -> subprocess.Popen:
    p = subprocess.Popen([srv, "-m", str(gguf), "-t", "2", "-c", str(parallel * N_CTX), "-np", str(parallel),
                          "--port", str(port), "--host", "127.0.0.1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_http(port, "/health")
    return p


def start_modelyard(gguf: Path, parallel: int, port: int, tmp: Path, weights: str = "f32") -> subprocess.Popen:
    cfg = tmp / f"bench-{parallel}.toml"
    cfg.write_text(f'[server]\nport = {port}\n[models.m]\npath = "{gguf}"\nn_ctx = {N_CTX}\n'
                   f'parallel = {parallel}\nmax_queue = 64\nweights = "{weights}"\n')
    p = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(cfg), "--log-level", "warning"],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_http(port, "/health")
    post(port, "/admin/models/load", {"model": "m"})
    return p


def stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except Exception:  # noqa: BLE001
        os.killpg(p.pid, signal.SIGKILL)


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes (Python busy loops, each in its own session: :func:`stop` ends
    one), for "a busy machine" figures; 2 s to let the scheduler and the load average see them."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    if busy:
        time.sleep(2)
    return busy


def loadgen(port: int, model: str, conc: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, str(LOADGEN), f"http://127.0.0.1:{port}", model, str(conc),
                          str(max_tokens)], capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def stream_gaps(port: int, model: str, n_tokens: int, long_prompt: str, after: int) -> float:
    """Worst gap (s) between a stream's token chunks while a long prompt is sent after ``after`` tokens."""
    import threading

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": n_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    times: list[float] = []
    th = None
    for line in r:
        if line.startswith(b"data:") and b"[DONE]" not in line:
            times.append(time.monotonic())
            if len(times) == after:
                th = threading.Thread(target=post, args=(port, "/v1/completions", {
                    "model": model, "prompt": long_prompt, "max_tokens": 1, "temperature": 0}))
                th.start()
    if th is not None:
        th.join()
    gaps = [b - a for a, b in zip(times[after - 1:], times[after:])]
    return max(gaps) if gaps else float("nan")


def ttft_chat(port: int, model: str, messages: list[dict]) -> tuple[float, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first, text = None, ""
    for line in r:
        if line.startswith(b"data:") and b"[DONE]" not in line:
            d = json.loads(line[5:])
            for ch in d.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    text += piece
                    first = first or time.monotonic()
    return (first or time.monotonic()) - t0, text


def turn2_ratio(port: int, model: str) -> dict:
    words = ("the quick brown fox jumps over the lazy dog while the river keeps running to the sea " * 110)
    conv = [{"role": "user", "content": "Summarise this text: " + words}]
    t1, reply = ttft_chat(port, model, conv)
    ttft_chat(port, model, [{"role": "user", "content": "Write about mountains and " + words[:3000]}])
    t2, _ = ttft_chat(port, model, conv + [{"role": "assistant", "content": reply},
                                           {"role": "user", "content": "Thanks. And in one word?"}])
    return {"turn1_ttft_s": round(t1, 3), "turn2_ttft_s": round(t2, 3), "ratio": round(t2 / t1, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--conc", default="1,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--gap", action="store_true")
    ap.add_argument("--turn2", action="store_true")
    ap.add_argument("--weights", default="quantized", choices=("quantized", "f32"), help="modelyard's weights key")
    ap.add_argument("--port", type=int, default=8181,
                    help="llama-server's port; modelyard's is the next one (default 8181, 8182)")
    a = ap.parse_args()
    gguf = (Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models") / MODELS[a.model]).resolve()
    srv = a.llama_server
    if srv is None and not a.skip_llama:
        srv = subprocess.run([str(ROOT.parent / "shared" / "tools" / "build-llama-server")], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    concs = [int(x) for x in a.conc.split(",")]
    groups: dict[int, list[int]] = {}
    for c in concs:
        groups.setdefault(8 if c <= 8 else 32, []).append(c)
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-bench-"))
    for parallel, cs in sorted(groups.items()):
        llama = start_llama(srv, gguf, parallel, a.port) if srv else None
        ours = start_modelyard(gguf, parallel, a.port + 1, tmp, a.weights)
        try:
            for c in cs:
                row: dict = {"model": a.model, "weights": a.weights, "parallel": parallel, "concurrency": c}
                if llama:
                    row["llama"] = loadgen(a.port, "m", c, a.max_tokens)
                row["modelyard"] = loadgen(a.port + 1, "m", c, a.max_tokens)
                if llama:
                    row["ratio_aggregate"] = round(row["modelyard"]["aggregate_tok_s"]
                                                   / max(row["llama"]["aggregate_tok_s"], 1e-9), 3)
                row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
                print(json.dumps(row), flush=True)
            if a.gap and parallel == min(groups):
                long_prompt = "word " * 2000
                row = {"worst_gap_s": {}}
                if llama:
                    row["worst_gap_s"]["llama"] = round(stream_gaps(a.port, "m", 60, long_prompt, 10), 3)
                row["worst_gap_s"]["modelyard"] = round(stream_gaps(a.port + 1, "m", 60, long_prompt, 10), 3)
                row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
                print(json.dumps(row), flush=True)
            if a.turn2 and parallel == min(groups):
                row = {"turn2": {}}
                if llama:
                    row["turn2"]["llama"] = turn2_ratio(a.port, "m")
                row["turn2"]["modelyard"] = turn2_ratio(a.port + 1, "m")
                row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
                print(json.dumps(row), flush=True)
        finally:
            if llama:
                stop(llama)
            stop(ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
