#!/usr/bin/env python3
"""Record llama.cpp's own dequantization of random tensors of every type the engine reads.

For each tensor type of ``worker.engine.loading.gguf_loader.SUPPORTED_TENSOR_TYPES`` (F32
aside) this makes 2 rows x 512 values of random but valid blocks (finite f16 / bf16
scales; every other byte random), dequantizes them with ggml itself —
``dequantize_row_<type>`` / ``ggml_fp16_to_fp32_row`` / ``ggml_bf16_to_fp32_row`` of
llama.cpp's ``libggml-base.so``, called through ctypes — and writes the raw blocks
with ggml's float32 output to ``tests/fixtures/dequant.llamacpp.json``.
``tests/worker/test_dequant_llamacpp.py`` writes each into a tiny GGUF, loads it
with the engine's reader and compares with what llama.cpp gave.

Usage: ``python scripts/record_dequant_llamacpp.py [--lib PATH/libggml-base.so]``
(default: ``$MODELYARD_GGML_LIB``, else the llama.cpp build at
``~/.cache/modelyard-anchor/build/bin``). CI does not run this (it has no llama.cpp
build); it runs the test on the recorded fixture.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engine.loading.gguf_loader import SUPPORTED_TENSOR_TYPES  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "dequant.llamacpp.json"
DEFAULT_LIB = Path.home() / ".cache" / "modelyard-anchor" / "build" / "bin" / "libggml-base.so"
ROWS, COLS = 2, 512

#: Byte offsets of the f16 scale fields inside one block (ggml-common.h block_* layouts).
F16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def random_blocks(qt: Q, rng: np.random.Generator) -> np.ndarray:
    """ROWS x (bytes of COLS values) uint8 of valid ``qt`` data."""
    if qt == Q.F16:
        return rng.standard_normal((ROWS, COLS)).astype(np.float16).view(np.uint8)
    if qt == Q.BF16:
        f = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # truncated: always finite
    block, tsize = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(ROWS * COLS // block, tsize), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        scale = (rng.random(raw.shape[0]) * 0.02 + 0.001).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(ROWS, -1)


def ggml_dequantize(lib: ctypes.CDLL, qt: Q, raw: np.ndarray) -> np.ndarray:
    out = np.empty(ROWS * COLS, dtype=np.float32)
    src = np.ascontiguousarray(raw)
    name = {Q.F16: "ggml_fp16_to_fp32_row", Q.BF16: "ggml_bf16_to_fp32_row"}.get(qt, "dequantize_row_" + qt.name.lower().replace("_k", "_K"))
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    fn(src.ctypes.data, out.ctypes.data, ROWS * COLS)
    return out.reshape(ROWS, COLS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", type=Path, default=Path(os.environ.get("MODELYARD_GGML_LIB", DEFAULT_LIB)))
    args = ap.parse_args(argv)
    lib = ctypes.CDLL(str(args.lib))
    rng = np.random.default_rng(11)
    types = sorted((t for t in SUPPORTED_TENSOR_TYPES if t != Q.F32), key=lambda t: t.value)
    record: dict[str, object] = {}
    for qt in types:
        raw = random_blocks(qt, rng)
        want = ggml_dequantize(lib, qt, raw)
        assert np.isfinite(want).all(), qt.name
        record[qt.name] = {"shape": [ROWS, COLS], "raw": base64.b64encode(raw.tobytes()).decode(),
                           "f32": base64.b64encode(want.astype("<f4").tobytes()).decode()}
        print(f"{qt.name}: {raw.nbytes} bytes -> {want.size} floats")
    version = sorted(p.name for p in args.lib.parent.glob("libggml-base.so.*.*"))
    OUT.write_text(json.dumps({
        "about": ("ggml's own dequantization (dequantize_row_*, ggml_fp16/bf16_to_fp32_row of llama.cpp's "
                  "libggml-base) of random valid blocks of every tensor type the engine reads; recorded by "
                  "scripts/record_dequant_llamacpp.py"),
        "ggml": version[-1] if version else args.lib.name,
        "types": record,
    }, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
