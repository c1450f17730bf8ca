#!/usr/bin/env python3
"""Single-stream decode and prefill of modelyard and llama-server side by side, interleaved, on
the same GGUF — the shipped models or the real-size bench models — optionally with busy
processes on the cores.

    .venv/bin/python scripts/bench_side_by_side.py [--model smollm2|gemma3|llama-1b-Q4_K_M|...]
        [--gguf PATH] [--servers llama-t2,ours] [--rounds 3] [--prompt-tokens 512]
        [--decode-tokens 64] [--decode-after-prompt] [--busy 0] [--bandwidth] [--llama-server PATH]
        [--port 8301]

Every server of ``--servers`` is started at once (each on its own port, all loaded before the
first measurement) and the measurements alternate between them, one at a time, round after
round (the order rotating each round), so that a change of the machine's load shows in every
server's figures alike and the ratios stay meaningful on a shared machine. Servers:

* ``llama-tN``: llama-server ``-t N -c 2048 -np 1``;
* ``ours``: modelyard (``weights = "quantized"``, ``parallel = 1``, n_ctx 2048) with its default
  threads (the router's share and the engine's run-time choice, worker/engine/kernels/threadctl.py);
* ``ours-tN``: the same with ``n_threads = N`` in the model's config;
* ``ours-fixed``: the default share with the run-time choice off (``MODELYARD_ADAPTIVE_THREADS=0``:
  every pass on all the share's threads, the behaviour before it).

Per round and server: ``prefill_tok_s`` (``timings.prompt_per_second`` of a ~``--prompt-tokens``
prompt, ``cache_prompt: false``) and ``decode_tok_s`` (``timings.predicted_per_second`` of
``--decode-tokens`` greedy tokens, ``ignore_eos``, after a short prompt; with
``--decode-after-prompt`` after the ~``--prompt-tokens`` prompt instead, in the same request as the
prefill figure: decode at long context, where the KV attention weighs), with ``weights_gb_s``: decode tok/s times the
GGUF's tensor bytes (every weight is read once per token; tied embeddings are the output
projection). One JSON line per measurement with the load average, then a summary: each
server's median, and the median over rounds of each round's ratio to the first server.

``--busy N``: N CPU-bound processes (Python busy loops) run throughout the measured rounds
(started after the servers loaded), e.g. ``--busy 2`` on a 2-core machine for "two busy
processes". ``--bandwidth``: the machine's streaming read bandwidth first (numpy float32
matrix-vector products over 512 MiB of weights, best of 5), for the GB/s figures to be read
against. ``--model`` names a shipped model (models/) or a bench model ``<shape>-<qtype>`` of
scripts/make_bench_models.py (written first when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import MODELS, N_CTX, ROOT, post, start_busy, stop, wait_http  # noqa: E402


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of all tensor data in the GGUF (what a decode step reads, tied embeddings included)."""
    sys.path.insert(0, str(ROOT))
    from worker.engine.loading.gguf_loader import read_gguf
    g = read_gguf(str(path))
    return int(sum(t.n_bytes for t in g.tensors.values()))


def bandwidth_gb_s() -> float:
    """Streaming read bandwidth: float32 GEMV over 512 MiB of weights (numpy/OpenBLAS), best of 5."""
    import numpy as np
    w = np.random.default_rng(0).standard_normal((32768, 4096), dtype=np.float32)
    x = np.ones(4096, np.float32)
    best = float("inf")
    w @ x
    for _ in range(5):
        t = time.perf_counter()
        w @ x
        best = min(best, time.perf_counter() - t)
    return round(w.nbytes / best / 1e9, 1)


