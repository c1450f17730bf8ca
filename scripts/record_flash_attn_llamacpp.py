#!/usr/bin/env python3
"""Record llama.cpp's CPU flash attention on seeded inputs (every path the engine reproduces).

For each case of ``tests/worker/flash_attn_cases.py`` (query rows, an f16 K/V view,
causal / sliding-window mask, scale, softcap) this builds a one-node ggml graph —
``ggml_flash_attn_ext(q f32 [dk, n_q, n_head], k f16 [dk, n_cells, n_kv], v f16 [dv,
n_cells, n_kv], mask f16 [n_cells, n_q], scale, 0, softcap)`` — with llama.cpp's own
``libggml-base.so`` / ``libggml-cpu.so`` through ctypes, computes it with 2 threads
(``ggml_graph_compute_with_ctx``; the thread count decides the split-KV path's chunks,
as llama-server ``-t 2`` in the reference fixtures) and writes the float32 output
``[n_q, n_head * dv]`` — its sha256, and its first and last rows as little-endian float32
base64 (for the failure message) — with the inputs' sha256 to
``tests/fixtures/flash-attn.llamacpp.json``. ``tests/worker/test_attn_kernels.py``
regenerates the inputs, checks the sha256 and compares the engine's
``attention.ggml_attention`` with what ggml computed.

Usage: ``python scripts/record_flash_attn_llamacpp.py [--lib-dir DIR]`` (default:
``$MODELYARD_GGML_LIB_DIR``, else the llama.cpp build at ``~/.cache/modelyard-anchor/build/bin``).
CI does not run this (it has no llama.cpp build); it runs the test on the recorded fixture.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.worker.flash_attn_cases import CASES, Case, inputs_sha256, make_inputs, visible  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "flash-attn.llamacpp.json"
DEFAULT_DIR = Path.home() / ".cache" / "modelyard-anchor" / "build" / "bin"
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
THREADS = 2


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def load(lib_dir: Path) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.argtypes, base.ggml_init.restype = [InitParams], vp
    base.ggml_free.argtypes, base.ggml_free.restype = [vp], None
    base.ggml_new_tensor_3d.argtypes, base.ggml_new_tensor_3d.restype = [vp, ctypes.c_int, i64, i64, i64], vp
    base.ggml_new_tensor_2d.argtypes, base.ggml_new_tensor_2d.restype = [vp, ctypes.c_int, i64, i64], vp
    base.ggml_flash_attn_ext.argtypes = [vp, vp, vp, vp, vp, ctypes.c_float, ctypes.c_float, ctypes.c_float]
    base.ggml_flash_attn_ext.restype = vp
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [vp], vp
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [vp], ctypes.c_size_t
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [vp], vp
    base.ggml_build_forward_expand.argtypes, base.ggml_build_forward_expand.restype = [vp, vp], None
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    cpu.ggml_graph_compute_with_ctx.argtypes, cpu.ggml_graph_compute_with_ctx.restype = [vp, vp, ctypes.c_int], ctypes.c_int
    cpu.ggml_cpu_init()
    return base, cpu


def run_case(base: ctypes.CDLL, cpu: ctypes.CDLL, c: Case) -> np.ndarray:
    q, k, v = make_inputs(c)
    mask = np.where(visible(c), 0.0, -np.inf).astype(np.float16)          # [n_q, n_cells]
    ctx = base.ggml_init(InitParams(256 << 20, None, False))
    try:
        tq = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.dk, c.n_q, c.n_head)
        tk = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c.dk, c.n_cells, c.n_kv)
        tv = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c.dv, c.n_cells, c.n_kv)
        tm = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c.n_cells, c.n_q)
        for t, a in ((tq, q.transpose(1, 0, 2)), (tk, k), (tv, v), (tm, mask)):
            a = np.ascontiguousarray(a)
            assert base.ggml_nbytes(t) == a.nbytes
            ctypes.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)
        out = base.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, c.scale, 0.0, c.softcap)
        gf = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(gf, out)
        assert cpu.ggml_graph_compute_with_ctx(ctx, gf, THREADS) == 0
        res = np.empty((c.n_q, c.n_head, c.dv), np.float32)                  # dst [dv, n_head, n_q]
        assert base.ggml_nbytes(out) == res.nbytes
        ctypes.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
        return res.reshape(c.n_q, c.n_head * c.dv)
    finally:
        base.ggml_free(ctx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib-dir", type=Path, default=Path(os.environ.get("MODELYARD_GGML_LIB_DIR", DEFAULT_DIR)))
    args = ap.parse_args(argv)
    base, cpu = load(args.lib_dir)
    cases = []
    for c in CASES:
        out = run_case(base, cpu, c)
        assert np.isfinite(out).all(), c.name
        out = out.astype("<f4")
        cases.append({"case": c.as_dict(), "inputs_sha256": inputs_sha256(c),
                      "out_sha256": hashlib.sha256(out.tobytes()).hexdigest(),
                      "first_row": base64.b64encode(out[0].tobytes()).decode(),
                      "last_row": base64.b64encode(out[-1].tobytes()).decode()})
        print(f"{c.name}: {out.shape}")
    OUT.write_text(json.dumps({
        "source": "llama.cpp b11434 ggml-cpu ggml_flash_attn_ext (libggml-cpu.so, GGML_NATIVE, x86-64 AVX-512F), "
                  f"{THREADS} threads",
        "numpy": np.__version__, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
