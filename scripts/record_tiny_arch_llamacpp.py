#!/usr/bin/env python3
"""Record llama.cpp's next-token log-probabilities on tiny random-weight qwen2 / qwen3 GGUFs.

Each file of :data:`FILES` is written by ``tests/worker/tiny_gguf.py``'s
``write_tiny_qwen`` (seeded: the same bytes every time, the sha256 is recorded) and
served by llama.cpp's ``llama-server``, once per setting of :data:`SETTINGS`:

* ``exact``: ``--cache-type-k f32 --cache-type-v f32 -fa off`` — no f16 KV cache, no
  flash attention: what the engine's float32 path computes (on F32 weights llama.cpp's
  matmuls are then plain float32 too);
* ``ggml``: ``--cache-type-k f16 --cache-type-v f16 -fa on`` — llama.cpp's usual
  serving numerics, which the engine's quantized path (``weights="quantized"``:
  8-bit activations, q/k/v rounded to f16) follows.

For every prefix ``PROMPT[:i]`` (i = 1..len(PROMPT)) one ``/completion`` request with
``n_predict: 1, n_probs: <vocab size>, post_sampling_probs: false, cache_prompt: false,
logit_bias: [[FORCED, 1000]]`` (the bias acts in the sampler only — the reported
probabilities are those of the raw logits — and makes the pick a complete one-byte
token: the server omits ``completion_probabilities`` when the pick is an end-of-generation
token or an incomplete UTF-8 sequence) returns the log-softmax of the raw logits over the whole (448-token) vocabulary.
They are written, as little-endian float32 base64, to
``tests/fixtures/tiny-arch.llamacpp.json``; ``tests/worker/test_tiny_arch_llamacpp.py``
regenerates each GGUF, checks its sha256 and compares the engine's log-softmax.

Usage: ``python scripts/record_tiny_arch_llamacpp.py [--server PATH/llama-server]``
(default: ``$MODELYARD_LLAMA_SERVER``, else the llama.cpp build at
``~/.cache/modelyard-anchor/build/bin``). CI does not run this (it has no llama.cpp
build); it runs the test on the recorded fixture.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.worker.tiny_gguf import TINY_VOCAB_SIZE, write_tiny_qwen  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "tiny-arch.llamacpp.json"
DEFAULT_SERVER = Path.home() / ".cache" / "modelyard-anchor" / "build" / "bin" / "llama-server"

#: name -> write_tiny_qwen keyword arguments (path aside). Q8_0 and Q4_K/Q6_K need rows that are
#: multiples of 32 / 256 values: n_embd, n_ff and n_head * head_dim 256 for the K-quant file, whose
#: types are mixed as a Q4_K_M file's (Q6_K for token_embd, attn_v, ffn_down).
FILES: dict[str, dict[str, object]] = {
    "qwen2-f32": {"arch": "qwen2", "qtype": "F32", "output_bias": True, "seed": 1},
    "qwen2-q8_0": {"arch": "qwen2", "qtype": "Q8_0", "tied": False, "seed": 2},
    "qwen3-f32": {"arch": "qwen3", "qtype": "F32", "seed": 3},
    "qwen3-q8_0": {"arch": "qwen3", "qtype": "Q8_0", "seed": 4},
    "qwen3-q4_k_m": {"arch": "qwen3", "qtype": "Q4_K", "n_embd": 256, "n_ff": 256, "n_head": 8, "head_dim": 64,
                     "qtype_overrides": {"token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}, "seed": 5},
}
SETTINGS: dict[str, list[str]] = {
    "exact": ["--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off"],
    "ggml": ["--cache-type-k", "f16", "--cache-type-v", "f16", "-fa", "on"],
}
#: token ids fed one prefix at a time (ordinary byte / merge tokens of the tiny vocabulary)
PROMPT = [60, 105, 108, 108, 111, 36, 300, 87, 200, 271, 150, 333]
#: the token the sampler is made to pick (ASCII "A"): see the module docstring
FORCED = 69


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def serve_and_record(server: Path, gguf: Path, flags: list[str]) -> np.ndarray:
    """``[len(PROMPT), n_vocab]`` float32 log-probabilities after each prefix."""
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(server.parent))
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "64", "-np", "1",
           "-t", "2", "--seed", "0", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:  # until /health answers 200 (or the server exits)
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        rows = []
        for i in range(1, len(PROMPT) + 1):
            res = post(base + "/completion", {
                "prompt": PROMPT[:i], "n_predict": 1, "n_probs": TINY_VOCAB_SIZE, "post_sampling_probs": False,
                "cache_prompt": False, "temperature": 0.0, "logit_bias": [[FORCED, 1000.0]]})
            if "completion_probabilities" not in res:
                raise RuntimeError(f"no completion_probabilities for prompt {PROMPT[:i]}: {res}")
            top = res["completion_probabilities"][0]["top_logprobs"]
            row = np.full(TINY_VOCAB_SIZE, np.nan, dtype=np.float64)
            for t in top:
                row[t["id"]] = t["logprob"]
            assert not np.isnan(row).any(), "llama-server did not return the whole vocabulary"
            rows.append(row)
        return np.array(rows, dtype=np.float32)
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, default=Path(os.environ.get("MODELYARD_LLAMA_SERVER", DEFAULT_SERVER)))
    args = ap.parse_args(argv)
    files: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in FILES.items():
            path = write_tiny_qwen(Path(tmp) / f"{name}.gguf", **kwargs)  # type: ignore[arg-type]
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            rec: dict[str, object] = {"writer": "write_tiny_qwen", "kwargs": kwargs, "sha256": sha, "logprobs": {}}
            for setting, flags in SETTINGS.items():
                lp = serve_and_record(args.server, path, flags)
                rec["logprobs"][setting] = base64.b64encode(lp.astype("<f4").tobytes()).decode()  # type: ignore[index]
                print(f"{name} {setting}: {lp.shape} top-1 {lp.argmax(axis=1).tolist()}")
            files[name] = rec
    version = sorted(p.name for p in args.server.parent.glob("libllama.so.*.*"))
    OUT.write_text(json.dumps({
        "about": ("llama.cpp's next-token log-softmax (llama-server /completion, n_probs = vocab size, "
                  "post_sampling_probs false) after every prefix of `prompt` on tiny random-weight qwen2/qwen3 "
                  "GGUFs; recorded by scripts/record_tiny_arch_llamacpp.py"),
        "llama": version[-1] if version else args.server.name,
        "writer_versions": {"gguf": importlib.metadata.version("gguf"), "numpy": np.__version__},
        "settings": {k: " ".join(v) for k, v in SETTINGS.items()},
        "prompt": PROMPT,
        "n_vocab": TINY_VOCAB_SIZE,
        "files": files,
    }, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
