#!/usr/bin/env python3
"""How a step's prompt budget trades a running stream's inter-token gap for prefill speed.

    .venv/bin/python scripts/bench_chunking.py [--model smollm2|gemma3] [--weights quantized|f32]
        [--prompt 1500] [--caps 128,256,512] [--n-batch 256,512] [--repeats 3]

In one process, on the engine (no HTTP), variants alternated within each repeat:

* ``alone n_batch=B``: a ~``--prompt``-token prompt prefilled alone with a step budget of B
  prompt tokens (how many tokens a forward pass carries while nothing decodes): prefill tok/s.
* ``beside a stream cap=C``: the same prompt arriving while one stream decodes, with at most C
  prompt tokens per step while others decode (``scheduler.DECODE_PREFILL_CHUNK``; C = n_ubatch
  = 512 is "one whole micro-batch per step"): the stream's worst gap between two tokens while
  the prompt prefills, and the prompt's prefill tok/s (its time to first token).

The prompt is cut into the same n_ubatch (512) micro-batches in every variant, so every
variant computes the same logprobs (checked: the prompt's first token's top logprobs are
compared across variants and must be equal on the quantized path). Prints one JSON line per
measurement, then the medians and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine import scheduler as sched_mod  # noqa: E402

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
TEXT = "The quick brown fox jumps over the lazy dog while the river flows past old stone bridges and green hills. "


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n_probs=5, cache_prompt=False)


def alone(eng: Engine, ids: list[int], n_batch: int) -> tuple[float, list]:
    eng.reset_cache()
    eng._sched.n_batch = n_batch  # noqa: SLF001 - the knob under test
    first: list = []
    t0 = time.perf_counter()
    eng.generate(ids, params(1), on_token=lambda e: first.append(e.top_logprobs))
    return len(ids) / (time.perf_counter() - t0), first


def beside_stream(eng: Engine, ids: list[int], stream: list[int], cap: int) -> tuple[float, float, list]:
    """(worst gap of the stream while the prompt prefills, s; the prompt's prefill tok/s; its first top)."""
    eng.reset_cache()
    sched_mod.DECODE_PREFILL_CHUNK = cap
    times: list[float] = []
    first: list = []
    eng.add("s", stream, params(2000), on_token=lambda e: times.append(time.perf_counter()))
    while len(times) < 5:
        eng.step()
    t0 = time.perf_counter()
    eng.add("p", ids, params(1), on_token=lambda e: first.append((time.perf_counter(), e.top_logprobs)))
    n0 = len(times)
    while not first:
        eng.step()
    t1 = first[0][0]
    eng.abort("s")
    while eng.has_work:
        eng.step()
    during = [t for t in times[n0 - 1:] if t <= t1 + 1e-9] + [t for t in times if t > t1][:1]
    gaps = [b - a for a, b in zip(during, during[1:])]
    return max(gaps), len(ids) / (t1 - t0), first[0][1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--weights", default="quantized", choices=("quantized", "f32"))
    ap.add_argument("--prompt", type=int, default=1500, help="prompt tokens (about)")
    ap.add_argument("--caps", default="128,256,512")
    ap.add_argument("--n-batch", default="256,512")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    gguf = Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models") / MODELS[a.model]
    eng = Engine.load(str(gguf), n_ctx=4096, parallel=2, weights=a.weights)
    ids = eng.tokenize(TEXT * (a.prompt // 21 + 1))[: a.prompt]
    stream = eng.tokenize("Once upon a time")
    caps = [int(x) for x in a.caps.split(",")]
    batches = [int(x) for x in a.n_batch.split(",")]
    alone(eng, ids[:600], 256)  # warm-up
    res: dict[str, list[tuple[float, ...]]] = {}
    tops: list = []
    for r in range(a.repeats):
        for nb in batches:
            tok_s, top = alone(eng, ids, nb)
            tops.append(top)
            res.setdefault(f"alone n_batch={nb}", []).append((tok_s,))
            print(json.dumps({"repeat": r, "variant": f"alone n_batch={nb}", "prefill_tok_s": round(tok_s, 1),
                              "loadavg": [round(x, 2) for x in os.getloadavg()]}), flush=True)
        for cap in caps:
            gap, tok_s, top = beside_stream(eng, ids, stream, cap)
            tops.append([top])
            res.setdefault(f"beside a stream cap={cap}", []).append((gap, tok_s))
            print(json.dumps({"repeat": r, "variant": f"beside a stream cap={cap}", "worst_gap_s": round(gap, 3),
                              "prefill_tok_s": round(tok_s, 1), "loadavg": [round(x, 2) for x in os.getloadavg()]}),
                  flush=True)
    same = all(t == tops[0] for t in tops)
    summary = {k: {"median_" + n: round(statistics.median(v[i] for v in vs), 3)
                   for i, n in enumerate(("worst_gap_s", "prefill_tok_s") if len(vs[0]) == 2 else ("prefill_tok_s",))}
               for k, vs in res.items()}
    print(json.dumps({"model": a.model, "weights": a.weights, "prompt_tokens": len(ids), "summary": summary,
                      "first_token_top_logprobs_equal_in_every_variant": same,
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    return 0 if same or a.weights == "f32" else 1


if __name__ == "__main__":
    sys.exit(main())