def resolve_model(name: str | None, gguf: Path | None) -> Path:
    if gguf is not None:
        return gguf.resolve()
    if name in MODELS:
        return (Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models") / MODELS[name]).resolve()
    from make_bench_models import FILE_TYPES, SHAPES, ensure
    for q in FILE_TYPES:
        if name and name.endswith("-" + q) and name[:-len(q) - 1] in SHAPES:
            return ensure(name[:-len(q) - 1], q)
    raise SystemExit(f"unknown model {name!r}: one of {sorted(MODELS)} or <shape>-<qtype> with shape in "
                     f"{sorted(SHAPES)} and qtype in {sorted(FILE_TYPES)}")


def start_server(label: str, gguf: Path, port: int, srv: str | None, tmp: Path) -> subprocess.Popen:
    if label.startswith("llama-t"):
        if not srv:
            raise SystemExit("llama-server not found: pass --llama-server")
        p = subprocess.Popen([srv, "-m", str(gguf), "-t", label[len("llama-t"):], "-c", str(N_CTX), "-np", "1",
                              "--port", str(port), "--host", "127.0.0.1"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        wait_http(port, "/health", timeout=900)
        return p
    threads = ""
    env = dict(os.environ)
    if label.startswith("ours-t"):
        threads = f"n_threads = {int(label[len('ours-t'):])}\n"
    elif label == "ours-fixed":
        env["MODELYARD_ADAPTIVE_THREADS"] = "0"
    elif label != "ours":
        raise SystemExit(f"unknown server {label!r}")
    cfg = tmp / f"{label}.toml"
    cfg.write_text(f'[server]\nport = {port}\n[models.m]\npath = "{gguf}"\nn_ctx = {N_CTX}\nparallel = 1\n'
                   f'weights = "quantized"\nload_timeout_s = 900\n{threads}')
    p = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(cfg), "--log-level", "warning"],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    wait_http(port, "/health", timeout=300)
    post(port, "/admin/models/load", {"model": "m"}, timeout=1800)
    return p


def measure(port: int, prompt: str, n_decode: int, after_prompt: bool = False) -> dict:
    if after_prompt:      # one request: the prompt's prefill, then n_decode tokens after it
        t = post(port, "/completion", {"model": "m", "prompt": prompt, "n_predict": n_decode, "ignore_eos": True,
                                       "cache_prompt": False, "temperature": 0})["timings"]
        return {"prefill_tok_s": round(t["prompt_per_second"], 1), "decode_tok_s": round(t["predicted_per_second"], 2),
                "prompt_n": t.get("prompt_n")}
    t = post(port, "/completion", {"model": "m", "prompt": prompt, "n_predict": 1, "cache_prompt": False,
                                   "temperature": 0})["timings"]
    prefill = t["prompt_per_second"]
    t = post(port, "/completion", {"model": "m", "prompt": "The history of the city", "n_predict": n_decode,
                                   "ignore_eos": True, "temperature": 0, "cache_prompt": False})["timings"]
    return {"prefill_tok_s": round(prefill, 1), "decode_tok_s": round(t["predicted_per_second"], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--servers", default="llama-t2,ours")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-after-prompt", action="store_true")
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--bandwidth", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--port", type=int, default=8301)
    a = ap.parse_args()
    gguf = resolve_model(a.model, a.gguf)
    labels = [s for s in a.servers.split(",") if s]
    srv = a.llama_server
    if srv is None and any(s.startswith("llama") for s in labels):
        srv = subprocess.run([str(ROOT.parent / "shared" / "tools" / "build-llama-server")], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    wbytes = gguf_tensor_bytes(gguf)
    head = {"model": gguf.name, "file_mib": round(gguf.stat().st_size / 2**20), "tensor_mib": round(wbytes / 2**20),
            "servers": labels, "busy": a.busy, "decode_after_prompt": a.decode_after_prompt}
    if a.bandwidth:
        head["machine_read_gb_s"] = bandwidth_gb_s()
    head["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(head), flush=True)
    prompt = " ".join(f"word{i % 97}" for i in range(a.prompt_tokens // 3))
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-sbs-"))
    procs: dict[str, subprocess.Popen] = {}
    busy: list[subprocess.Popen] = []
    rows: dict[str, list[dict]] = {s: [] for s in labels}
    try:
        ports = {s: a.port + i for i, s in enumerate(labels)}
        for s in labels:
            procs[s] = start_server(s, gguf, ports[s], srv, tmp)
            measure(ports[s], "Once upon a time", 4)         # warm: first requests, pages touched
        busy = start_busy(a.busy)
        for r in range(a.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for s in order:
                try:
                    row = measure(ports[s], prompt, a.decode_tokens, a.decode_after_prompt)
                except (OSError, RuntimeError) as e:
                    row = {"error": f"{type(e).__name__}: {e}"}
                row = {"round": r, "server": s, **row}
                if "decode_tok_s" in row:
                    row["weights_gb_s"] = round(row["decode_tok_s"] * wbytes / 1e9, 2)
                row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
                rows[s].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for p in busy:
            stop(p)
        for p in procs.values():
            stop(p)
    ref = labels[0]
    summary: dict = {"model": gguf.name, "busy": a.busy, "rounds": a.rounds}
    for s in labels:
        ok = [x for x in rows[s] if "error" not in x]
        if not ok:
            continue
        med = {k: statistics.median(x[k] for x in ok) for k in ("prefill_tok_s", "decode_tok_s", "weights_gb_s")}
        summary[s] = med
        if s != ref:
            pairs = [(x, y) for x, y in zip(rows[s], rows[ref]) if "error" not in x and "error" not in y]
            if pairs:
                summary[f"{s}/{ref}"] = {k: round(statistics.median(x[k] / y[k] for x, y in pairs), 3)
                                         for k in ("prefill_tok_s", "decode_tok_s")}
    summary["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
