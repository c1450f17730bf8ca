"""Quantized weights (worker/engine/kernels/quant.py) against the gguf package and ggml's own formulas.

* unpacking a tensor's blocks to (q, d, m) reproduces ``gguf.quants.dequantize`` exactly, for
  every type held quantized (random blocks, so every bit pattern of scales/levels occurs);
* ``QWeight.matmul`` equals ggml's vec_dot written out here in float64 from the integer
  levels (activations quantized by an independent port of ggml's ``quantize_row_q8_*``);
* the kernel is row-deterministic: a row's output is bit-identical alone and inside calls of
  any row count, at any position (batch invariance); fused matrices equal their parts.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf.quants import dequantize

from worker.engine.kernels import quant

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]


def random_blocks(type_name: str, n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    """uint8 ``[n_rows, bytes_per_row]`` of random blocks whose fp16 scales are finite and small."""
    qt = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_rows, n_cols // block, size), dtype=np.uint8)

    def f16(at: int) -> None:
        v = (rng.random((n_rows, n_cols // block)) * 0.02 + 1e-4).astype(np.float16)
        raw[..., at:at + 2] = v.view(np.uint8).reshape(n_rows, n_cols // block, 2)

    if type_name in ("Q8_0", "Q4_0", "Q5_0"):
        f16(0)
    elif type_name in ("Q4_1", "Q5_1", "Q4_K"):
        f16(0)
        f16(2)
    elif type_name == "Q6_K":
        f16(208)
    return raw.reshape(n_rows, -1)


def ref_quantize(x: np.ndarray, act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's activation quantization, float64 bookkeeping: (q int [T, K], d [T, K/A], s [T, K/32])."""
    T, K = x.shape
    A = 256 if act == "q8_K" else 32
    xb = x.reshape(T, K // A, A).astype(np.float32)
    if act == "q8_K":  # quantize_row_q8_K_ref
        idx = np.abs(xb).argmax(axis=-1)
        mx = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
        iscale = np.where(mx != 0, np.float32(-127.0) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
        q = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int64)
        d = np.where(mx != 0, np.float32(1.0) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
        qs = q.reshape(T, K // 32, 32)
        s = d.repeat(8, axis=1).astype(np.float64) * qs.sum(-1)
        return q.reshape(T, K), d.astype(np.float64), s
    amax = np.abs(xb).max(axis=-1)  # x86 quantize_row_q8_0 / q8_1
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    s = d.astype(np.float64) * q.sum(-1)
    if act == "q8_1":
        s = s.astype(np.float16).astype(np.float64)
    return q.reshape(T, K), d.astype(np.float16).astype(np.float64), s


def ref_matmul(w: quant.QWeight, x: np.ndarray) -> np.ndarray:
    """sum over weight blocks of d_w * d_x * sum(q_w * q_x) + m_w * s_x, in float64."""
    q, d, m = w.plain()
    q, d = q.astype(np.int64), d.astype(np.float64)
    O, nb, B = q.shape
    qx, dx, sx = ref_quantize(x, w.act)
    T, K = x.shape
    A = 256 if w.act == "q8_K" else 32
    dx_w = dx.repeat(A // B, axis=1) if A >= B else dx                # [T, nb] activation scale per weight block
    isum = np.einsum("obj,tbj->tob", q, qx.reshape(T, nb, B))        # [T, O, nb] exact integers
    out = (isum * d[None] * dx_w[:, None, :]).sum(-1)
    if m is not None:
        out += sx @ m.astype(np.float64).T
    return out


@pytest.mark.parametrize("type_name", TYPES)
def test_unpack_reproduces_the_gguf_dequantization(type_name: str) -> None:
    n_rows, n_cols = 24, 512
    raw = random_blocks(type_name, n_rows, n_cols, seed=1)
    w = quant.QWeight.from_raw(type_name, raw, n_rows, n_cols)
    ref = dequantize(raw, GGMLQuantizationType[type_name]).reshape(n_rows, n_cols)
    assert w.shape == (n_rows, n_cols)
    np.testing.assert_array_equal(w.dequantize(), ref.astype(np.float32))
    rows = np.array([5, 0, 23, 5])
    np.testing.assert_array_equal(w.dequantize_rows(rows), ref[rows].astype(np.float32))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n_tok", [1, 3, 5, 8, 19])
def test_matmul_is_ggml_vec_dot(type_name: str, n_tok: int) -> None:
    n_rows, n_cols = 40, 512
    raw = random_blocks(type_name, n_rows, n_cols, seed=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[0, :7] *= 40.0  # an outlier block
    x[-1, 256:] = 0.0  # an all-zero block (scale 0)
    w = quant.QWeight.from_raw(type_name, raw, n_rows, n_cols)
    got = w.matmul(x)
    want = ref_matmul(w, x)
    assert got.shape == (n_tok, n_rows) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def ggml_avx2_order(w: quant.QWeight, x: np.ndarray) -> np.ndarray:
    """float32 ``[T, O]``: ggml's x86 AVX2 ``vec_dot`` of a 32-block type, one rounding at a time
    (eight lanes of four elements, ``acc_l = fma(d_w*d_x, isum_l, acc_l)`` over the blocks,
    ``hsum_float_8``, then ``+ summs`` = the in-order fma sum of ``m_w * s_x``), in numpy
    scalars: an independent port of ggml-cpu/arch/x86/quants.c."""
    f32 = np.float32

    def fma(a, b, c):  # one rounding: the product of two float32 is exact in float64
        return f32(np.float64(a) * np.float64(b) + np.float64(c))

    q, d, m = w.plain()
    xq, dx, xs = quant.quantize_activations(x, w.act, m is not None)
    T, O, nb = x.shape[0], q.shape[0], q.shape[1]
    lanes = (q.astype(np.int64)[None] * xq.astype(np.int64).reshape(T, 1, nb, 32)).reshape(T, O, nb, 8, 4).sum(-1)
    out = np.empty((T, O), np.float32)
    for t in range(T):
        for r in range(O):
            acc = [f32(0)] * 8
            summs = f32(0)
            for b in range(nb):
                dd = f32(d[r, b] * dx[t, b])
                acc = [fma(dd, f32(lanes[t, r, b, j]), acc[j]) for j in range(8)]
                if m is not None:
                    summs = fma(m[r, b], xs[t, b], summs)
            h = [f32(acc[j] + acc[j + 4]) for j in range(4)]
            out[t, r] = f32(f32(f32(h[0] + h[2]) + f32(h[1] + h[3])) + summs)
    return out


@pytest.mark.parametrize("type_name", quant.LANE_TYPES)
def test_32_block_types_sum_in_ggml_avx2_order(type_name: str) -> None:
    # bit for bit what llama.cpp computes on x86 (vec_dot for one row, tinyBLAS from two on:
    # the same order), for row counts that are and are not multiples of the 16 interleaved rows
    for n_rows, n_tok in ((16, 1), (21, 3), (40, 5)):
        w = quant.QWeight.from_raw(type_name, random_blocks(type_name, n_rows, 256, seed=n_rows), n_rows, 256)
        assert w.kind in quant.QWeight.LANE_KINDS
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 256)).astype(np.float32)
        x[0, :5] *= 30.0
        np.testing.assert_array_equal(w.matmul(x), ggml_avx2_order(w, x))


VNNI = pytest.mark.skipif(not quant.host_has_vnni(), reason="the CPU has no AVX512-VNNI (or it is switched off)")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32)  # == on the bits: -0.0 and +0.0 differ


@VNNI
@pytest.mark.parametrize("type_name", quant.LANE_TYPES)
def test_vnni_kernel_gives_the_reference_kernels_bits(type_name: str) -> None:
    # the VNNI forms and kernel (AVX512-VNNI integer lanes, 4 activation rows per weight load,
    # packed nibbles for Q4_0 / Q4_1) against the reference kernel (matmul_lanes, checked against
    # ggml above) on the same blocks: the same bits at every row count 1..300 (every position in
    # the 4-row passes and the tail), a full and a partial row group, whole outputs and column
    # slices; activations of magnitudes e^-3..e^3 with an outlier and an all-zero block
    n_rows = 40
    w = quant.QWeight.from_raw(type_name, random_blocks(type_name, n_rows, 256, seed=21), n_rows, 256)
    assert w.kind == ("vlanes4" if type_name in quant.PACKED_TYPES else "vlanes")
    ref = quant.QWeight.lanes(*w.plain(), w.act, w.types, "lanes")
    np.testing.assert_array_equal(w.dequantize(), ref.dequantize())
    rng = np.random.default_rng(22)
    x = (rng.standard_normal((300, 256)) * np.exp(rng.uniform(-3, 3, (300, 1)))).astype(np.float32)
    x[3, 40] = 900.0
    x[4, 64:96] = 0.0
    for T in range(1, 301):
        o = int(rng.integers(0, 301 - T))
        np.testing.assert_array_equal(_bits(w.matmul(x[o:o + T])), _bits(ref.matmul(x[o:o + T])), err_msg=f"{T} rows")
    for T in (1, 5, 8, 13):
        acts = quant.quantize_activations(x[:T], w.act, w.m is not None)
        got, want = np.full((T, 64), np.nan, np.float32), np.full((T, 64), np.nan, np.float32)
        w.matmul_quantized(*acts, got[:, 7:7 + n_rows])
        ref.matmul_quantized(*acts, want[:, 7:7 + n_rows])
        np.testing.assert_array_equal(_bits(got), _bits(want))


@VNNI
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_vnni_k_quant_kernels_give_the_reference_kernels_bits(type_name: str) -> None:
    # the "vq4k" / "vq6k" forms and kernels against the reference ones (matmul_q4k / matmul_q6k,
    # checked against ggml below) on the same blocks: the same bits at every row count 1..300 with
    # the calls' rows cut into sequences of 1, 2-7 and 8+ rows (so each row takes llama.cpp's
    # kernel for its sequence: Q4_K gemv / gemm, Q6_K vec_dot / tiled, mixed within one call and
    # within a 4-row pass), a full and a partial row group, column slices
    n_rows, kind = 40, type_name.lower().replace("_", "")
    raw = random_blocks(type_name, n_rows, 512, seed=23)
    w = quant.QWeight.from_raw(type_name, raw, n_rows, 512)
    ref = quant.QWeight.kquant(kind, w.act, w.types, n_rows, quant.kquant_parts(type_name, raw, n_rows, 512), vnni=False)
    assert (w.kind, ref.kind) == ("v" + kind, kind)
    np.testing.assert_array_equal(w.dequantize(), ref.dequantize())
    rng = np.random.default_rng(24)
    x = (rng.standard_normal((300, 512)) * np.exp(rng.uniform(-3, 3, (300, 1)))).astype(np.float32)
    x[3, 40] = 900.0
    x[4, 256:512] = 0.0
    for T in range(1, 301):
        o = int(rng.integers(0, 301 - T))
        cuts = np.sort(rng.choice(np.arange(1, T), size=min(T - 1, int(rng.integers(0, 4))), replace=False)) if T > 1 else []
        segs = np.diff(np.concatenate([[0], cuts, [T]]).astype(np.int64)).tolist()
        token = quant.row_groups(segs)
        try:
            np.testing.assert_array_equal(_bits(w.matmul(x[o:o + T])), _bits(ref.matmul(x[o:o + T])),
                                          err_msg=f"{T} rows as {segs}")
        finally:
            quant._SEQ_ROWS.reset(token)
    for T in (1, 5, 8, 13):
        acts = quant.quantize_activations(x[:T], w.act, False)
        got, want = np.full((T, 64), np.nan, np.float32), np.full((T, 64), np.nan, np.float32)
        w.matmul_quantized(*acts, got[:, 7:7 + n_rows])
        ref.matmul_quantized(*acts, want[:, 7:7 + n_rows])
        np.testing.assert_array_equal(_bits(got), _bits(want))


@VNNI
@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_vnni_kernels_threads_take_row_groups_as_they_come(type_name: str) -> None:
    # the VNNI kernels' threads take their work items (row groups, simd.claim) as they come, not
    # a fixed share each: with many items and a partial last group, every output is computed
    # once and gets the reference kernel's bits on one thread and on all of them, whole outputs
    # and column slices (a QConcat of two parts), decode rows and a tiled / gemm batch
    import numba

    n_rows, K, kind = 16 * 4 * 6 + 8, 512, type_name.lower().replace("_", "")
    raw = random_blocks(type_name, n_rows, K, seed=31)
    w = quant.QWeight.from_raw(type_name, raw, n_rows, K)
    ref = (quant.QWeight.lanes(*w.plain(), w.act, w.types, "lanes") if w.kind in quant.QWeight.LANE_KINDS else
           quant.QWeight.kquant(kind, w.act, w.types, n_rows, quant.kquant_parts(type_name, raw, n_rows, K), vnni=False))
    assert w.kind != ref.kind
    x = np.random.default_rng(32).standard_normal((9, K)).astype(np.float32)
    want = {T: ref.matmul(x[:T]) for T in (1, 2, 9)}
    try:
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            quant.use_threads(n)
            for T, r in want.items():
                np.testing.assert_array_equal(_bits(w.matmul(x[:T])), _bits(r), err_msg=f"{n} threads, {T} rows")
                both = quant.QConcat([w, w]).matmul(x[:T])
                np.testing.assert_array_equal(_bits(both), _bits(np.concatenate([r, r], axis=1)),
                                              err_msg=f"{n} threads, {T} rows, column slices")
    finally:
        quant.use_threads(numba.config.NUMBA_NUM_THREADS)


def _fma(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))  # one rounding (exact product)


def ggml_q4k_order(raw_bytes: np.ndarray, n_rows: int, x: np.ndarray) -> np.ndarray:
    """ggml's repacked x86 Q4_K gemv/gemm: per span exact integers isum = sum_j sc_j * dot_j and
    imin = sum_j mn_j * bsum_j; acc = fma(isum, d*d_x, acc), accm = fma(imin, dmin*d_x, accm);
    out = acc - accm. The span is a super-block (gemv) or a pair of sub-blocks (gemm, the first
    T - T % 4 rows). An independent port (numpy scalars) of ggml-cpu/arch/x86/repack.cpp."""
    raw = quant.kquant_parts("Q4_K", raw_bytes, n_rows, x.shape[1])
    xq, dx, _ = quant.quantize_activations(x, "q8_K", False)
    xi = xq.astype(np.int64)
    T, O, nsb = x.shape[0], n_rows, x.shape[1] // 256
    qs = raw["q"].reshape(O, nsb, 4, 32).astype(np.int64)
    lv = np.stack([qs & 15, qs >> 4], axis=3).reshape(O, nsb, 8, 32)          # sub-block 2c, 2c+1
    out = np.empty((T, O), np.float32)
    for t in range(T):
        xb = xi[t].reshape(nsb, 8, 32)
        for r in range(O):
            acc = accm = np.float32(0)
            spans = [slice(2 * c, 2 * c + 2) for c in range(4)] if t < T - T % 4 else [slice(0, 8)]
            for b in range(nsb):
                dy = dx[t, b * 8]
                for j in spans:
                    isum = int((raw["sc"][r, b, j].astype(np.int64) * (lv[r, b, j] * xb[b, j]).sum(-1)).sum())
                    imin = int((raw["mn"][r, b, j].astype(np.int64) * xb[b, j].sum(-1)).sum())
                    acc = _fma(np.float32(isum), np.float32(raw["d"][r, b] * dy), acc)
                    accm = _fma(np.float32(imin), np.float32(raw["m"][r, b] * dy), accm)
            out[t, r] = np.float32(acc - accm)
    return out


def ggml_q6k_order(raw_bytes: np.ndarray, n_rows: int, x: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_q6_K_q8_K, x86 AVX2: per super-block eight int32 lanes (lane l: elements
    with e % 32 in [4l, 4l+4), scaled; minus 32 * the scaled bsums of sub-blocks 2l, 2l+1),
    acc_l = fma(d_x*d, lane_l, acc_l); hsum_float_8. An independent port (numpy scalars)."""
    raw = quant.kquant_parts("Q6_K", raw_bytes, n_rows, x.shape[1])
    xq, dx, _ = quant.quantize_activations(x, "q8_K", False)
    xi = xq.astype(np.int64)
    T, O, nsb = x.shape[0], n_rows, x.shape[1] // 256
    e = np.arange(256)
    lane_of = (e % 32) // 4
    out = np.empty((T, O), np.float32)
    for t in range(T):
        for r in range(O):
            acc = [np.float32(0)] * 8
            for b in range(nsb):
                sc = raw["sc"][r, b].astype(np.int64)
                q6 = raw["q"][r, b].astype(np.int64)
                xe = xi[t, b * 256:(b + 1) * 256]
                main = np.bincount(lane_of, weights=sc[e // 16] * q6 * xe, minlength=8).astype(np.int64)
                bs = xe.reshape(16, 16).sum(-1)
                sub = 32 * (bs * sc).reshape(8, 2).sum(-1)
                d = np.float32(dx[t, b * 8] * raw["d"][r, b])
                acc = [_fma(d, np.float32(main[l] - sub[l]), acc[l]) for l in range(8)]
            h = [np.float32(acc[j] + acc[j + 4]) for j in range(4)]
            out[t, r] = np.float32(np.float32(h[0] + h[2]) + np.float32(h[1] + h[3]))
    return out


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_sum_in_ggml_x86_order(type_name: str) -> None:
    # bit for bit what llama.cpp computes on this machine kind (repacked Q4_K, Q6_K's vec_dot)
    ref = ggml_q4k_order if type_name == "Q4_K" else ggml_q6k_order
    for n_rows, n_tok in ((8, 1), (19, 6)):
        raw = random_blocks(type_name, n_rows, 512, seed=n_rows)
        w = quant.QWeight.from_raw(type_name, raw, n_rows, 512)
        x = np.random.default_rng(n_tok).standard_normal((n_tok, 512)).astype(np.float32)
        x[0, :5] *= 30.0
        np.testing.assert_array_equal(w.matmul(x), ref(raw, n_rows, x))


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_do_not_depend_on_the_batch(type_name: str) -> None:
    # every mix of sequences the scheduler produces (decode rows, prefill chunks of any size):
    # a sequence's rows are the same bits alone as next to others in one call. (Within a
    # sequence, llama.cpp's kernel for Q4_K / Q6_K depends on its row count; that choice is
    # reproduced per sequence, see test_k_quants_sum_in_ggml_x86_order.)
    n_rows, n_cols = 72, 512
    w = quant.QWeight.from_raw(type_name, random_blocks(type_name, n_rows, n_cols, seed=4), n_rows, n_cols)
    x = np.random.default_rng(5).standard_normal((70, n_cols)).astype(np.float32)
    for sizes in ([1] * 6, [2, 1, 3], [5, 1, 8, 1], [17, 33, 1, 4], [9, 1, 1, 1, 7], [70]):
        starts = np.cumsum([0] + sizes[:-1])
        alone = np.concatenate([w.matmul(x[a:a + n]) for a, n in zip(starts, sizes)])
        token = quant.row_groups(sizes)
        try:
            together = w.matmul(x[:sum(sizes)])
        finally:
            quant._SEQ_ROWS.reset(token)
        np.testing.assert_array_equal(together, alone, err_msg=f"sequences of {sizes} rows")
    if type_name in quant.LANE_TYPES:   # these kernels do not depend on the row count at all
        one = np.concatenate([w.matmul(x[i:i + 1]) for i in range(x.shape[0])])
        np.testing.assert_array_equal(w.matmul(x), one)


@pytest.mark.parametrize("type_name", TYPES)
def test_zero_rows_multiply_to_nothing(type_name: str) -> None:
    # a prefill chunk that is not a prompt's last has no output row: the last block's FFN gets 0 rows
    w = quant.QWeight.from_raw(type_name, random_blocks(type_name, 16, 256, seed=3), 16, 256)
    assert w.matmul(np.zeros((0, 256), np.float32)).shape == (0, 16)
    both = quant.fuse([w, quant.QWeight.from_raw("Q4_K", random_blocks("Q4_K", 8, 256, seed=4), 8, 256)])
    assert both.matmul(np.zeros((0, 256), np.float32)).shape == (0, 24)


def test_a_chunk_without_output_rows_on_the_quantized_path(tmp_path) -> None:
    # the KV of a chunk that asks for no logits is written, and the next chunk continues it
    import json

    from tests.paths import FIXTURES_DIR
    from tests.worker.tiny_gguf import write_tiny_qwen
    from worker.engine.attention import AttnBatch, Segment
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.arch.registry import load_model
    kw = json.loads((FIXTURES_DIR / "tiny-arch.llamacpp.json").read_text())["files"]["qwen3-q4_k_m"]["kwargs"]
    g = read_gguf(write_tiny_qwen(tmp_path / "q.gguf", **kw))
    m = load_model(g, n_ctx=64, weights="quantized")
    ids = np.arange(1, 21) % 50
    one = m.forward(ids)                                        # [n_vocab] all at once
    m.reset()
    out = m.forward_batch(ids[:12], AttnBatch([Segment(m.cache, 0, 12, 0)], m.dtype), [])
    assert out.shape == (0, one.shape[0])
    m.cache.tokens.extend(int(i) for i in ids[:12])
    rest = m.forward(ids[12:])
    assert np.abs(rest - one).max() < 1e-3                      # another chunking: llama.cpp's other path


@pytest.mark.parametrize("kind", ["qwen3-q4_k_m", "gemma3-q8_0"])
def test_a_micro_batch_run_in_slices_is_the_same_bits(tmp_path, kind: str) -> None:
    # Segment.ubatch: slices of a micro-batch over several passes choose every row-count-dependent
    # kernel (Q4_K gemm/gemv, Q6_K tiled/vec_dot, the flash-attention path) for the whole
    # micro-batch, so their logits and K/V equal the micro-batch's run whole; each slice run as its
    # own micro-batch differs (llama.cpp's result for that other cut)
    import json

    from tests.paths import FIXTURES_DIR
    from tests.worker.tiny_gguf import write_tiny_gemma3, write_tiny_qwen
    from worker.engine.attention import AttnBatch, Segment
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.kv.cache import KVEntry
    from worker.engine.arch.registry import load_model
    if kind == "qwen3-q4_k_m":
        kw = json.loads((FIXTURES_DIR / "tiny-arch.llamacpp.json").read_text())["files"][kind]["kwargs"]
        path = write_tiny_qwen(tmp_path / "q.gguf", **{**kw, "n_ctx_train": 512})
    else:
        path = write_tiny_gemma3(tmp_path / "g.gguf", qtype="Q8_0", sliding_window=40)
    m = load_model(read_gguf(path), n_ctx=256, weights="quantized")
    ids = np.random.default_rng(3).integers(4, 440, 230)
    ub = 160                                                       # micro-batches [0, 160) and [160, 230)

    def run(cuts: list[int], as_ubatch: bool) -> tuple[np.ndarray, np.ndarray]:
        e = KVEntry(m.kv_shape, m.n_ctx, m.n_ctx)
        pos, out = 0, None
        for n in cuts:
            first = 0 if pos < ub else ub
            seg = (Segment(e, 0, n, pos, min(ub, len(ids) - first), pos - first) if as_ubatch
                   else Segment(e, 0, n, pos))
            last = pos + n == len(ids)
            out = m.forward_batch(ids[pos:pos + n], AttnBatch([seg], m.dtype), [n - 1] if last else [])
            e.tokens.extend(int(t) for t in ids[pos:pos + n])
            pos += n
        return out[0], e.k[:, :, :len(ids)].copy()

    whole, k_whole = run([160, 70], False)
    for cuts in ([64, 96, 70], [1, 7, 100, 52, 3, 67], [13, 147, 69, 1]):
        got, k_got = run(cuts, True)
        np.testing.assert_array_equal(got, whole, err_msg=f"slices {cuts}")
        np.testing.assert_array_equal(k_got, k_whole, err_msg=f"slices {cuts}")
    own, _ = run([1, 7, 100, 52, 3, 67], False)
    assert np.abs(own - whole).max() > 1e-4


def test_fused_matrices_equal_their_parts() -> None:
    a = quant.QWeight.from_raw("Q5_0", random_blocks("Q5_0", 16, 256, seed=6), 16, 256)
    a2 = quant.QWeight.from_raw("Q5_0", random_blocks("Q5_0", 8, 256, seed=11), 8, 256)
    b = quant.QWeight.from_raw("Q4_1", random_blocks("Q4_1", 8, 256, seed=7), 8, 256)
    c = quant.QWeight.from_raw("Q4_K", random_blocks("Q4_K", 8, 256, seed=8), 8, 256)
    x = np.random.default_rng(9).standard_normal((2, 256)).astype(np.float32)
    aa = quant.fuse([a, a2])                              # same form, block and activation type: one QWeight
    assert isinstance(aa, quant.QWeight) and aa.shape == (24, 256) and aa.types == ("Q5_0", "Q5_0")
    np.testing.assert_array_equal(aa.matmul(x), np.concatenate([a.matmul(x), a2.matmul(x)], axis=1))
    abc = quant.fuse([a, a2, b, c])                       # Q8_0, Q8_1 and Q8_K activations: a QConcat of 3
    assert isinstance(abc, quant.QConcat) and abc.shape == (40, 256) and len(abc.parts) == 3
    np.testing.assert_array_equal(abc.matmul(x), np.concatenate([a.matmul(x), a2.matmul(x), b.matmul(x),
                                                                 c.matmul(x)], axis=1))
    perm = np.array([3, 1, 2, 0] + list(range(4, 16)))
    np.testing.assert_array_equal(a.take_rows(perm).matmul(x), a.matmul(x)[:, perm])


@pytest.mark.parametrize("type_name", TYPES)
def test_forms_persist_and_come_back(type_name: str) -> None:
    # the weight cache stores arrays() + meta(): the rebuilt weight multiplies to the same bits
    w = quant.QWeight.from_raw(type_name, random_blocks(type_name, 8, 256, seed=12), 8, 256)
    again = quant.QWeight.from_arrays({k: np.array(a) for k, a in w.arrays().items()}, w.meta())
    x = np.random.default_rng(13).standard_normal((3, 256)).astype(np.float32)
    assert again.shape == w.shape == (8, 256) and again.kind == w.kind
    np.testing.assert_array_equal(again.matmul(x), w.matmul(x))
    np.testing.assert_array_equal(again.dequantize(), w.dequantize())


def test_q8_K_int_levels_are_quantize_activations() -> None:
    """``quantize_q8_K_int`` (int8 levels, super-block d, sums per 16, for the VNNI K-quant kernels)
    == ``quantize_activations(x, "q8_K")``'s levels, d and sums: magnitudes e^±12, all-zero and
    -0.0 super-blocks, the largest |x| twice with both signs (the first one's sign counts), 127.5
    rounding cases."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((37, 1024)) * np.exp(rng.uniform(-12, 12, (37, 1)))).astype(np.float32)
    x[2, 256:512] = 0.0
    x[3, :256] = -0.0
    x[4, 10], x[4, 20] = -5.0, 5.0
    x[5, 30], x[5, 40] = 5.0, -5.0
    x[6, 512:768] = np.linspace(-127.5, 127.5, 256, dtype=np.float32)
    xi, dy, bs16 = quant.quantize_q8_K_int(x)
    xq, dx, _ = quant.quantize_activations(x, "q8_K", True)
    np.testing.assert_array_equal(xi, xq.astype(np.int8))
    assert np.array_equal(xi.astype(np.float32), xq)
    np.testing.assert_array_equal(dy.view(np.uint32), dx[:, ::8].view(np.uint32))
    np.testing.assert_array_equal(bs16, xq.reshape(37, -1, 16).sum(-1).astype(np.int32))


def test_activation_scales_round_like_fp16() -> None:
    # the kernels' fp16 rounding of the Q8_0 scale equals numpy's float16 cast (incl. subnormals)
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((64, 32)) * np.exp(rng.uniform(-14, 6, (64, 1)))).astype(np.float32)
    xq, dx, _ = quant.quantize_activations(x, "q8_0", False)
    amax = np.abs(x).max(axis=-1)
    d16 = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    q = np.rint(x * (np.float32(127) / amax)[:, None])
    np.testing.assert_array_equal(xq, q.astype(np.float32))
    np.testing.assert_array_equal(dx[:, 0], d16)


def test_q8_1_offsets_round_like_fp16() -> None:
    # the kernels' Q8_1 s = fp16(d * sum(q)) (d unrounded, amax / 127) equals numpy's, blocks with a
    # zero, a -0.0 and a two-signed maximum included (the max |x| is found on the bits)
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((64, 64)) * np.exp(rng.uniform(-14, 6, (64, 1)))).astype(np.float32)
    x[1, :32], x[2, 32:] = 0.0, -0.0
    x[3, 4], x[3, 9] = -7.0, 7.0
    xq, dx, xs = quant.quantize_activations(x, "q8_1", True)
    xb = x.reshape(64, 2, 32)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        q = np.rint(xb * np.where(amax > 0, np.float32(127) / amax, np.float32(0))[..., None])
    np.testing.assert_array_equal(xq, q.reshape(64, 64).astype(np.float32))
    d = amax / np.float32(127)
    np.testing.assert_array_equal(dx, d.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(xs, (d * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32))


def test_unsupported_type_is_refused() -> None:
    assert not quant.supports("Q5_K") and not quant.supports("F16") and quant.supports("Q6_K")
    with pytest.raises(Exception, match="no int8 form"):
        quant.unpack("Q3_K", np.zeros((1, 110), np.uint8), 1, 256)


def test_weight_modes_are_the_protocols() -> None:
    from protocol.limits import WEIGHT_MODES
    from worker.engine.arch.registry import DEFAULT_WEIGHTS, WEIGHT_MODES as ENGINE_MODES
    assert ENGINE_MODES is WEIGHT_MODES and DEFAULT_WEIGHTS in WEIGHT_MODES  # one fact: the protocol's tuple


def test_a_float32_worker_never_imports_numba(tmp_path) -> None:
    # numba costs ~90 MiB of RSS and 0.4 s at import: only the quantized path may pay it
    import subprocess
    import sys

    from tests.paths import ROOT
    from tests.worker.tiny_gguf import write_tiny_llama
    path = write_tiny_llama(tmp_path / "t.gguf", qtype="Q8_0")
    code = (f"import sys; from worker.engine import Engine, SamplingParams; from worker.threads import "
            f"apply_blas_threads; e = Engine.load({str(path)!r}, weights='f32'); "
            f"e.generate([1, 2, 3], SamplingParams(max_tokens=2)); apply_blas_threads(1); "
            f"assert 'numba' not in sys.modules, 'numba imported'; "
            f"q = Engine.load({str(path)!r}, weights='quantized'); q.generate([1, 2, 3], SamplingParams(max_tokens=2)); "
            f"assert 'numba' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------------ batch invariance on the real models

@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def qengine(request: pytest.FixtureRequest, smollm2_path, gemma3_path):
    from worker.engine import Engine
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    return Engine.load(str(path), n_ctx=512, parallel=4, weights="quantized")


def test_quantized_logprobs_do_not_depend_on_the_batch(qengine) -> None:
    """The same requests alone and sharing forward passes (decode batches of 1..4 rows, a prompt
    prefilled next to running decodes) give bit-identical tokens and logprobs. Each prompt is
    prefilled in one chunk both ways (< 128 tokens, joins one at a time), so this checks the
    matmuls and everything row-wise around them; how attention treats other chunkings is its own."""
    from worker.engine import SamplingParams

    def params() -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n_probs=1, cache_prompt=False)

    words = "the river carried small boats past the old mill while children counted clouds".split()
    rng = np.random.default_rng(21)
    prompts = [qengine.tokenize(" ".join(words[i] for i in rng.integers(0, len(words), n)), add_special=True)
               for n in (4, 40, 11, 70)]
    ref = []
    for p in prompts:
        qengine.reset_cache()
        lps: list[tuple[int, float]] = []
        qengine.generate(p, params(), on_token=lambda e: lps.append((e.id, e.logprob)))
        ref.append(lps)
    qengine.reset_cache()
    got: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(prompts))}
    joins = {0: [0, 1], 3: [2], 5: [3]}
    step, finished = 0, 0
    while step < 100 and finished < len(prompts):
        for i in joins.get(step, []):
            qengine.add(f"s{i}", prompts[i], params(), lambda e, i=i: got[i].append((e.id, e.logprob)))
        for f in qengine.step():
            assert f.error is None, f.error
            finished += 1
        step += 1
    assert finished == len(prompts)
    for i, want in enumerate(ref):
        assert got[i] == want, f"sequence {i}: batched differs from alone"
