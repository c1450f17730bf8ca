"""Record what llama-server answers when a sliding-window model (Gemma 3) reuses a cached prompt.

One llama-server (``-c 2048 -np 1 -t 2``, its defaults otherwise: ``-b 2048 -ub 512``, f16 KV
cache, flash attention auto, 32 context checkpoints) on ``models/gemma-3-270m-q4_k_m.gguf`` gets
the requests of :func:`scenario` in order on ``/completion`` (token ids, greedy, ``ignore_eos``,
``n_probs`` 2): fresh prompts (``cache_prompt: false``), their repeats (``cache_prompt: true``),
prompts that extend (and the same fresh) or share part of an earlier one, a prompt longer than the 512-token window
and one whose history outgrew the sliding-window cache. For each it keeps the tokens, their
logprobs, the top two logprobs of each step (their difference is a
difference of two float32 logits: llama-server normalises its probabilities with a float32 sum
over the vocabulary, which moves every logprob of a step by up to ~5e-4, but not their
differences) and ``timings.prompt_n`` / ``timings.cache_n`` (how much llama-server re-evaluated).

Writes ``tests/fixtures/gemma3-swa-reuse.llamacpp.json``; ``tests/worker/test_swa_reuse.py``
replays the same requests in order on the engine (one slot) and compares.

Usage: ``.venv/bin/python scripts/record_swa_reuse_llamacpp.py [--server PATH] [--port N]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SERVER = Path.home() / ".cache" / "modelyard-anchor" / "build" / "bin" / "llama-server"
GGUF = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
OUT = ROOT / "tests" / "fixtures" / "gemma3-swa-reuse.llamacpp.json"
N_CTX = 2048

SHORT = ["Item 2: the colour of the sky is", "The capital of France is", "def fib(n):\n    return",
         "Once upon a time, in a small village,", "Hello"]
BASE = "The river carried small boats past the old mill while children counted clouds"
WORDS = ("the river carried small boats past the old mill while children counted clouds and a dog "
         "barked at nothing in particular under the bridge near the market square").split()


def long_text(n_words: int, seed: int) -> str:
    import numpy as np

    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def scenario(tokenize) -> list[dict[str, object]]:
    """The requests, in order: ``{"name", "prompt_ids", "n_predict", "cache_prompt"}``."""
    reqs: list[dict[str, object]] = []

    def add(name: str, ids: list[int], n: int, cache: bool) -> None:
        reqs.append({"name": name, "prompt_ids": ids, "n_predict": n, "cache_prompt": cache})

    for i, text in enumerate(SHORT):
        ids = tokenize(text)
        add(f"short{i}-fresh", ids, 5, False)
        add(f"short{i}-repeat1", ids, 5, True)
        add(f"short{i}-repeat2", ids, 5, True)
        if i == 0:  # a prompt extending it: reused up to the checkpoint, not the bits of its fresh run
            ext = tokenize(text + " blue. Item 3: the colour of grass is")
            add("short0-extended", ext, 5, True)
            add("short0-extended-fresh", ext, 5, False)
    a = tokenize(BASE)
    add("base-fresh", a, 5, False)
    add("base-extended", tokenize(BASE + " and a dog barked at nothing"), 5, True)
    add("base-shares-3-tokens", a[:3] + tokenize("sky was grey", add_special=False), 5, True)
    add("base-repeat-after", a, 5, True)
    add("base-extended-fresh", tokenize(BASE + " and a dog barked at nothing"), 5, False)
    long = tokenize(long_text(560, seed=7))[:600]
    add("long600-fresh", long, 5, False)
    add("long600-repeat", long, 5, True)
    wrapped = tokenize(long_text(560, seed=8))[:600]
    add("wrap600-fresh-520", wrapped, 520, False)
    add("wrap600-repeat", wrapped, 5, True)
    return reqs


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, default=Path(os.environ.get("MODELYARD_LLAMA_SERVER", DEFAULT_SERVER)))
    ap.add_argument("--port", type=int, default=9301)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(read_gguf(str(GGUF)).metadata)
    reqs = scenario(lambda t, add_special=True: tok.tokenize(t, add_special=add_special))
    env = dict(os.environ, LD_LIBRARY_PATH=str(args.server.parent))
    cmd = [str(args.server), "-m", str(GGUF), "--host", "127.0.0.1", "--port", str(args.port), "-c", str(N_CTX),
           "-np", "1", "-t", "2", "--seed", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{args.port}"
    out = []
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        for r in reqs:
            res = post(base + "/completion", {
                "prompt": r["prompt_ids"], "n_predict": r["n_predict"], "cache_prompt": r["cache_prompt"],
                "temperature": 0.0, "ignore_eos": True, "n_probs": 2, "return_tokens": True, "seed": 0})
            probs = res["completion_probabilities"]
            rec = dict(r, tokens=[p["id"] for p in probs], logprobs=[p["logprob"] for p in probs],
                       top2=[[[t["id"], t["logprob"]] for t in p["top_logprobs"][:2]] for p in probs],
                       text=res["content"], prompt_n=res["timings"]["prompt_n"], cache_n=res["timings"]["cache_n"])
            out.append(rec)
            print(f"{r['name']:24s} P={len(r['prompt_ids']):4d} cache_n={rec['cache_n']:4d} "
                  f"prompt_n={rec['prompt_n']:4d} {res['content'][:40]!r}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    version = sorted(p.name for p in args.server.parent.glob("libllama.so.*.*"))
    doc = {
        "about": ("llama-server /completion on one slot (-c 2048 -np 1 -t 2, defaults otherwise), the requests "
                  "in order; tokens, logprobs, top-2 logprobs and timings.prompt_n / cache_n of each "
                  "(scripts/record_swa_reuse_llamacpp.py)"),
        "llama": version[-1] if version else args.server.name,
        "gguf": GGUF.name, "n_ctx": N_CTX, "requests": out,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
