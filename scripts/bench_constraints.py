#!/usr/bin/env python3
"""Benchmark constrained decoding: mask cost per token and decode tok/s with and without
a JSON-schema constraint, on one GGUF file.

Usage::

    .venv/bin/python scripts/bench_constraints.py [MODEL.gguf] [--tokens 64] [--repeat 3]

Prints, for the engine's single-sequence path (``Engine.generate``, greedy):

* the llguidance tokenizer build time (once per model; cached after);
* the mask cost per token, ms: ``Constraint.allowed()`` (llguidance's mask into a
  bitmask + unpacking to a boolean vector) and the sampler's masking of the logits,
  measured along a schema-constrained generation, mean and p95;
* decode tok/s of the same prompt unconstrained (``ignore_eos``, ``--tokens`` tokens)
  and constrained by a JSON schema with free-text fields (best of ``--repeat``;
  ``predicted_n / predicted_ms`` as the engine reports them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.constraints import Constraint, ll_tokenizer  # noqa: E402
from worker.engine.sampling import Sampler  # noqa: E402

#: Free-text fields so the constrained run lasts many tokens (a small model writes long strings).
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "year": {"type": "integer"}},
    "required": ["title", "summary", "tags", "year"], "additionalProperties": False}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    eng = Engine.load(a.model, n_ctx=1024)
    n = eng.info.n_vocab
    t0 = time.perf_counter()
    ll_tokenizer(eng.tokenizer, n)
    print(f"model {Path(a.model).name}: n_vocab {n}; llguidance tokenizer built in {time.perf_counter() - t0:.2f} s")
    text = "Write a JSON record about the film Casablanca."
    ids = (eng.tokenize_chat([{"role": "user", "content": text}]) if eng.info.has_chat_template
           else eng.tokenize(text))
    schema = json.dumps(SCHEMA)

    free = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, cache_prompt=False)
    cons = SamplingParams(temperature=0, max_tokens=a.tokens, json_schema=schema, cache_prompt=False)
    best: dict[str, float] = {}
    out = {}
    for _ in range(a.repeat):
        for name, p in (("free", free), ("json_schema", cons)):
            r = eng.generate(ids, p)
            out[name] = r
            best[name] = max(best.get(name, 0.0), 1000.0 * r.predicted_n / r.predicted_ms)

    # mask cost along the constrained answer: the constraint's own mask + the sampler's masking
    toks = out["json_schema"].tokens
    c = Constraint.create(eng.tokenizer, n, schema, None)
    assert c is not None
    sampler = Sampler(cons.validated(n), n)
    logits = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    per: list[float] = []
    for t in toks:
        t1 = time.perf_counter()
        allowed = c.allowed()
        sampler.sample(logits, allowed)
        per.append((time.perf_counter() - t1) * 1000.0)
        c.advance(t)
    t2 = time.perf_counter()
    for _ in toks:
        sampler.sample(logits)
    base = (time.perf_counter() - t2) * 1000.0 / max(1, len(toks))
    mask = np.array(per) - base
    print(f"mask cost per token: mean {mask.mean():.3f} ms, p95 {np.percentile(mask, 95):.3f} ms "
          f"(over {len(toks)} tokens; llguidance mask + unpack {c.mask_ms / max(1, c.n_masks):.3f} ms, "
          f"sampler masking the rest)")
    print(f"decode tok/s: free {best['free']:.1f} ({out['free'].predicted_n} tokens), "
          f"json_schema {best['json_schema']:.1f} ({out['json_schema'].predicted_n} tokens, "
          f"finish {out['json_schema'].finish_reason})")
    print("constrained answer:", out["json_schema"].text[:200])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
