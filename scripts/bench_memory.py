#!/usr/bin/env python3
"""A worker's resident memory by component, in one fresh process: what each import and each load
phase adds, then the resident set by mapping after the first request.

    .venv/bin/python scripts/bench_memory.py [--model smollm2|gemma3] [--weights quantized|f32]
        [--n-ctx 2048] [--prompt-tokens 0]

Steps, each printed with the seconds since start and the resident set (``/proc/self/smaps_rollup``:
``Rss``, its ``Anonymous`` part and the file-backed rest, MiB, and the change): the interpreter;
numpy; zmq, psutil and msgpack; protocol; worker.server (the worker's own modules); the gguf
package; tokenizers; on the quantized path numba and the kernel modules (imported here first so
that their share shows; the load would import them itself); ``Engine.load`` (the GGUF's metadata,
the tokenizer, the weights from the weight cache or built, the kernels' loading); one short
request (``max_tokens`` 4: the weights' pages touched, KV of a few positions); with
``--prompt-tokens N`` a request of an N-token prompt (its KV pages). Then the resident set by
mapping (weight cache ``.npy`` files, the GGUF, anonymous memory and the heap, each shared
library), largest first, and the load's timings. Nothing is measured against llama-server here:
``scripts/bench_weights.py`` does that.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

T0 = time.monotonic()
ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}


def rollup() -> dict[str, float]:
    """``/proc/self/smaps_rollup`` fields in MiB."""
    out: dict[str, float] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            p = line.split()
            if len(p) >= 3 and p[-1] == "kB":
                out[p[0].rstrip(":")] = int(p[1]) / 1024
    return out


_prev = [0.0, 0.0, 0.0]


def mark(label: str) -> None:
    d = rollup()
    cur = [d["Rss"], d.get("Anonymous", 0.0), d["Rss"] - d.get("Anonymous", 0.0)]
    print(f"{time.monotonic() - T0:7.3f}s {label:28s} rss {cur[0]:7.1f} ({cur[0] - _prev[0]:+7.1f})  "
          f"anon {cur[1]:7.1f} ({cur[1] - _prev[1]:+7.1f})  file {cur[2]:7.1f} ({cur[2] - _prev[2]:+7.1f})", flush=True)
    _prev[:] = cur


def by_mapping(top: int = 14) -> None:
    groups: dict[str, float] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            p = line.split()
            if p and "-" in p[0] and not p[0].endswith(":"):
                path = p[5] if len(p) > 5 else "[anon]"
                if "/npy/" in path:
                    path = "weight cache (.npy)"
                elif path.endswith(".gguf"):
                    path = "GGUF"
                elif "site-packages/" in path:
                    path = "site-packages/" + path.split("site-packages/")[1].split("/")[0]
                name = path
            elif p and p[0] == "Rss:":
                groups[name] = groups.get(name, 0.0) + int(p[1]) / 1024
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {v:7.1f} MiB  {k}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--weights", default="quantized", choices=["quantized", "f32"])
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=0)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    mark("interpreter")
    import numpy  # noqa: F401
    mark("numpy")
    import msgpack  # noqa: F401
    import psutil  # noqa: F401
    import zmq  # noqa: F401
    mark("zmq, psutil, msgpack")
    import protocol  # noqa: F401
    mark("protocol")
    import worker.server  # noqa: F401
    mark("worker.server")
    import gguf  # noqa: F401
    mark("gguf package")
    import tokenizers  # noqa: F401
    mark("tokenizers")
    if a.weights == "quantized":
        import numba  # noqa: F401
        mark("numba")
        from worker.engine.kernels import attn_kernels, quant_kernels  # noqa: F401
        mark("kernel modules")
    from worker.engine import Engine, SamplingParams

    path = Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models") / MODELS[a.model]
    e = Engine.load(str(path), n_ctx=a.n_ctx, weights=a.weights)
    mark("Engine.load")
    m = e._model
    e.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0))
    mark("request, 4 tokens")
    if a.prompt_tokens:
        prompt = " ".join(f"word{i % 97}" for i in range(a.prompt_tokens // 3))
        e.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
        mark(f"request, ~{a.prompt_tokens}-token prompt")
    print(f"weights {m.weights}: {m.weight_bytes / 2**20:.1f} MiB, from the weight cache: {m.weights_from_cache}; "
          f"KV {e.info.kv_token_bytes} bytes per position, {e.kv_tokens} positions held; load timings "
          + ", ".join(f"{k} {v:.3f} s" for k, v in m.load_timings.items()))
    by_mapping()
    print(f"loadavg {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
