#!/usr/bin/env python3
"""Weight paths side by side with llama-server on the same GGUF: cold first token, prefill,
single-stream decode and resident memory.

    .venv/bin/python scripts/bench_weights.py [--model smollm2|gemma3] [--llama-server PATH]
        [--skip-llama] [--prompt-tokens 512] [--decode-tokens 128] [--repeat 3] [--cold-repeat 1] [--port 8191]
        [--cold-only] [--servers llama,f32,quantized,quantized-nospare]
    .venv/bin/python scripts/bench_weights.py --kernels [--model ...] [--threads 2]

Servers, one at a time (never two measured at once; ``--servers`` picks some, in that order):
llama-server (``-t 2 -c 2048 -np 1``), modelyard with ``weights = "f32"``, with ``weights =
"quantized"`` (both with the warm spare, the default), and ``quantized-nospare`` (``warm_spare =
false``); ``parallel = 1``, n_ctx 2048. For each:

* ``cold_first_token_s``: from sending the first request to its first streamed token, the model
  never loaded in that process (a short ``/completion``; includes the model's load, the prompt and
  one decode step). modelyard: the router is up (``/health``) and, with the spare, the spare is
  warm (``/admin/models`` ``spare.state``) before the request is sent, so the figure holds the
  worker's start (without the spare) and the model's load. llama-server loads its model at start
  and has no "up, model not loaded" state: its request is sent as its process starts and retried
  until it is accepted, so its figure holds its whole start. With ``--cold-repeat N`` every server
  is started N times, the servers alternating (llama, f32, quantized, ..., llama, ...), before the
  measured run: ``cold_first_token_s`` is the median, ``cold_first_token_all_s`` every value;
* ``start_to_first_token_s`` (modelyard): from starting the router process to that first token,
  the wait for its spare included (as the old ``cold_first_token_s``, measured without a spare);
  ``spare_rss_mib``: the warm spare's resident set just before the request, from ``/admin/models``;
* ``worker_rss_first_mib``: the worker's (llama-server's) resident set right after that first
  token: the footprint before any long prompt (KV pages are written as positions fill, in both);
* ``prefill_tok_s``: ``timings.prompt_per_second`` of a ~``--prompt-tokens`` prompt
  (``cache_prompt: false``), best of ``--repeat``;
* ``decode_tok_s``: ``timings.predicted_per_second`` of ``--decode-tokens`` greedy tokens
  (``ignore_eos``), best of ``--repeat``;
* ``rss_mib``: resident set of the serving process(es) after those requests (llama-server; the
  router plus its worker and, with the spare, the new spare for modelyard; ``worker_rss_mib``: the
  model's worker alone). Not like for like in one respect:
  llama-server's KV cache is one slot of ``-c`` positions in f16, allocated and cleared at start
  (so resident from the first token on), while modelyard's idle sequences stay as a prefix cache
  within ``kv_budget_mib`` (float32 positions, resident once written): ``kv_cache_tokens`` (from
  /metrics) is the positions the worker holds at the end.

``--cold-only``: the first-token figures alone (no prefill / decode requests).

Prints one JSON line per server, then the ratios to llama-server and the load average. A server
that drops a connection during the prefill/decode requests keeps its row with an ``error`` field
(its first-token figures stand; the ratios then omit the later ones) and the other servers still run.
OPENBLAS_* are left as the machine sets them.

``--kernels [--threads N]``: no servers; the model's own weight matrices (one block's fused
QKV, O, gate/up and down, and the output projection) multiplied in-process by the quantized
kernel and by sgemm on their float32 dequantization, at 1, 4, 8, 32, 128 and 256 rows
(alternating, best of 5): microseconds per call and the quantized/sgemm time ratio.

``--engine-cpu [--threads 1]``: no servers; three engines loaded in this process: ``f32``,
``quantized`` and ``quantized-ref`` (the quantized path on the reference kernels, the ones a CPU
without AVX512-VNNI runs, built as with ``MODELYARD_QUANT_VNNI=0``: the same bits). CPU seconds
(``time.process_time``, which contention from other processes barely moves) per prompt token of
a ``--prompt-tokens`` prefill, per generated token of a ``--decode-tokens`` greedy decode, and per
generated token of ``--streams`` sequences (8-token prompts) decoding 32 tokens each in shared
forward passes; the engines alternate, best of ``--repeat``; then the ratios to ``f32`` and of
``quantized-ref`` to ``quantized``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import MODELS, N_CTX, ROOT, post, stop  # noqa: E402


def wait_up(port: int, proc: subprocess.Popen, spare: bool, timeout: float = 600) -> tuple[float | None, float]:
    """Wait until modelyard on ``port`` answers /health and, with ``spare``, its warm spare is warm.
    Returns (the spare's RSS in MiB or None, monotonic time it was up)."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/admin/models" if spare else "/health")
            r = c.getresponse()
            body = r.read()
            if r.status == 200:
                if not spare:
                    return None, time.monotonic()
                s = json.loads(body).get("spare") or {}
                if s.get("state") == "warm" and s.get("rss_bytes"):
                    return round(s["rss_bytes"] / 2**20, 1), time.monotonic()
        except (OSError, http.client.HTTPException, ValueError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("the router (or its spare) did not come up")
        time.sleep(0.05)


def first_token_s(port: int, model: str, t_start: float, timeout: float = 600,
                  proc: subprocess.Popen | None = None) -> float:
    """Seconds from ``t_start`` to the first streamed token of a short /completion. Raises
    RuntimeError if ``proc`` (the server) exits meanwhile (e.g. its port was taken: another
    server would answer instead)."""
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before its first token (port {port} taken?)")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            c.request("POST", "/completion", json.dumps({"model": model, "prompt": "Once upon a time",
                                                         "n_predict": 4, "stream": True}),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status == 200:
                break
            r.read()
        except OSError:
            pass
        if time.monotonic() - t_start > timeout:
            raise TimeoutError("no first token")
        time.sleep(0.02)
    while True:
        line = r.readline()
        if not line:
            raise RuntimeError("stream ended before a token")
        if line.startswith(b"data: ") and json.loads(line[6:]).get("content"):
            t = time.monotonic() - t_start
            r.read()
            return t


