#!/usr/bin/env python3
"""Disaggregated prefill/decode on a real model, through a live router: text, cancel, stalls.

    .venv/bin/python scripts/bench_disaggregate.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--long-words 1950] [--repeat 2] [--only text,cancel,gap] [--stream-tokens 150] [--gap-models m,m-d]

It starts ``python -m router serve`` on a config with three models of the one GGUF:
``m`` (one worker does everything), ``m-p`` (the prefill worker) and ``m-d``
(``prefill_model = "m-p"``, the default ``kv_transfer = "wire"``), and measures:

* **text**: greedy ``/completion`` of a ~600-token prompt on ``m`` and on ``m-d``: equal?
* **cancel**: a streamed request's client closes its socket in one phase, and the time
  until every worker of the request is free: ``freed_s`` = close -> ``/slots`` of the
  workers shows nothing processing (includes the ``/slots`` polling), and ``router_ms`` =
  the router's own "cancelled; worker free after" log figure (its Cancel frame -> the
  worker's final frame). Phases: ``prefill`` (the long prompt on ``m-p``), ``transfer``
  (``m-p`` has finished its prefill, ``m-d`` has not started decoding: the state is on the
  wire), ``decode`` (after the first streamed token on ``m-d``) and ``single`` (the long
  prompt's prefill on ``m``).
* **gap**: the worst inter-token gap of a running decode stream (a short prompt,
  ``--stream-tokens``; make it outlast the long prompt, transfer included) while a long prompt (``--long-words``, ~2,000 tokens for the default 1,950 words) arrives on
  the same model: ``m`` (one worker) vs ``m-d`` (split), alternated ``--repeat`` times.

Prints one JSON line per measurement and the load average (the machine may be shared:
compare the variants of one run, not runs of different days).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river carried small boats past the old mill while children counted clouds and a dog "
         "barked at nothing in particular under the bridge near the market square").split()


def text_of(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def emit(**kw: object) -> None:
    kw["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(kw), flush=True)


class Router:
    def __init__(self, model: Path, n_ctx: int) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
        cfg = self.tmp / "config.toml"
        cfg.write_text(f"""
