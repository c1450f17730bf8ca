"""The quantized path's attention against llama.cpp's own CPU flash attention, bit for bit.

``tests/fixtures/flash-attn.llamacpp.json`` (scripts/record_flash_attn_llamacpp.py) holds
what ggml-cpu's ``ggml_flash_attn_ext`` (llama.cpp's libggml-cpu.so, 2 threads) computed on
the seeded inputs of ``tests/worker/flash_attn_cases.py``: every path (one-row with its
f16 softmax·V accumulator, split-KV decode, tiled prefill), head sizes 16..256, GQA,
sliding windows, softcap. :func:`worker.engine.attention.ggml_attention` must give the
same bytes. Also: the path choice, batch invariance through :func:`attention.attend`
(other sequences, thread count), and the f16 rounding helper.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tests.worker.flash_attn_cases import CASES, Case, inputs_sha256, make_inputs
from worker.engine import attention as A
from worker.engine.kv.cache import KVEntry, KVShape

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-attn.llamacpp.json"
DATA = json.loads(FIXTURE.read_text())
RECORDED = {r["case"]["name"]: r for r in DATA["cases"]}


def run_case(c: Case) -> np.ndarray:
    q, k, v = make_inputs(c)
    end = c.qpos0 + c.n_q
    k0 = max(0, c.qpos0 - c.window + 1) if c.window else 0
    keys = k[:, k0:end].astype(np.float32)
    values = v[:, k0:end].astype(np.float32)
    return A.ggml_attention(q, keys, values, c.qpos0, k0, c.window or None, c.scale, c.softcap)


def test_fixture_covers_every_path() -> None:
    from worker.engine.kernels import attn_kernels as ak

    assert [c.as_dict() for c in CASES] == [r["case"] for r in DATA["cases"]]
    modes = {A.ggml_fa_mode(c.n_q, c.qpos0 + c.n_q)[0] for c in CASES}
    assert modes == {ak.MODE_VEC, ak.MODE_SPLIT, ak.MODE_TILED}
    assert any(c.window for c in CASES) and any(c.softcap for c in CASES) and any(c.n_head > c.n_kv for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bit_identical_to_llamacpp(case: Case) -> None:
    rec = RECORDED[case.name]
    assert inputs_sha256(case) == rec["inputs_sha256"], \
        f"the seeded inputs changed (recorded with numpy {DATA['numpy']}): re-record with scripts/record_flash_attn_llamacpp.py"
    got = run_case(case).astype("<f4")
    assert got.shape == (case.n_q, case.n_head * case.dv)
    for row, key in ((0, "first_row"), (-1, "last_row")):
        want = np.frombuffer(base64.b64decode(rec[key]), "<f4")
        assert np.array_equal(got[row], want), \
            f"{case.name} row {row}: max |diff| {np.abs(got[row] - want).max():.3e}"
    assert hashlib.sha256(got.tobytes()).hexdigest() == rec["out_sha256"]


def test_mode_follows_llamacpp() -> None:
    from worker.engine.kernels import attn_kernels as ak

    assert A.ggml_fa_mode(1, 1) == (ak.MODE_VEC, 256)
    assert A.ggml_fa_mode(1, 256) == (ak.MODE_VEC, 256)
    assert A.ggml_fa_mode(1, 257) == (ak.MODE_SPLIT, 512)       # n_kv padded to 512 cells
    assert A.ggml_fa_mode(2, 700) == (ak.MODE_VEC, 768)         # split only for one row
    assert A.ggml_fa_mode(63, 900) == (ak.MODE_VEC, 1024)
    assert A.ggml_fa_mode(64, 64) == (ak.MODE_TILED, 256)


def test_f16_round_matches_numpy() -> None:
    """The kernels' binary16 rounding (ties to even, subnormals, overflow) is numpy's."""
    import numba

    from worker.engine.kernels.attn_kernels import f16r

    @numba.njit
    def rnd(x, out):
        for i in range(x.shape[0]):
            out[i] = f16r(x[i])

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    edge = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 6.1035156e-05, 6.1e-05, 2.98e-08,
                     5.96e-08, 1e-9, 1.0 + 2**-11, 1.0 + 3 * 2**-11, np.inf, -np.inf], np.float32)
    ties = (np.arange(1, 2049, dtype=np.float32) + 0.5) * np.float32(2**-24)   # subnormal halfway points
    x = np.concatenate([x, edge, ties, x * np.float32(1e-30), x * np.float32(1e-36)])
    out = np.empty_like(x)
    rnd(x, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dims", [(4, 1, 256, 256), (4, 2, 64, 64), (2, 1, 40, 40), (3, 3, 16, 16)],
                         ids=["gemma-256", "gqa-64", "dv-40", "dv-16"])
def test_tiled_kernel_gives_the_reference_bits(dims: tuple[int, int, int, int]) -> None:
    """``fa_tiled`` (four query rows per K / V load, explicit vectors) == ``fa_tiled_ref`` (one row at
    a time, the form the llama.cpp fixture was first matched with) on the raw bits: every row count
    around the 4-row and 64-row blocks, positions inside a tile, sliding windows narrower than a
    tile and a KV slice that starts past position 0 (at the first visible key), softcap."""
    from tests.worker import attn_reference as ref
    from worker.engine.kernels import attn_kernels as ak

    nh, nkv, dk, dv = dims
    rng = np.random.default_rng(sum(dims))
    for T in (1, 3, 4, 5, 7, 63, 64, 65, 130):
        for qpos0, window, softcap, kstart in ((0, 0, 0.0, 0), (37, 0, 30.0, 0), (300, 50, 0.0, 251),
                                                (70, 512, 0.0, 0), (200, 20, 0.0, 181)):
            S = qpos0 + T - kstart
            q = (rng.standard_normal((T, nh, dk)) * 0.5).astype(np.float32)
            k = rng.standard_normal((nkv, S, dk)).astype(np.float16).astype(np.float32)
            v = rng.standard_normal((nkv, S, dv)).astype(np.float16).astype(np.float32)
            sc, cap = np.float32(1 / np.sqrt(dk)), np.float32(softcap)
            if cap:
                sc = np.float32(sc / cap)
            got, want = (np.empty((T, nh * dv), np.float32) for _ in range(2))
            ak.fa_tiled(q, k, v, qpos0, kstart, window, sc, cap, got)
            ref.fa_tiled_ref(q, k, v, qpos0, kstart, window, sc, cap, want)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (T, qpos0, window, softcap)


def _f16_round_inputs() -> np.ndarray:
    """float32 values covering binary16 rounding: every f16 value (both zeros, subnormals, the largest
    finite, inf, the quiet NaNs: arithmetic makes no signalling ones, which the hardware conversion
    would quiet and numpy's would not), the halfway points between neighbours (ties, normal and subnormal) and the
    float32 values just below and above each, the overflow edge (65504 .. 65520 .. f32 max), values
    below half the smallest subnormal, and random finite bit patterns at every magnitude."""
    hb = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    hb = hb[((hb & 0x7C00) != 0x7C00) | ((hb & 0x3FF) == 0) | ((hb & 0x200) != 0)]   # no signalling NaN
    f16s = hb.view(np.float16).astype(np.float32)
    fin = np.sort(np.unique(f16s[np.isfinite(f16s)]))
    mids = ((fin[:-1].astype(np.float64) + fin[1:]) / 2).astype(np.float32)      # exact in float32
    assert np.array_equal(mids.astype(np.float64), (fin[:-1].astype(np.float64) + fin[1:]) / 2)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    edge = np.array([65504.0, 65519.99, 65520.0, 65535.0, 65536.0, 1e6, 3.4028235e38, 2.0**-25, 2.0**-26,
                     1.5 * 2.0**-25, 1e-30, 1e-45, 6.1e-05, 6.0975552e-05], np.float32)
    edge = np.concatenate([edge, -edge])
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    rnd = bits.view(np.float32)
    rnd = rnd[np.isfinite(rnd)]
    x = np.concatenate([f16s, mids, near, edge, rnd, rnd * np.float32(2.0**-100), rnd * np.float32(2.0**-120)])
    return x[: x.size - x.size % 16]


def test_vector_f16_round_matches_numpy() -> None:
    """The decode kernel's whole-vector binary16 rounding (``vf16r``, 16 lanes at a time) and the
    scalar one (``f16r``) give numpy's ``astype(float16).astype(float32)`` bit for bit: ties to even
    (normal and subnormal), subnormals, overflow to inf, inf, signed zeros, quiet NaNs."""
    import numba

    from worker.engine.kernels.attn_kernels import f16r, vf16r
    from worker.engine.kernels.simd import vload, vstore

    @numba.njit
    def rnd(x, out, out1):
        for i in range(0, x.shape[0], 16):
            vstore(out, i, vf16r(vload(x, i)))
        for i in range(x.shape[0]):
            out1[i] = f16r(x[i])

    x = _f16_round_inputs()
    out, out1 = np.empty_like(x), np.empty_like(x)
    rnd(x, out, out1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert np.isnan(want).any() and np.isinf(want).any() and (want.view(np.uint32) == 0x80000000).any()
    bad = np.flatnonzero(out.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, [(float(x[i]), float(out[i]), float(want[i])) for i in bad[:5]]
    assert np.array_equal(out1.view(np.uint32), want.view(np.uint32))


def test_vector_lane_sum_is_ggmls_order() -> None:
    """``vsum16`` adds 16 lanes in ``_sum16``'s order (GCC's ``_mm512_reduce_add_ps``), which differs
    from other orders in float32: the same bits on values where the order shows."""
    import numba

    from worker.engine.kernels.attn_kernels import _sum16, vsum16
    from worker.engine.kernels.simd import vload

    @numba.njit
    def sums(x, a, b):
        for r in range(x.shape[0] // 16):
            a[r] = vsum16(vload(x, r * 16))
            b[r] = _sum16(x, r * 16)

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(16 * 4000) * 10.0 ** rng.integers(-8, 8, 16 * 4000)).astype(np.float32)
    a, b = np.empty(4000, np.float32), np.empty(4000, np.float32)
    sums(x, a, b)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert not np.array_equal(a, x.reshape(-1, 16).sum(axis=1, dtype=np.float32))   # the order matters here


@pytest.mark.parametrize("dims", [(9, 3, 64, 64), (4, 1, 256, 256), (4, 4, 96, 96), (4, 2, 128, 128),
                                  (2, 1, 40, 40), (4, 2, 32, 16), (3, 3, 16, 48)],
                         ids=["smollm2", "gemma-256", "d96", "d128", "d40", "d32-16", "d16-48"])
def test_vec_kernel_gives_the_reference_bits(dims: tuple[int, int, int, int]) -> None:
    """``fa_vec`` (a work item per (row, KV head, chunk), vectors, the f16 V sum in registers) ==
    ``fa_vec_ref`` (one (row, head) at a time, scalar: the form the llama.cpp fixture was first matched
    with) on the raw bits, on one thread and on all: both paths (one-row and split-KV over 1-4 chunks,
    chunks past the visible keys), row counts, sliding windows, a KV slice starting past position 0,
    softcap, and the numerics' corners: scores rising key after key (a new maximum, so a rescale of
    the f16 sum, at every key), V large enough to overflow the f16 sum to inf, and inf in V (NaN)."""
    import numba

    from tests.worker import attn_reference as ref
    from worker.engine.kernels import attn_kernels as ak

    nh, nkv, dk, dv = dims
    rng = np.random.default_rng(sum(dims))
    cases = [(1, 300, 0, 0.0, 0, ak.MODE_SPLIT, 512, 2), (1, 700, 0, 30.0, 0, ak.MODE_SPLIT, 768, 3),
             (1, 600, 100, 0.0, 501, ak.MODE_SPLIT, 768, 2), (1, 200, 0, 0.0, 0, ak.MODE_SPLIT, 256, 4),
             (1, 100, 0, 0.0, 0, ak.MODE_SPLIT, 512, 2), (1, 1100, 0, 0.0, 0, ak.MODE_SPLIT, 1280, 1),
             (1, 40, 0, 0.0, 0, ak.MODE_VEC, 256, 2), (5, 37, 0, 30.0, 0, ak.MODE_VEC, 256, 2),
             (3, 300, 50, 0.0, 251, ak.MODE_VEC, 512, 2), (63, 10, 0, 0.0, 0, ak.MODE_VEC, 256, 2)]
    for T, qpos0, window, softcap, kstart, mode, n_cells, n_chunks in cases:
        for kind in ("random", "rising", "overflow", "inf"):
            S = qpos0 + T - kstart
            q = (rng.standard_normal((T, nh, dk)) * 0.5).astype(np.float32)
            k = rng.standard_normal((nkv, S, dk)).astype(np.float16).astype(np.float32)
            v = rng.standard_normal((nkv, S, dv)).astype(np.float16).astype(np.float32)
            if kind == "rising":       # key i along q's direction with a growing weight: scores rise
                k = (np.abs(q[0, :: nh // nkv])[:, None, :] * np.linspace(0.01, 3.0, S)[None, :, None]
                     ).astype(np.float16).astype(np.float32)
                q = np.abs(q)
            elif kind == "overflow":   # finite f16 values whose weighted sum passes 65504
                v = np.full_like(v, 60000.0)
            elif kind == "inf":
                v[:, S // 3] = np.inf
                v[:, S // 2] = -np.inf
            sc, cap = np.float32(1 / np.sqrt(dk)), np.float32(softcap)
            if cap:
                sc = np.float32(sc / cap)
            want = np.empty((T, nh * dv), np.float32)
            ref.fa_vec_ref(q, k, v, qpos0, kstart, window, sc, cap, mode, n_cells, n_chunks, want)
            assert {"random": np.isfinite(want).all(), "rising": np.isfinite(want).all(),
                    "overflow": np.isinf(want).any(), "inf": np.isnan(want).any()}[kind], kind
            for threads in (1, numba.config.NUMBA_NUM_THREADS):
                numba.set_num_threads(threads)
                got = np.empty((T, nh * dv), np.float32)
                ak.fa_vec(q, k, v, qpos0, kstart, window, sc, cap, mode, n_cells, n_chunks, got)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
                    (T, qpos0, window, softcap, mode, n_chunks, kind, threads)
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_rms_norm_and_glu_kernels_give_numpys_bits() -> None:
    """``rms_norm(kernel=True)`` (numba, numpy's pairwise float64 sum reproduced) and ``glu_ggml``
    (SiLU / GELU of the gate times the up half in one pass) == the NumPy forms on the raw bits:
    the models' row widths (SmolLM2 576 / 1536, Gemma 640 / 2048 / per-head 256, a tail below 8
    and below 16), magnitudes e^±8 and zero rows, 3-D per-head views of a wider matrix, GELU's
    +-10 cut-offs."""
    from worker.engine.kernels import attn_kernels as ak
    from worker.engine.arch import layers
    from worker.engine.arch.layers import gelu_tanh_ggml, glu_ggml, rms_norm, silu_ggml

    assert layers._PAIRWISE_MAX == ak.PAIRWISE_MAX
    rng = np.random.default_rng(3)
    for n in (16, 21, 64, 256, 576, 640, 1536, 2048, 2053, 6144):
        x = (rng.standard_normal((40, n)) * np.exp(rng.uniform(-8, 8, (40, 1)))).astype(np.float32)
        x[3] = 0.0
        w = (1 + rng.standard_normal(n)).astype(np.float32)
        for eps in (1e-6, 1e-5):
            want, got = rms_norm(x, w, eps), rms_norm(x, w, eps, kernel=True)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n, eps)
        gu = np.concatenate([x * np.float32(3), x[::-1]], axis=1)               # [40, 2n]
        gu[5, :n] = np.linspace(-12, 12, n, dtype=np.float32)
        gu[6, :4] = [-10.0, 10.0, np.nextafter(np.float32(-10), 0), np.nextafter(np.float32(10), 0)]
        for act in (silu_ggml, gelu_tanh_ggml):
            with np.errstate(over="ignore"):
                want = act(gu[:, :n]) * gu[:, n:]
            assert np.array_equal(glu_ggml(gu, n, act).view(np.uint32), want.view(np.uint32)), (n, act)
    wide = rng.standard_normal((7, 4 * 256 + 2 * 256)).astype(np.float32)
    for view in (wide[:, :1024].reshape(7, 4, 256), wide[:, 1024:1280].reshape(7, 1, 256)):
        w = rng.standard_normal(256).astype(np.float32)
        want, got = rms_norm(view, w, 1e-6), rms_norm(view, w, 1e-6, kernel=True)
        assert got.shape == view.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_pairwise_sum_is_numpys_at_every_length() -> None:
    """``attn_kernels._pairwise_sum`` (numpy's recursive pairwise float64 sum as a loop over an
    explicit stack) == ``0.0 + a.sum()`` on the raw bits at every length 1 .. PAIRWISE_MAX, on
    values whose sum shows the order (magnitudes e^+-30, both signs)."""
    from worker.engine.kernels import attn_kernels as ak

    rng = np.random.default_rng(5)
    a = rng.standard_normal(ak.PAIRWISE_MAX) * np.exp(rng.uniform(-30, 30, ak.PAIRWISE_MAX))
    sn = np.empty((ak._PW_DEPTH, 2), np.int64)
    sv = np.empty(ak._PW_DEPTH, np.float64)
    got = np.array([ak._pairwise_sum(a, 0, n, sn, sv) for n in range(1, ak.PAIRWISE_MAX + 1)])
    want = np.array([0.0 + a[:n].sum() for n in range(1, ak.PAIRWISE_MAX + 1)])
    assert np.array_equal(got.view(np.uint64), want.view(np.uint64))
    assert not np.array_equal(want, np.cumsum(a))     # a sum in order differs: the order is tested


def test_rope_kernel_gives_numpys_bits() -> None:
    """``RopeTable`` on the libm tables rotates float32 heads by ``attn_kernels.rope_rows``: the
    same bits as its NumPy rotation (``_rotate``), NEOX and adjacent pairs, a partial rotary
    dimension, heads as strided views of a fused QKV matrix and as contiguous arrays."""
    from worker.engine.arch.layers import RopeTable

    rng = np.random.default_rng(5)
    for n_rot, hd in ((64, 64), (256, 256), (32, 64)):
        rope = RopeTable(300, n_rot, 10000.0, libm=True)
        assert rope.kernel
        pos = rng.integers(0, 300, 9)
        qkv = (rng.standard_normal((9, 5 * hd)) * 30).astype(np.float32)
        for neox in (True, False):
            for x in (qkv[:, :3 * hd].reshape(9, 3, hd), np.ascontiguousarray(qkv[:, 3 * hd:].reshape(9, 2, hd))):
                want = x.copy()
                half = n_rot // 2
                if neox:
                    rope._rotate(want[..., :half], want[..., half:n_rot], pos)
                else:
                    rope._rotate(want[..., 0:n_rot:2], want[..., 1:n_rot:2], pos)
                got = x.copy() if x.flags.c_contiguous else qkv.copy()[:, :3 * hd].reshape(9, 3, hd)
                (rope.apply_neox if neox else rope.apply_norm)(got, pos)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n_rot, neox)


def _entry(n_layer: int, n_kv: int, hd: int, cap: int) -> KVEntry:
    return KVEntry(KVShape(n_layer, n_kv, hd, hd), cap)


@pytest.mark.parametrize("window", [None, 40])
def test_attend_is_batch_invariant(window: int | None) -> None:
    """One step over three sequences (a decode over > 256 keys: split-KV; a 70-row prefill chunk:
    tiled; a 5-row chunk: one-row kernel) gives each sequence's rows the bits it gets alone,
    whatever the thread count."""
    import numba

    rng = np.random.default_rng(5)
    n_head, n_kv, hd = 4, 2, 64
    lens = [(300, 1), (0, 70), (12, 5)]   # (positions already held, rows this step)

    def prepared() -> list[KVEntry]:
        out = []
        for past, n in lens:
            e = _entry(1, n_kv, hd, past + n)
            if past:
                kv = np.random.default_rng(past).standard_normal((2, past, n_kv, hd)).astype(np.float32)
                e.store(0, 0, A.round_f16(kv[0]), A.round_f16(kv[1]))
                e.tokens.extend(range(past))
            out.append(e)
        return out

    n_tot = sum(n for _, n in lens)
    q = rng.standard_normal((n_tot, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_tot, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_tot, n_kv, hd)).astype(np.float32)
    entries = prepared()
    segs, start = [], 0
    for e, (past, n) in zip(entries, lens):
        segs.append(A.Segment(e, start, n, past))
        start += n
    together = A.attend(A.AttnBatch(segs, np.float32), 0, q, k, v, 0.125, window, f16=True)
    start = 0
    for i, (e, (past, n)) in enumerate(zip(prepared(), lens)):
        rows = slice(start, start + n)
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            e.truncate(past)
            alone = A.attend(A.AttnBatch([A.Segment(e, 0, n, past)], np.float32), 0, q[rows], k[rows], v[rows],
                             0.125, window, f16=True)
            assert np.array_equal(alone, together[rows]), (i, threads)
        start += n
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_attend_f16_stores_f16_values_and_matches_reference_closely() -> None:
    """The ggml path keeps K/V at f16 precision and stays within f16 noise of the float32 reference."""
    rng = np.random.default_rng(9)
    n, n_head, n_kv, hd = 20, 4, 2, 32
    q, k, v = (rng.standard_normal((n, h, hd)).astype(np.float32) for h in (n_head, n_kv, n_kv))
    e16, e32 = _entry(1, n_kv, hd, n), _entry(1, n_kv, hd, n)
    got = A.attend(A.AttnBatch([A.Segment(e16, 0, n, 0)], np.float32), 0, q, k, v, 0.2, None, f16=True)
    ref = A.attend(A.AttnBatch([A.Segment(e32, 0, n, 0)], np.float32), 0, q, k, v, 0.2, None, f16=False)
    kk = e16.keys(0, 0, n)
    assert np.array_equal(kk, A.round_f16(kk)) and not np.array_equal(kk, e32.keys(0, 0, n))
    assert np.abs(got - ref).max() < 5e-3
