"""numba kernels of llama.cpp's CPU flash attention, used by :mod:`worker.engine.attention` on the ggml path.

They reproduce, operation by operation, ``ggml_compute_forward_flash_attn_ext_f16`` of
ggml-cpu ``ops.cpp`` (llama.cpp b11434, x86-64 with AVX-512F and no AVX512-FP16, as built
with ``GGML_NATIVE`` on this machine kind) over an f16 K/V cache. Of its three code paths
the caller picks the one llama.cpp would run for the sequence alone (:func:`worker.engine.attention.ggml_fa_mode`):

* ``MODE_VEC`` — ``..._f16_one_chunk``: per query row and head, Q rounded to f16, each
  visible key in cell order: ``s = ggml_vec_dot_f16(K, Q) * scale`` (f32 FMA lanes of
  16 in 4 accumulators per 64 elements, ``_mm512_reduce_add_ps``, leftovers summed in
  double), an online softmax with libm ``expf`` (``S = S*ms + vs`` fused), and the
  softmax·V sum kept in **f16** (``VKQ16``): ``ggml_vec_scale_f16`` on a new maximum,
  ``ggml_vec_mad_f16`` (``f16(fma(v, vs, acc))``) for every key; then ``VKQ * (1/S)``.
* ``MODE_SPLIT`` — the split-KV decode path (one query row, ``n_kv >= 512`` cells): the
  cells ``0 .. n_kv-1`` are cut into ``n_chunks`` (llama.cpp's thread count) equal
  chunks, each run as above without the division, and the partial ``(M, S, VKQ)`` are
  merged in f32 (``ggml_flash_attn_ext_reduce_partials``).
* ``MODE_TILED`` — ``..._tiled`` (``>= 64`` query rows in the batch): Q kept in f32, tiles
  of 64 cells; per tile ``KQ = Q·K`` (one FMA chain per score, ``simd_gemm``), scale, a
  tile maximum, ``expf`` rescaling of the f32 accumulator on a new maximum, the tile's
  softmax by ggml's AVX-512 ``ggml_v_expf`` polynomial summed per 16 lanes into a double,
  ``VKQ += KQ·V`` (one FMA chain per output), and ``VKQ * (1/S)`` at the end.

Cells are positions here (llama.cpp's cells of one sequence in a fresh cache are its
positions in order; see :mod:`worker.engine.attention`). Masked cells (causal, sliding window) are
skipped exactly as ggml's ``-INFINITY`` mask entries are. Every (query row, head) is
computed by one thread from its own inputs only, so the result does not depend on the
other rows or sequences of the batch, nor on the thread count.

Arrays: ``q`` float32 ``[T, n_head, DK]`` (after RoPE and any q scaling); ``keys`` float32
``[n_kv_head, S, DK]`` and ``values`` ``[n_kv_head, S, DV]`` holding f16 values (the KV
cache), key ``i`` at position ``kpos0 + i``; query row ``t`` at position ``qpos0 + t``;
``out`` float32 ``[T, n_head * DV]``. Query head ``h`` reads KV head ``h // (n_head / n_kv_head)``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _iget_num_threads  # numba's get_num_threads by symbol (cacheable)

from .simd import claim, f32x16, vadd, vfma, vfma_s, vload, vmul, vmul_s, vstore, vzero

#: the row-wise kernels (here and in quant_kernels) run their rows in parallel, in blocks of PAR_ROWS,
#: from PAR_MIN input elements on, below it on the calling thread (a decode step's few rows are
#: not worth a parallel launch); each row is computed alone, so the split does not change a bit
PAR_MIN = 32768
PAR_ROWS = 8

f32 = numba.float32

MODE_VEC = 0
MODE_SPLIT = 1
MODE_TILED = 2

#: ggml_fa_tile_config (ggml-cpu common.h): query rows and KV cells per tile of the tiled path
TILE_Q = 64
TILE_KV = 64


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` rounded once (float32 FMA, as ``_mm512_fmadd_ps``)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _pow2_f64(typingctx, n):
    """``2.0 ** n`` as a float64 for an int64 ``n`` in [-1022, 1023] (its exponent bits)."""
    if n != types.int64:
        return None

    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(ir.IntType(64), 1023)), ir.Constant(ir.IntType(64), 52))
        return builder.bitcast(bits, ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def f16r(typingctx, x):
    """float32 ``x`` rounded to the nearest binary16 (ties to even, subnormals, overflow to inf:
    the ``_mm512_cvtps_ph(x, 0)`` / ``GGML_CPU_FP32_TO_FP16`` rounding), returned as float32
    (LLVM ``fptrunc`` to half and back: F16C's vcvtps2ph where the CPU has it)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def f16bits(typingctx, x):
    """float32 ``x`` rounded to the nearest binary16 as :func:`f16r` rounds it, returned as its bit
    pattern (an int64 in ``0 .. 65535``: numpy's ``x.astype(float16).view(uint16)``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        h = builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return builder.zext(h, ir.IntType(64))

    return types.int64(types.float32), codegen


@njit(cache=True, inline="always")
def _expf(x):
    return f32(math.exp(x))   # float32 exp: llvm.exp.f32 -> libm expf, as ggml's scalar expf


_VE_R = f32(float.fromhex("0x1.8p23"))
_VE_L2E = f32(float.fromhex("0x1.715476p+0"))
_VE_LN2HI = f32(float.fromhex("0x1.62e4p-1"))
_VE_LN2LO = f32(float.fromhex("0x1.7f7d1cp-20"))
_VE_C5 = f32(float.fromhex("0x1.0e4020p-7"))
_VE_C4 = f32(float.fromhex("0x1.573e2ep-5"))
_VE_C3 = f32(float.fromhex("0x1.555e66p-3"))
_VE_C2 = f32(float.fromhex("0x1.fffdb6p-2"))
_VE_C1 = f32(float.fromhex("0x1.ffffecp-1"))


@njit(cache=True, inline="always")
def v_expf(x):
    """One lane of ggml's AVX-512 ``ggml_v_expf`` (vec.h): exp by a degree-5 polynomial and
    ``_mm512_scalef_ps``; 0 below and inf above its range."""
    z = fma32(x, _VE_L2E, _VE_R)
    n = z - _VE_R
    b = fma32(-n, _VE_LN2LO, fma32(-n, _VE_LN2HI, x))
    u = b * b
    j = fma32(fma32(fma32(_VE_C5, b, _VE_C4), u, fma32(_VE_C3, b, _VE_C2)), u, fma32(_VE_C1, b, f32(1.0)))
    if abs(n) > f32(192.0):
        return f32(0.0) if n <= f32(0.0) else f32(np.inf)
    return f32(np.float64(j) * _pow2_f64(np.int64(n)))   # scalef: j * 2^n (exact in double), rounded once


@njit(cache=True, inline="always")
def _sum16(v, o):
    # _mm512_reduce_add_ps of v[o .. o+15] (GCC: halves, quarters, {2,3,0,1} shuffle, last pair)
    t0 = v[o + 8] + v[o + 0]
    t1 = v[o + 9] + v[o + 1]
    t2 = v[o + 10] + v[o + 2]
    t3 = v[o + 11] + v[o + 3]
    t4 = v[o + 12] + v[o + 4]
    t5 = v[o + 13] + v[o + 5]
    t6 = v[o + 14] + v[o + 6]
    t7 = v[o + 15] + v[o + 7]
    u0 = t4 + t0
    u1 = t5 + t1
    u2 = t6 + t2
    u3 = t7 + t3
    return (u0 + u2) + (u1 + u3)


@njit(cache=True, inline="always")
def _online_step(s, M):
    # one key of one_chunk's online softmax at score s with maximum M so far: -> (new maximum, ms,
    # vs, whether s is a new maximum); VKQ becomes f16(VKQ * ms) on a new maximum, then f16(fma(v, vs, VKQ))
    if s > M:
        return s, _expf(M - s), f32(1.0), True
    return M, f32(1.0), _expf(s - M), False


@njit(cache=True, inline="always")
def _merge_chunk(acc, part, po, mf, sf, mc, sc):
    # ggml_flash_attn_ext_reduce_partials' step: chunk (mc, sc != 0, VKQ part[po .. po+dv-1]) folded into
    # (mf, sf, acc [dv]) in f32; -> the new (mf, sf)
    mn = max(mf, mc)
    so = _expf(mf - mn)
    sn = _expf(mc - mn)
    for d in range(acc.shape[0]):
        acc[d] = fma32(acc[d], so, part[po + d] * sn)
    return mn, fma32(sf, so, sc * sn)


def _shuffle(builder, v, idx):
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), idx))


@intrinsic
def vsum16(typingctx, v):
    """The sum of the 16 lanes of ``v`` as :func:`_sum16` adds them (``_mm512_reduce_add_ps`` as GCC
    builds it: lanes 8..15 + 0..7, then 4..7 + 0..3, then (l0 + l2) + (l1 + l3)), as a float32."""
    if v != f32x16:
        return None

    def codegen(context, builder, signature, args):
        x = args[0]
        t = builder.fadd(_shuffle(builder, x, list(range(8, 16))), _shuffle(builder, x, list(range(8))))
        u = builder.fadd(_shuffle(builder, t, [4, 5, 6, 7]), _shuffle(builder, t, [0, 1, 2, 3]))
        w = builder.fadd(_shuffle(builder, u, [0, 1]), _shuffle(builder, u, [2, 3]))
        i32 = ir.IntType(32)
        return builder.fadd(builder.extract_element(w, ir.Constant(i32, 0)),
                            builder.extract_element(w, ir.Constant(i32, 1)))

    return types.float32(v), codegen


@intrinsic
def vf16r(typingctx, v):
    """:func:`f16r` of every lane of ``v`` (LLVM ``fptrunc <16 x float>`` to half and back: F16C's
    ``vcvtps2ph`` / ``vcvtph2ps`` on whole vectors where the CPU has them)."""
    if v != f32x16:
        return None

    def codegen(context, builder, signature, args):
        v16 = ir.VectorType(ir.FloatType(), 16)
        return builder.fpext(builder.fptrunc(args[0], ir.VectorType(ir.HalfType(), 16)), v16)

    return f32x16(v), codegen


@njit(cache=True, inline="always")
def _dot_f16_vec(keys, kb, q16, qb, np_):
    # dot_f16's first np_ (a multiple of 64, > 0) elements of keys.flat[kb:] and q16.flat[qb:] on
    # explicit vectors: the same 4 x 16 lanes (products, then FMAs), x0+x2, x1+x3, then x0+x1, _sum16
    x0 = vmul(vload(keys, kb), vload(q16, qb))
    x1 = vmul(vload(keys, kb + 16), vload(q16, qb + 16))
    x2 = vmul(vload(keys, kb + 32), vload(q16, qb + 32))
    x3 = vmul(vload(keys, kb + 48), vload(q16, qb + 48))
    for st in range(1, np_ // 64):
        j = st * 64
        x0 = vfma(vload(keys, kb + j), vload(q16, qb + j), x0)
        x1 = vfma(vload(keys, kb + j + 16), vload(q16, qb + j + 16), x1)
        x2 = vfma(vload(keys, kb + j + 32), vload(q16, qb + j + 32), x2)
        x3 = vfma(vload(keys, kb + j + 48), vload(q16, qb + j + 48), x3)
    return vsum16(vadd(vadd(x0, x2), vadd(x1, x3)))


@njit(cache=True)
def _group_scores(q16, keys, g, i0, i1, scale, softcap, sc):
    # sc[j, i - i0] = the score of query head j (q16 [grp, dk], f16-valued) against key i of KV head g,
    # for i in i0 .. i1-1: dot_f16 (its 64-element blocks on vectors), * scale, softcap
    n_kv, S_len, dk = keys.shape
    grp = q16.shape[0]
    np_ = dk & ~63
    for i in range(i0, i1):
        kb = (g * S_len + i) * dk
        for j in range(grp):
            sumf = 0.0
            if np_ > 0:
                sumf = np.float64(_dot_f16_vec(keys, kb, q16, j * dk, np_))
            for d in range(np_, dk):
                sumf += np.float64(keys[g, i, d] * q16[j, d])
            s = f32(sumf) * scale
            if softcap != f32(0.0):
                s = softcap * f32(math.tanh(s))
            sc[j, i - i0] = s


@njit(cache=True)
def _group_softmax(sc, n, wv, wm, nm):
    # _vec_chunk's online softmax over the scores sc [grp, >= n] of each head, without the V sum:
    # per key i, wv[j, i] = vs, wm[j, i] = ms, nm[j, i] = whether it is a new maximum (the V sum is
    # then rescaled by ms first); -> (M, S) per head in the first two rows of a [2, grp] result
    grp = sc.shape[0]
    res = np.empty((2, grp), np.float32)
    for j in range(grp):
        S = f32(0.0)
        M = f32(-np.inf)
        for i in range(n):
            M, ms, vs, nm[j, i] = _online_step(sc[j, i], M)
            wv[j, i] = vs
            wm[j, i] = ms
            S = fma32(S, ms, vs)
        res[0, j] = M
        res[1, j] = S
    return res


@njit(cache=True)
def _vkq64(values, g, i0, n, d0, wv, wm, nm, j, vkq, vo):
    # _vec_chunk's f16 softmax.V sum of head j over the keys i0 .. i0+n-1 of KV head g, lanes
    # d0 .. d0+63, in registers (4 x 16 lanes): per key, on a new maximum f16(vkq * ms), then
    # f16(fma(v, vs, vkq)); stored to vkq.flat[vo + d0 ..]
    n_kv, S_len, dv = values.shape
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    for i in range(n):
        if nm[j, i]:
            ms = wm[j, i]
            a0 = vf16r(vmul_s(a0, ms))
            a1 = vf16r(vmul_s(a1, ms))
            a2 = vf16r(vmul_s(a2, ms))
            a3 = vf16r(vmul_s(a3, ms))
        vs = wv[j, i]
        vb = (g * S_len + i0 + i) * dv + d0
        a0 = vf16r(vfma_s(vload(values, vb), vs, a0))
        a1 = vf16r(vfma_s(vload(values, vb + 16), vs, a1))
        a2 = vf16r(vfma_s(vload(values, vb + 32), vs, a2))
        a3 = vf16r(vfma_s(vload(values, vb + 48), vs, a3))
    vstore(vkq, vo + d0, a0)
    vstore(vkq, vo + d0 + 16, a1)
    vstore(vkq, vo + d0 + 32, a2)
    vstore(vkq, vo + d0 + 48, a3)


@njit(cache=True)
def _vkq16(values, g, i0, n, d0, wv, wm, nm, j, vkq, vo):
    # _vkq64 for the 16 lanes d0 .. d0+15
    n_kv, S_len, dv = values.shape
    a0 = vzero()
    for i in range(n):
        if nm[j, i]:
            a0 = vf16r(vmul_s(a0, wm[j, i]))
        a0 = vf16r(vfma_s(vload(values, (g * S_len + i0 + i) * dv + d0), wv[j, i], a0))
    vstore(vkq, vo + d0, a0)


@njit(cache=True)
def _vkq_tail(values, g, i0, n, d0, wv, wm, nm, j, vkq, vo):
    # _vkq64 for the lanes d0 .. dv-1 (fewer than 16), one at a time
    n_kv, S_len, dv = values.shape
    for d in range(d0, dv):
        vkq[vo + d] = f32(0.0)
    for i in range(n):
        if nm[j, i]:
            ms = wm[j, i]
            for d in range(d0, dv):
                vkq[vo + d] = f16r(vkq[vo + d] * ms)
        vs = wv[j, i]
        for d in range(d0, dv):
            vkq[vo + d] = f16r(fma32(values[g, i0 + i, d], vs, vkq[vo + d]))


@njit(cache=True)
def _vec_group_chunk(q, keys, values, t, g, i0, i1, scale, softcap, q16, vkq, vo, pm, ps, c):
    # _vec_chunk for the query heads g*grp .. g*grp+grp-1 (those of KV head g) of row t over the key
    # indices i0 .. i1-1 (all visible, i0 < i1), each K and V row loaded once for the group: the
    # scores, then the online softmax, then the f16 V sums (vectors) into vkq.flat[vo(j) ..] with
    # vo(j) = vo + j * dv * (chunks); (M, S) of head h into pm / ps [t, h, c]. q16 scratch [grp, dk].
    n_head = q.shape[1]
    grp, dk = q16.shape
    dv = values.shape[2]
    nch = pm.shape[2]
    h0 = g * grp
    n = i1 - i0
    for j in range(grp):
        for d in range(dk):
            q16[j, d] = f16r(q[t, h0 + j, d])
    sc = np.empty((grp, n), np.float32)
    wv = np.empty((grp, n), np.float32)
    wm = np.empty((grp, n), np.float32)
    nm = np.empty((grp, n), np.bool_)
    _group_scores(q16, keys, g, i0, i1, scale, softcap, sc)
    res = _group_softmax(sc, n, wv, wm, nm)
    for j in range(grp):
        pm[t, h0 + j, c] = res[0, j]
        ps[t, h0 + j, c] = res[1, j]
        voj = vo + j * nch * dv
        d0 = 0
        while d0 + 64 <= dv:
            _vkq64(values, g, i0, n, d0, wv, wm, nm, j, vkq, voj)
            d0 += 64
        while d0 + 16 <= dv:
            _vkq16(values, g, i0, n, d0, wv, wm, nm, j, vkq, voj)
            d0 += 16
        if d0 < dv:
            _vkq_tail(values, g, i0, n, d0, wv, wm, nm, j, vkq, voj)


@njit(cache=True)
def n_workers(n_items):
    """Iterations of a parallel loop whose threads take its ``n_items`` work items as they come
    (:func:`.simd.claim`): one per thread, at most one per item. A thread another process keeps off
    its core then holds at most the item it took; each item is computed whole by one thread, so
    the bits do not depend on which."""
    return min(_iget_num_threads(), n_items)


@njit(cache=True, parallel=True)
def fa_vec(q, keys, values, qpos0, kpos0, window, scale, softcap, mode, n_cells, n_chunks, out):
    """MODE_VEC / MODE_SPLIT over every (row, head) of ``q``; see the module docstring.
    window 0: none; n_cells / n_chunks: llama.cpp's KV view length and thread count (split).
    ``q``, ``keys``, ``values`` C-contiguous float32.

    The same operations per (row, head) as the scalar reference ``fa_vec_ref`` (tests/worker/
    attn_reference.py; tested ``==``), organised for speed:
    a work item is (row, KV head, chunk), taken by the threads as they come; it computes the
    scores of the KV head's query heads (each K row loaded once for them, ggml's 4 x 16-lane dot
    on explicit vectors), then each head's online softmax (libm ``expf``), then each head's f16
    softmax.V sum with the accumulator in registers (whole-vector f16 rounding, :func:`vf16r`). The
    chunks' partial (M, S, VKQ) are merged per (row, head) afterwards, in chunk order, as
    ``ggml_flash_attn_ext_reduce_partials`` does."""
    T, n_head, dk = q.shape
    n_kv, S_len, dv = values.shape
    grp = n_head // n_kv
    nch = n_chunks if mode == MODE_SPLIT else 1
    cs = (n_cells + n_chunks - 1) // n_chunks
    pm = np.empty((T, n_head, nch), np.float32)
    ps = np.empty((T, n_head, nch), np.float32)
    pv = np.empty(T * n_head * nch * dv, np.float32)     # [T, n_head, nch, dv]: each chunk's VKQ
    n_items = T * n_kv * nch
    taken = np.zeros(1, np.int64)
    for _ in prange(n_workers(n_items)):
        q16 = np.empty((grp, dk), np.float32)
        it = claim(taken)
        while it < n_items:
            c = it % nch
            g = (it // nch) % n_kv
            t = it // (nch * n_kv)
            qp = qpos0 + t
            lo = 0 if window == 0 else max(0, qp - window + 1)   # visible positions lo .. qp
            a = lo
            b = qp + 1
            if mode == MODE_SPLIT:
                a = max(c * cs, lo)
                b = min((c + 1) * cs, n_cells, qp + 1)
            if a >= b:
                for j in range(grp):
                    pm[t, g * grp + j, c] = f32(-np.inf)
                    ps[t, g * grp + j, c] = f32(0.0)            # an empty chunk: skipped by the merge
            else:
                _vec_group_chunk(q, keys, values, t, g, a - kpos0, b - kpos0, scale, softcap, q16, pv,
                                 ((t * n_head + g * grp) * nch + c) * dv, pm, ps, c)
            it = claim(taken)
    for t in range(T):
        for h in range(n_head):
            o0 = h * dv
            vo = (t * n_head + h) * nch * dv
            if mode == MODE_SPLIT:
                mf = f32(-np.inf)
                sf = f32(0.0)
                acc = np.zeros(dv, np.float32)
                for c in range(nch):
                    if ps[t, h, c] != f32(0.0):
                        mf, sf = _merge_chunk(acc, pv, vo + c * dv, mf, sf, pm[t, h, c], ps[t, h, c])
                inv = f32(1.0) / sf if sf != f32(0.0) else f32(0.0)
                for d in range(dv):
                    out[t, o0 + d] = acc[d] * inv
            else:
                sc = ps[t, h, 0]
                inv = f32(1.0) / sc if sc != f32(0.0) else f32(0.0)
                for d in range(dv):
                    out[t, o0 + d] = pv[vo + d] * inv


@njit(cache=True, inline="always")
def _first_cell(qp, window):
    # the first cell of the tile holding the first cell query position qp sees (window 0: none)
    return ((0 if window == 0 else max(0, qp - window + 1)) // TILE_KV) * TILE_KV


@njit(cache=True, inline="always")
def _visible(qp, window, c0):
    # the cells of the tile at c0 that query position qp sees: a .. b-1 (none where a >= b)
    lo = 0 if window == 0 else max(0, qp - window + 1)
    return max(c0, lo), min(c0 + TILE_KV, qp + 1)


@njit(cache=True, inline="always")
def _tile_kq_row(kt, q, t, h, kq):
    # raw scores of query row t against the packed tile kt [dk, TILE_KV]: kq[tk] = the FMA chain
    # over d in order of kt[d, tk] * q[t, h, d]
    for tk in range(TILE_KV):
        kq[tk] = f32(0.0)
    for d in range(kt.shape[0]):
        qd = q[t, h, d]
        for tk in range(TILE_KV):
            kq[tk] = fma32(kt[d, tk], qd, kq[tk])


@njit(cache=True)
def _tile_softmax(kq, c0, a, b, scale, softcap, r, M, S, vkq):
    # one row's step of the tiled path over the tile at c0 whose visible cells are a .. b-1 (kq
    # [TILE_KV]: the raw scores, replaced by the softmax weights): mask, scale (softcap), the tile
    # maximum, the f32 accumulator's expf rescaling, ggml_v_expf and the tile sum (as the reference fa_tiled_ref)
    dv = vkq.shape[1]
    for tk in range(TILE_KV):
        p = c0 + tk
        if p < a or p >= b:
            kq[tk] = f32(-np.inf)
        else:
            s = kq[tk] * scale
            if softcap != f32(0.0):
                s = softcap * f32(math.tanh(s))
            kq[tk] = s
    tmax = f32(-np.inf)
    for tk in range(TILE_KV):
        if kq[tk] > tmax:
            tmax = kq[tk]
    mold = M[r]
    mnew = max(mold, tmax)
    if mnew > mold:
        ms = _expf(mold - mnew)
        for d in range(dv):
            vkq[r, d] = vkq[r, d] * ms
        S[r] = S[r] * ms
    M[r] = mnew
    tsum = 0.0
    for bi in range(TILE_KV // 16):
        blk = bi * 16
        for tk in range(blk, blk + 16):
            kq[tk] = v_expf(kq[tk] - mnew)
        tsum += np.float64(_sum16(kq, blk))
    S[r] = f32(np.float64(S[r]) + tsum)


@njit(cache=True)
def _tile_vkq_row(kq, values, g, i0, tk0, tk1, r, vkq):
    # vkq[r] += kq[tk] * V[i0 + tk] for tk = tk0 .. tk1-1 in order (one FMA chain per output)
    dv = vkq.shape[1]
    for tk in range(tk0, tk1):
        w = kq[tk]
        i = i0 + tk
        for d in range(dv):
            vkq[r, d] = fma32(w, values[g, i, d], vkq[r, d])


@njit(cache=True, inline="always")
def _load4(arr, o):
    # the 64 float32 arr.flat[o .. o+63] as 4 x 16 lanes
    return vload(arr, o), vload(arr, o + 16), vload(arr, o + 32), vload(arr, o + 48)


@njit(cache=True, inline="always")
def _store4(arr, o, x0, x1, x2, x3):
    # 4 x 16 lanes to arr.flat[o .. o+63]
    vstore(arr, o, x0)
    vstore(arr, o + 16, x1)
    vstore(arr, o + 32, x2)
    vstore(arr, o + 48, x3)


@njit(cache=True, inline="always")
def _fma4(x0, x1, x2, x3, w, a0, a1, a2, a3):
    # (x_i * w + a_i rounded once, lane by lane) for the 4 x 16 lanes of one 64-wide accumulator row
    return vfma_s(x0, w, a0), vfma_s(x1, w, a1), vfma_s(x2, w, a2), vfma_s(x3, w, a3)


@njit(cache=True)
def _tile_vkq4(kq4, values, g, i0, tk0, tk1, r, vkq):
    # _tile_vkq_row for the 4 rows r .. r+3 over the same cells, the accumulators in registers
    # for a whole run of cells (4 rows x 64 outputs), each V load shared by the 4 rows: the same
    # FMAs in the same order per output. dv a multiple of 16.
    n_kv, S_len, dv = values.shape
    step = 64 if dv % 64 == 0 else 16
    for d0 in range(0, dv, step):
        if step == 64:
            a0, a1, a2, a3 = _load4(vkq, r * dv + d0)
            b0, b1, b2, b3 = _load4(vkq, (r + 1) * dv + d0)
            c0, c1, c2, c3 = _load4(vkq, (r + 2) * dv + d0)
            e0, e1, e2, e3 = _load4(vkq, (r + 3) * dv + d0)
            for tk in range(tk0, tk1):
                v0, v1, v2, v3 = _load4(values, (g * S_len + i0 + tk) * dv + d0)
                a0, a1, a2, a3 = _fma4(v0, v1, v2, v3, kq4[0, tk], a0, a1, a2, a3)
                b0, b1, b2, b3 = _fma4(v0, v1, v2, v3, kq4[1, tk], b0, b1, b2, b3)
                c0, c1, c2, c3 = _fma4(v0, v1, v2, v3, kq4[2, tk], c0, c1, c2, c3)
                e0, e1, e2, e3 = _fma4(v0, v1, v2, v3, kq4[3, tk], e0, e1, e2, e3)
            _store4(vkq, r * dv + d0, a0, a1, a2, a3)
            _store4(vkq, (r + 1) * dv + d0, b0, b1, b2, b3)
            _store4(vkq, (r + 2) * dv + d0, c0, c1, c2, c3)
            _store4(vkq, (r + 3) * dv + d0, e0, e1, e2, e3)
        else:
            a0 = vload(vkq, r * dv + d0)
            b0 = vload(vkq, (r + 1) * dv + d0)
            c0 = vload(vkq, (r + 2) * dv + d0)
            e0 = vload(vkq, (r + 3) * dv + d0)
            for tk in range(tk0, tk1):
                v0 = vload(values, (g * S_len + i0 + tk) * dv + d0)
                a0 = vfma_s(v0, kq4[0, tk], a0)
                b0 = vfma_s(v0, kq4[1, tk], b0)
                c0 = vfma_s(v0, kq4[2, tk], c0)
                e0 = vfma_s(v0, kq4[3, tk], e0)
            vstore(vkq, r * dv + d0, a0)
            vstore(vkq, (r + 1) * dv + d0, b0)
            vstore(vkq, (r + 2) * dv + d0, c0)
            vstore(vkq, (r + 3) * dv + d0, e0)


@njit(cache=True)
def _tile_kq4(kt, q, t, h, dk, kq4):
    # raw scores of the 4 query rows t .. t+3 against the packed tile kt [dk, TILE_KV]: kq4[j, tk] =
    # the FMA chain over d in order of kt[d, tk] * q[t+j, h, d] (as _tile_kq_row), each K load
    # shared by the 4 rows
    a0 = a1 = a2 = a3 = vzero()
    b0 = b1 = b2 = b3 = vzero()
    c0 = c1 = c2 = c3 = vzero()
    e0 = e1 = e2 = e3 = vzero()
    for d in range(dk):
        k0, k1, k2, k3 = _load4(kt, d * TILE_KV)
        a0, a1, a2, a3 = _fma4(k0, k1, k2, k3, q[t, h, d], a0, a1, a2, a3)
        b0, b1, b2, b3 = _fma4(k0, k1, k2, k3, q[t + 1, h, d], b0, b1, b2, b3)
        c0, c1, c2, c3 = _fma4(k0, k1, k2, k3, q[t + 2, h, d], c0, c1, c2, c3)
        e0, e1, e2, e3 = _fma4(k0, k1, k2, k3, q[t + 3, h, d], e0, e1, e2, e3)
    _store4(kq4, 0, a0, a1, a2, a3)
    _store4(kq4, 64, b0, b1, b2, b3)
    _store4(kq4, 128, c0, c1, c2, c3)
    _store4(kq4, 192, e0, e1, e2, e3)


@njit(cache=True, parallel=True)
def fa_tiled(q, keys, values, qpos0, kpos0, window, scale, softcap, out):
    """MODE_TILED over every (row, head) of ``q``; see the module docstring. Work items are
    (head, block of TILE_Q rows): the K tile is packed transposed once per block. The same
    operations in the same order per (row, head) as the scalar reference ``fa_tiled_ref``
    (tests/worker/attn_reference.py; tested ``==``), four
    query rows at a time where all four see some cell of the tile: their scores share each K
    load, and over the cells all four see, each V load (explicit 16-lane vectors, :mod:`.simd`).
    ``q`` C-contiguous; ``keys`` / ``values`` C-contiguous (every array float32)."""
    T, n_head, dk = q.shape
    n_kv, S_len, dv = values.shape
    grp = n_head // n_kv
    nqb = (T + TILE_Q - 1) // TILE_Q
    v4 = dv % 16 == 0
    # every K tile transposed once per call (kp[g, c0 // TILE_KV - tile0] = the tile at c0), not once per
    # (head, row block): cells outside the given keys are zeros, as fa_tiled_ref packs them; cells
    # after a row block's last query hold their keys here (zeros there), and are masked either way
    tile0 = _first_cell(qpos0, window) // TILE_KV   # the first any query sees
    n_tiles = (qpos0 + T - 1) // TILE_KV + 1 - tile0
    kp = np.empty((n_kv, n_tiles, dk, TILE_KV), np.float32)
    for gi in prange(n_kv * n_tiles):
        gk = gi // n_tiles
        ti = gi % n_tiles
        for tk in range(TILE_KV):
            p = (tile0 + ti) * TILE_KV + tk
            if p >= kpos0 and p - kpos0 < S_len:
                for d in range(dk):
                    kp[gk, ti, d, tk] = keys[gk, p - kpos0, d]
            else:
                for d in range(dk):
                    kp[gk, ti, d, tk] = f32(0.0)
    for item in prange(n_head * nqb):
        h = item // nqb
        t0 = (item % nqb) * TILE_Q
        t1 = min(T, t0 + TILE_Q)
        g = h // grp
        kq4 = np.empty((4, TILE_KV), np.float32)
        va = np.empty(4, np.int64)
        vb = np.empty(4, np.int64)
        vkq = np.zeros((t1 - t0, dv), np.float32)
        M = np.full(t1 - t0, -np.inf, np.float32)
        S = np.zeros(t1 - t0, np.float32)
        qlo = qpos0 + t0
        for c0 in range(_first_cell(qlo, window), qpos0 + t1, TILE_KV):
            kt = kp[g, c0 // TILE_KV - tile0]         # [dk, TILE_KV] the K tile transposed
            r = 0
            while r < t1 - t0:
                n4 = 4 if r + 4 <= t1 - t0 else 1
                for j in range(n4):
                    va[j], vb[j] = _visible(qlo + r + j, window, c0)
                    if va[j] >= vb[j]:
                        n4 = 1
                if n4 == 4:
                    _tile_kq4(kt, q, t0 + r, h, dk, kq4)
                    ja = max(max(va[0], va[1]), max(va[2], va[3]))   # cells all four rows see
                    jb = min(min(vb[0], vb[1]), min(vb[2], vb[3]))
                    for j in range(4):
                        _tile_softmax(kq4[j], c0, va[j], vb[j], scale, softcap, r + j, M, S, vkq)
                    if v4 and ja < jb:
                        for j in range(4):
                            _tile_vkq_row(kq4[j], values, g, c0 - kpos0, va[j] - c0, ja - c0, r + j, vkq)
                        _tile_vkq4(kq4, values, g, c0 - kpos0, ja - c0, jb - c0, r, vkq)
                        for j in range(4):
                            _tile_vkq_row(kq4[j], values, g, c0 - kpos0, jb - c0, vb[j] - c0, r + j, vkq)
                    else:
                        for j in range(4):
                            _tile_vkq_row(kq4[j], values, g, c0 - kpos0, va[j] - c0, vb[j] - c0, r + j, vkq)
                    r += 4
                    continue
                a, b = _visible(qlo + r, window, c0)
                if a < b:
                    kq = kq4[0]
                    _tile_kq_row(kt, q, t0 + r, h, kq)
                    _tile_softmax(kq, c0, a, b, scale, softcap, r, M, S, vkq)
                    _tile_vkq_row(kq, values, g, c0 - kpos0, a - c0, b - c0, r, vkq)
                r += 1
        for r in range(t1 - t0):
            inv = f32(1.0) / S[r] if S[r] != f32(0.0) else f32(0.0)
            for d in range(dv):
                out[t0 + r, h * dv + d] = vkq[r, d] * inv


@njit(cache=True)
def silu_rows(x, out):
    # ggml_vec_swiglu_f32 / ggml_vec_silu_f32 (ggml-cpu vec.cpp, AVX512F+DQ) per row of x f32
    # [T, n]: blocks of 16 by ggml_v_silu (x / (1 + ggml_v_expf(0 - x)), vec.h), the leftover
    # elements by ggml_silu_f32 (x / (1 + expf(-x)), libm expf)
    T, n = x.shape
    one = f32(1.0)
    for t in range(T):
        i = 0
        while i + 15 < n:
            for k in range(i, i + 16):
                v = x[t, k]
                out[t, k] = v / (one + v_expf(f32(0.0) - v))
            i += 16
        for k in range(i, n):
            v = x[t, k]
            out[t, k] = v / (one + _expf(-v))


@njit(cache=True)
def gelu_table_f16(xs, table):
    # ggml_table_gelu_f16 (ggml-cpu.c ggml_cpu_init): for every fp16 value x (xs f32 [65536],
    # the fp16 bit patterns 0..65535 as float32), f16(ggml_gelu_f32(x)) with ggml_gelu_f32 =
    # 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))) as GCC builds it
    # (-ffp-contract=fast: 1.0f + (A*x)*x is one fma) and libm's tanhf; table f32 [65536]
    a = f32(0.044715)
    c = f32(0.79788456080286535587989211986876)
    for i in range(xs.shape[0]):
        x = xs[i]
        inner = fma32(a * x, x, f32(1.0))
        g = (f32(0.5) * x) * (f32(1.0) + f32(math.tanh(c * x * inner)))
        table[i] = f16r(g)


@njit(cache=True)
def _pw_leaf(a, o, n):
    # numpy's pairwise summation of float64 a[o .. o+n-1], n <= 128 (``DOUBLE_pairwise_sum``,
    # numpy/_core/src/umath/loops_utils.h.src: below 8 in order, else 8 accumulators)
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[o + i]
        return res
    r0 = a[o]
    r1 = a[o + 1]
    r2 = a[o + 2]
    r3 = a[o + 3]
    r4 = a[o + 4]
    r5 = a[o + 5]
    r6 = a[o + 6]
    r7 = a[o + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[o + i]
        r1 += a[o + i + 1]
        r2 += a[o + i + 2]
        r3 += a[o + i + 3]
        r4 += a[o + i + 4]
        r5 += a[o + i + 5]
        r6 += a[o + i + 6]
        r7 += a[o + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[o + i]
        i += 1
    return res


@njit(cache=True)
def _pairwise_sum(a, o, n, sn, sv):
    # numpy's pairwise sum of a[o .. o+n-1] for n <= PAIRWISE_MAX (what ``a.sum()`` of a contiguous
    # float64 row adds): up to 128 elements _pw_leaf, above it the pairwise sum of the first half
    # (rounded down to a multiple of 8) plus that of the second. numba's cache cannot hold a
    # recursive function (a cached caller of one crashes on load), so the recursion is a loop over
    # an explicit stack of the nodes under way: sn int64 [>= _PW_DEPTH, 2] (offset, length), sv
    # float64 [>= _PW_DEPTH] (the first half's sum, once done). The same additions of the same
    # operands as numpy's recursion: the same bits.
    sp = 0
    while True:
        while n > 128:                            # down the first halves
            sn[sp, 0] = o
            sn[sp, 1] = n
            sp += 1
            n = n // 2 - (n // 2) % 8
        v = _pw_leaf(a, o, n)
        down = False
        while sp > 0 and not down:                # up to the first node whose second half is left
            po = sn[sp - 1, 0]
            pn = sn[sp - 1, 1]
            n2 = pn // 2 - (pn // 2) % 8
            if o == po:                           # v: its first half's sum; then its second half
                sv[sp - 1] = v
                o = po + n2
                n = pn - n2
                down = True
            else:                                 # v: its second half's sum
                v = sv[sp - 1] + v
                o = po
                sp -= 1
        if not down:
            return v


#: the most nodes :func:`_pairwise_sum` has under way at once (6 for PAIRWISE_MAX elements)
_PW_DEPTH = 8

#: the longest row :func:`_pairwise_sum` sums as numpy does (six levels of halving)
PAIRWISE_MAX = 6144


@njit(cache=True)
def _rms_norm_part(x, w, eps, out, t0, t1):
    # model.rms_norm of float32 rows, the same operations: x f32 [R, n] C; w f32 [n]; eps f32;
    # out f32 [R, n]. Per row: the float32 squares as float64, summed as numpy sums a row
    # (0.0 + the pairwise sum), / n in float64, rounded to float32; scale = 1 / sqrt(mean + eps)
    # in float32; out = (x * scale) * w
    R, n = x.shape
    sq = np.empty(n, np.float64)
    sn = np.empty((_PW_DEPTH, 2), np.int64)
    sv = np.empty(_PW_DEPTH, np.float64)
    one = f32(1.0)
    for r in range(t0, t1):
        for i in range(n):
            v = x[r, i]
            sq[i] = np.float64(v * v)
        mean = f32((0.0 + _pairwise_sum(sq, 0, n, sn, sv)) / np.float64(n))
        scale = one / np.sqrt(mean + eps)
        for i in range(n):
            out[r, i] = (x[r, i] * scale) * w[i]


@njit(cache=True, parallel=True)
def rms_norm_rows(x, w, eps, out):
    # rms_norm_rows: its rows by _rms_norm_part, in parallel over blocks of PAR_ROWS rows from
    # PAR_MIN elements on (each row computed alone: the same bits whatever the split)
    T = x.shape[0]
    if x.size < PAR_MIN:
        _rms_norm_part(x, w, eps, out, 0, T)
        return
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _rms_norm_part(x, w, eps, out, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


@njit(cache=True)
def _geglu_part(gu, n, table, out, t0, t1):
    # model.gelu_tanh_ggml(gu[:, :n]) * gu[:, n:] (ggml_vec_geglu_f32 with GGML_GELU_FP16): the gate
    # rounded to float16 and looked up in ggml's table (0 at <= -10, the gate itself at >= 10),
    # times the up half in float32. gu f32 [T, 2n] C; table f32 [65536]; out f32 [T, n]
    T = gu.shape[0]
    for t in range(t0, t1):
        for j in range(n):
            x = gu[t, j]
            if x <= f32(-10.0):
                y = f32(0.0)
            elif x >= f32(10.0):
                y = x
            else:
                y = table[f16bits(x)]
            out[t, j] = y * gu[t, n + j]


@njit(cache=True, parallel=True)
def geglu_rows(gu, n, table, out):
    # geglu_rows: its rows by _geglu_part, in parallel over blocks of PAR_ROWS rows from
    # PAR_MIN elements on (each row computed alone: the same bits whatever the split)
    T = gu.shape[0]
    if gu.size < PAR_MIN:
        _geglu_part(gu, n, table, out, 0, T)
        return
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _geglu_part(gu, n, table, out, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


@njit(cache=True)
def _swiglu_part(gu, n, out, t0, t1):
    # silu_rows(gu[:, :n]) * gu[:, n:] (ggml_vec_swiglu_f32): each gate by silu_rows' operations
    # (blocks of 16 by ggml_v_silu, the leftovers by libm expf), times the up half in float32.
    # gu f32 [T, 2n] C; out f32 [T, n]
    T = gu.shape[0]
    one = f32(1.0)
    for t in range(t0, t1):
        i = 0
        while i + 15 < n:
            for k in range(i, i + 16):
                v = gu[t, k]
                out[t, k] = (v / (one + v_expf(f32(0.0) - v))) * gu[t, n + k]
            i += 16
        for k in range(i, n):
            v = gu[t, k]
            out[t, k] = (v / (one + _expf(-v))) * gu[t, n + k]


@njit(cache=True, parallel=True)
def swiglu_rows(gu, n, out):
    # swiglu_rows: its rows by _swiglu_part, in parallel over blocks of PAR_ROWS rows from
    # PAR_MIN elements on (each row computed alone: the same bits whatever the split)
    T = gu.shape[0]
    if gu.size < PAR_MIN:
        _swiglu_part(gu, n, out, 0, T)
        return
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _swiglu_part(gu, n, out, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


@njit(cache=True)
def rope_rows(x, pos, cos, sin, n_rot, neox):
    # model.RopeTable._rotate of float32 x [T, H, D] in place (the same operations): pair i of
    # every head is (i, i + n_rot/2) (neox) or (2i, 2i+1); with c, s = cos / sin [pos[t], i]:
    # x0' = f32(f64(x0) * c - f32(x1 * s)), x1' = f32(f64(x0) * s + f32(x1 * c))
    T, H, D = x.shape
    half = n_rot // 2
    for t in range(T):
        p = pos[t]
        for h in range(H):
            for i in range(half):
                i0 = i if neox else 2 * i
                i1 = i + half if neox else 2 * i + 1
                x0 = x[t, h, i0]
                x1 = x[t, h, i1]
                c = cos[p, i]
                s = sin[p, i]
                x[t, h, i0] = f32(np.float64(x0) * np.float64(c) - np.float64(x1 * s))
                x[t, h, i1] = f32(np.float64(x0) * np.float64(s) + np.float64(x1 * c))