[server]
models_dir = "{model.parent.resolve()}"
[defaults]
n_ctx = {n_ctx}
parallel = 2
load_timeout_s = 600
[models.m]
path = "{model.name}"
[models.m-p]
path = "{model.name}"
[models.m-d]
path = "{model.name}"
prefill_model = "m-p"
""")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.tmp / "router.log"
        self._log = self.log_path.open("wb")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(cfg), "--port",
                                      str(self.port)], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=900)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"router did not start:\n{self.log()}")
            time.sleep(0.2)
        for m in ("m", "m-p", "m-d"):
            assert self.http.post("/models/load", json={"model": m}).status_code == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def busy(self, model: str) -> bool:
        return any(s["is_processing"] for s in self.http.get("/slots", params={"model": model}).json())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def completion(r: Router, model: str, prompt: str, n: int) -> dict:
    resp = r.http.post("/completion", json={"model": model, "prompt": prompt, "n_predict": n, "temperature": 0,
                                             "cache_prompt": False})
    resp.raise_for_status()
    return resp.json()


def bench_text(r: Router, args: argparse.Namespace) -> None:
    prompt = text_of(450, seed=31)
    one, split = completion(r, "m", prompt, 16), completion(r, "m-d", prompt, 16)
    emit(what="text", equal=one["content"] == split["content"], prompt_tokens=one["tokens_evaluated"],
         split_cache_n=split["timings"]["cache_n"], single=one["content"][:60], split=split["content"][:60])


def raw_stream(r: Router, model: str, prompt: str) -> socket.socket:
    body = json.dumps({"model": model, "prompt": prompt, "n_predict": 200, "temperature": 0, "ignore_eos": True,
                       "stream": True, "cache_prompt": False}).encode()
    sock = socket.create_connection(("127.0.0.1", r.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def wait(cond, timeout: float = 600.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.01)


def bench_cancel(r: Router, args: argparse.Namespace, seed: int) -> None:
    long = text_of(args.long_words, seed=seed)
    for phase in ("prefill", "transfer", "decode", "single"):
        models = ("m",) if phase == "single" else ("m-p", "m-d")
        before = len(r.log())
        sock = raw_stream(r, "m" if phase == "single" else "m-d", long + f" {phase} {seed}")
        if phase in ("prefill", "single"):
            wait(lambda: r.busy(models[0]))
        elif phase == "transfer":
            wait(lambda: r.busy("m-p"))
            wait(lambda: not r.busy("m-p"))  # its prefill ended: the state is on its way
            if r.busy("m-d"):
                phase = "transfer-missed(decode)"
        else:
            sock.settimeout(900)
            got = b""
            while b"data: " not in got:
                got += sock.recv(65536)
        t0 = time.perf_counter()
        sock.close()
        wait(lambda: not any(r.busy(m) for m in models))
        freed = time.perf_counter() - t0
        time.sleep(0.5)  # the router's log line follows its worker's final frame
        new = r.log()[before:]
        router_ms = [float(x) for x in re.findall(r"cancelled; worker free after ([0-9.]+) ms", new)]
        streamed = "streamed its KV state" in new
        emit(what="cancel", phase=phase, freed_s=round(freed, 3), router_ms=router_ms,
             state_sent_before_cancel=streamed)


def token_times(r: Router, model: str, n: int, on_token) -> list[float]:  # noqa: ANN001
    times: list[float] = []
    with r.http.stream("POST", "/completion", json={"model": model, "prompt": "Count slowly:", "n_predict": n,
                                                    "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]" or json.loads(line[6:]).get("stop"):
                continue
            times.append(time.perf_counter())
            on_token(len(times))
    return times


def bench_gap(r: Router, args: argparse.Namespace, rep: int) -> None:
    for model in args.gap_models.split(","):
        spans: dict[str, float] = {}
        th: list[threading.Thread] = []

        def long_request(model: str = model) -> None:
            c = httpx.Client(base_url=r.url, timeout=900)
            spans["t0"] = time.perf_counter()
            c.post("/completion", json={"model": model, "prompt": text_of(args.long_words, seed=100 + rep),
                                        "n_predict": 1, "temperature": 0, "cache_prompt": False})
            spans["t1"] = time.perf_counter()

        def on_tok(i: int) -> None:
            if i == 5:
                t = threading.Thread(target=long_request)
                t.start()
                th.append(t)

        times = token_times(r, model, args.stream_tokens, on_tok)
        for t in th:
            t.join()
        pairs = [(a, b) for a, b in zip(times, times[1:]) if b >= spans["t0"] and a <= spans["t1"]]
        during = sorted(b - a for a, b in pairs)
        worst = max(pairs, key=lambda p: p[1] - p[0]) if pairs else None
        base = sorted(b - a for a, b in zip(times[1:5], times[2:5]))
        emit(what="gap", model=model, rep=rep, worst_gap_ms=round(during[-1] * 1e3) if during else None,
             worst_gap_at_s=round(worst[0] - spans["t0"], 2) if worst else None,
             p50_gap_during_ms=round(during[len(during) // 2] * 1e3) if during else None,
             tokens_during=len(during), median_gap_before_ms=round(base[len(base) // 2] * 1e3) if base else None,
             long_prompt_s=round(spans["t1"] - spans["t0"], 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--long-words", type=int, default=1950, help="words of the long prompt (~2,000 tokens)")
    ap.add_argument("--stream-tokens", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--gap-models", default="m,m-d", help="which variants the gap measurement runs")
    ap.add_argument("--only", default="text,cancel,gap")
    args = ap.parse_args()
    only = set(args.only.split(","))
    r = Router(args.model, args.n_ctx)
    try:
        emit(what="start", model=args.model.name)
        if "text" in only:
            bench_text(r, args)
        for rep in range(args.repeat):
            if "cancel" in only:
                bench_cancel(r, args, seed=rep)
            if "gap" in only:
                bench_gap(r, args, rep)
    finally:
        r.stop()


if __name__ == "__main__":
    main()