def kv_cache_tokens(port: int) -> int | None:
    """``modelyard_kv_cache_tokens`` of the router's /metrics (the worker's last Pong), or None."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/metrics")
        for line in c.getresponse().read().decode().splitlines():
            if line.startswith("modelyard_kv_cache_tokens"):
                return int(float(line.rsplit(" ", 1)[1]))
    except (OSError, ValueError):
        pass
    return None


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return round(total / 2**20, 1)


def measure(port: int, model: str, prompt: str, n_decode: int, repeat: int) -> dict:
    prefill = decode = 0.0
    for _ in range(repeat):
        t = post(port, "/completion", {"model": model, "prompt": prompt, "n_predict": 1, "cache_prompt": False,
                                       "temperature": 0})["timings"]
        prefill = max(prefill, t["prompt_per_second"])
        t = post(port, "/completion", {"model": model, "prompt": "The history of the city", "n_predict": n_decode,
                                       "ignore_eos": True, "temperature": 0, "cache_prompt": False})["timings"]
        decode = max(decode, t["predicted_per_second"])
    return {"prefill_tok_s": round(prefill, 1), "decode_tok_s": round(decode, 1)}


def bench_kernels(gguf: Path, threads: int) -> None:
    """Quantized kernel vs sgemm on the model's matrices, in this process (see the docstring)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    sys.path.insert(0, str(ROOT))
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.arch.model import load_model
    from worker.engine.kernels.quant import set_num_threads

    threadpool_limits(limits=threads, user_api="blas")
    set_num_threads(threads)
    m = load_model(read_gguf(str(gguf)), n_ctx=256, weights="quantized", weight_cache=False)
    names = [n for n in ("blk.0.wqkv", "blk.0.wo", "blk.0.wgu", "blk.0.wdown") if n in m.w] + ["tok_embd"]
    rng = np.random.default_rng(0)
    for name in names:
        w = m.w[name]
        wf = np.concatenate([p.dequantize() if hasattr(p, "dequantize") else p for p in getattr(w, "parts", [w])])
        for T in (1, 4, 8, 32, 128, 256):
            if name == "tok_embd" and T > 8:
                continue
            x = rng.standard_normal((T, wf.shape[1])).astype(np.float32)
            fns = {"quantized": lambda: w.matmul(x), "sgemm": lambda: (wf @ x.T).T}
            best = {k: float("inf") for k in fns}
            for f in fns.values():
                f()
            reps = max(1, 64 // T)
            for _ in range(5):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        f()
                    best[k] = min(best[k], (time.perf_counter() - t0) / reps)
            print(json.dumps({"matrix": name, "shape": list(wf.shape), "rows": T, "threads": threads,
                              "quantized_us": round(best["quantized"] * 1e6), "sgemm_us": round(best["sgemm"] * 1e6),
                              "ratio": round(best["quantized"] / best["sgemm"], 3),
                              "loadavg": [round(v, 2) for v in os.getloadavg()]}), flush=True)


def bench_engine_cpu(gguf: Path, threads: int, prompt_tokens: int, decode_tokens: int, repeat: int,
                     streams: list[int]) -> None:
    """CPU seconds per token of the f32, quantized and quantized-ref engines in this process (see the docstring)."""
    from threadpoolctl import threadpool_limits

    sys.path.insert(0, str(ROOT))
    from worker.engine import Engine, SamplingParams
    from worker.engine.kernels import quant

    threadpool_limits(limits=threads, user_api="blas")
    quant.set_num_threads(threads)
    os.environ["MODELYARD_WEIGHT_CACHE"] = "0"         # each engine builds its own form (none read from a cache)
    par = max(streams, default=1)
    engines: dict[str, Any] = {}
    for label in ("f32", "quantized", "quantized-ref"):
        vnni = quant.host_has_vnni()
        if label == "quantized-ref":
            quant._vnni = False                        # the reference forms (what MODELYARD_QUANT_VNNI=0 builds)
        try:
            engines[label] = Engine.load(str(gguf), n_ctx=1024, parallel=par, weights=label.split("-")[0])
        finally:
            quant._vnni = vnni
    quant.set_num_threads(threads)                     # numba's count is per thread: this one's (the loads ran elsewhere)
    text = " ".join(f"word{i % 97}" for i in range(prompt_tokens // 3 + 16))
    best: dict[str, dict[str, float]] = {w: {"prefill": float("inf"), "decode": float("inf"),
                                             **{f"agg{n}": float("inf") for n in streams}} for w in engines}

    def run(e: Any, n_prompt: int, n_gen: int) -> float:
        prompt = e.tokenize(text, add_special=True)[:n_prompt]
        e.reset_cache()
        t0 = time.process_time()
        e.generate(prompt, SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True, cache_prompt=False))
        return time.process_time() - t0

    def aggregate(e: Any, n: int) -> float:
        # n sequences of 8-token prompts decoding 32 tokens each, sharing forward passes
        e.reset_cache()
        base = e.tokenize(text, add_special=True)
        for i in range(n):
            e.add(f"s{i}", base[i:i + 8], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                                          cache_prompt=False))
        t0, done = time.process_time(), 0
        while done < n:
            done += len(e.step())
        return (time.process_time() - t0) / (32 * n)

    for e in engines.values():
        run(e, 16, 2)                                  # kernels loaded, caches warm
    for _ in range(repeat):
        for w, e in engines.items():                   # alternating
            p = run(e, prompt_tokens, 1)               # prefill (+1 token)
            g = run(e, 8, decode_tokens) - run(e, 8, 1)
            best[w]["prefill"] = min(best[w]["prefill"], p / prompt_tokens)
            best[w]["decode"] = min(best[w]["decode"], g / (decode_tokens - 1))
            for n in streams:
                best[w][f"agg{n}"] = min(best[w][f"agg{n}"], aggregate(e, n))
    keys = ["prefill", "decode"] + [f"agg{n}" for n in streams]
    names = {"prefill": f"prefill{prompt_tokens}", "decode": "decode", **{f"agg{n}": f"{n}_streams" for n in streams}}
    for w, b in best.items():
        print(json.dumps({"model": gguf.name, "weights": w, "threads": threads,
                          **{f"{names[k]}_cpu_ms_per_token": round(b[k] * 1e3, 3) for k in keys},
                          "loadavg": [round(v, 2) for v in os.getloadavg()]}), flush=True)
    print(json.dumps({"model": gguf.name, "speedup_vs_f32": {names[k]: round(best["f32"][k] / best["quantized"][k], 2)
                                                             for k in keys},
                      "speedup_vs_ref": {names[k]: round(best["quantized-ref"][k] / best["quantized"][k], 2)
                                         for k in keys},
                      "ref_vs_f32": {names[k]: round(best["f32"][k] / best["quantized-ref"][k], 2) for k in keys}}),
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold-repeat", type=int, default=1, help="cold starts per server (alternating); median")
    ap.add_argument("--cold-only", action="store_true", help="the first-token figures alone (no prefill/decode)")
    ap.add_argument("--servers", default="llama,f32,quantized,quantized-nospare",
                    help="which servers, in this order (llama, f32, quantized, quantized-nospare)")
    ap.add_argument("--kernels", action="store_true", help="kernel vs sgemm in-process, no servers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8191, help="the servers' port, one server at a time (default 8191)")
    ap.add_argument("--engine-cpu", action="store_true", help="CPU time per token of the engines in-process")
    ap.add_argument("--streams", default="8,32", help="--engine-cpu: concurrent sequences (comma-separated)")
    a = ap.parse_args()
    gguf = (Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models") / MODELS[a.model]).resolve()
    if a.kernels:
        bench_kernels(gguf, a.threads)
        return 0
    if a.engine_cpu:
        bench_engine_cpu(gguf, a.threads, a.prompt_tokens, a.decode_tokens, a.repeat,
                         [int(v) for v in a.streams.split(",") if v])
        return 0
    srv = a.llama_server
    if srv is None and not a.skip_llama:
        srv = subprocess.run([str(ROOT.parent / "shared" / "tools" / "build-llama-server")], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    prompt = " ".join(f"word{i % 97}" for i in range(a.prompt_tokens // 3))  # ~3 tokens per word
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-bench-"))
    rows: dict[str, dict] = {}
    known = {"llama": (None, False), "f32": ("f32", True), "quantized": ("quantized", True),
             "quantized-nospare": ("quantized", False)}
    wanted = [v for v in a.servers.split(",") if v]
    if unknown := [v for v in wanted if v not in known]:
        ap.error(f"--servers: unknown {unknown}; known: {', '.join(known)}")
    runs = [(label, *known[label]) for label in wanted if label != "llama" or srv]
    port = a.port

    def start(label: str, weights: str | None, spare: bool) -> tuple[subprocess.Popen, float]:
        t0 = time.monotonic()
        if weights is None:
            proc = subprocess.Popen([srv, "-m", str(gguf), "-t", "2", "-c", str(N_CTX), "-np", "1", "--port",
                                     str(port), "--host", "127.0.0.1"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        else:
            cfg = tmp / f"{label}.toml"
            cfg.write_text(f'[server]\nport = {port}\nwarm_spare = {str(spare).lower()}\n[models.m]\n'
                           f'path = "{gguf}"\nn_ctx = {N_CTX}\nparallel = 1\nweights = "{weights}"\n')
            proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(cfg), "--log-level",
                                     "warning"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        return proc, t0

    def cold_start(label: str, weights: str | None, spare: bool) -> tuple[subprocess.Popen, dict]:
        """Start the server and take its first token cold: (the process, its figures)."""
        proc, t0 = start(label, weights, spare)
        try:
            if weights is None:  # llama-server: the request goes out as the process starts
                return proc, {"cold_first_token_s": round(first_token_s(port, "m", t0, proc=proc), 3)}
            spare_rss, t_up = wait_up(port, proc, spare)
            cold = first_token_s(port, "m", t_up, proc=proc)
            figs = {"cold_first_token_s": round(cold, 3), "start_to_first_token_s": round(time.monotonic() - t0, 3)}
            if spare:
                figs["spare_rss_mib"] = spare_rss
            return proc, figs
        except BaseException:
            stop(proc)
            raise

    def serving_pids(proc: subprocess.Popen) -> list[int]:
        return [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]

    cold: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    for _ in range(max(0, a.cold_repeat - 1)):
        for label, weights, spare in runs:
            proc, figs = cold_start(label, weights, spare)
            cold[label].append({**figs, "loadavg": round(os.getloadavg()[0], 2)})
            stop(proc)
            wait_closed(port)
    for label, weights, spare in runs:
        proc, figs = cold_start(label, weights, spare)
        try:
            cold[label].append({**figs, "loadavg": round(os.getloadavg()[0], 2)})
            runs_of = cold[label]
            pids = serving_pids(proc)
            row: dict = {"model": a.model, "server": label}
            for key in figs:  # the median of each figure over the cold starts
                vals = sorted(f[key] for f in runs_of if f.get(key) is not None)
                row[key] = vals[len(vals) // 2] if vals else None
            if len(runs_of) > 1:
                row["cold_first_token_all_s"] = [f["cold_first_token_s"] for f in runs_of]
                row["loadavg_1m_each"] = [f["loadavg"] for f in runs_of]
            # the serving worker (not a replacement spare started since): the model's pid
            mp = model_pid(port)
            worker_pids = pids if weights is None else [mp] if mp is not None else pids[1:2]
            row["worker_rss_first_mib"] = rss_mib(worker_pids)
            if not a.cold_only:
                try:
                    row.update(measure(port, "m", prompt, a.decode_tokens, a.repeat))
                except (OSError, http.client.HTTPException) as e:  # e.g. a server dropping a connection under load
                    row["error"] = f"{type(e).__name__}: {e}"   # the row is kept, the other servers still run
                pids = serving_pids(proc)
                row["rss_mib"] = rss_mib(pids)
                if weights is not None:
                    row["worker_rss_mib"] = rss_mib(worker_pids)
                    row["kv_cache_tokens"] = kv_cache_tokens(port)
            row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            rows[label] = row
            print(json.dumps(row), flush=True)
        finally:
            stop(proc)
            wait_closed(port)
    if "llama" in rows:
        ref = rows["llama"]
        for label, weights, _ in runs:
            if weights is None:
                continue
            r = rows[label]
            ratio = {"ratio_to_llama": label, "model": a.model,
                     "cold_first_token": round(r["cold_first_token_s"] / ref["cold_first_token_s"], 3),
                     "worker_rss_first": round(r["worker_rss_first_mib"] / ref["worker_rss_first_mib"], 3)}
            if not a.cold_only and "error" not in r and "error" not in ref:  # the figures after the first token
                ratio.update({"decode": round(r["decode_tok_s"] / ref["decode_tok_s"], 3),
                              "prefill": round(r["prefill_tok_s"] / ref["prefill_tok_s"], 3),
                              "rss": round(r["rss_mib"] / ref["rss_mib"], 3),
                              "worker_rss": round(r["worker_rss_mib"] / ref["rss_mib"], 3)})
            print(json.dumps({**ratio, "loadavg": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    return 0


def model_pid(port: int) -> int | None:
    """The pid of model ``m``'s worker, from the router's /admin/models (None if unknown)."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/admin/models")
        data = json.loads(c.getresponse().read())["data"]
        return next((m["pid"] for m in data if m["id"] == "m"), None)
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return None


def wait_closed(port: int, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/health")
        except OSError:
            return
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
