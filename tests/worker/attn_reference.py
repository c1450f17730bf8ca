"""The scalar references of :mod:`worker.engine.kernels.attn_kernels`' flash-attention kernels: test
oracles (and ``scripts/bench_attention.py``'s baseline), not used by the engine.

``fa_vec_ref`` computes MODE_VEC / MODE_SPLIT one (query row, head) at a time in plain scalar
code, ``fa_tiled_ref`` MODE_TILED one query row at a time: the forms the llama.cpp fixture
(``tests/fixtures/flash-attn.llamacpp.json``) was first matched with. ``attn_kernels.fa_vec`` and
``attn_kernels.fa_tiled`` must give their bits (``test_attn_kernels``). They are written apart
from the kernels on purpose (the loops the kernels run on vectors are spelled out here); they
share with them only the scalar steps defined once in attn_kernels (f16 rounding, FMA, ``expf``,
ggml's lane sum, the online-softmax step, the chunk merge; the tiled path's visible cells and
one-row scores, softmax step and V sum): what they check is the kernels' work split and vector code. Arrays and
arguments as attn_kernels' module docstring gives them.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from worker.engine.kernels.attn_kernels import (
    MODE_SPLIT,
    TILE_KV,
    TILE_Q,
    _first_cell,
    _merge_chunk,
    _online_step,
    _sum16,
    _tile_kq_row,
    _tile_softmax,
    _tile_vkq_row,
    _visible,
    f16r,
    f32,
    fma32,
)


@njit(cache=True, inline="always")
def dot_f16(keys, g, i, y, acc):
    """``ggml_vec_dot_f16`` (AVX-512F, no FP16) of key ``keys[g, i]`` and the f16-valued ``y``:
    per 64 elements 4 x 16 FMA lanes, ``GGML_F32x16_REDUCE``, the leftovers summed in double;
    ``acc`` a float32 scratch of 64."""
    n = y.shape[0]
    np_ = n & ~63
    sumf = 0.0
    if np_ > 0:
        for t in range(64):
            acc[t] = keys[g, i, t] * y[t]             # fma(x, y, 0): the product, exact for f16 inputs
        for st in range(1, np_ // 64):            # (a stepped range does not vectorize in numba)
            j = st * 64
            for t in range(64):
                acc[t] = fma32(keys[g, i, j + t], y[j + t], acc[t])
        for t in range(16):                       # x0+x2, x1+x3, then x0+x1
            acc[t] = (acc[t] + acc[32 + t]) + (acc[16 + t] + acc[48 + t])
        sumf = np.float64(_sum16(acc, 0))
    for j in range(np_, n):
        sumf += np.float64(keys[g, i, j] * y[j])
    return f32(sumf)


@njit(cache=True)
def _vec_chunk(q16, keys, values, g, i0, i1, scale, softcap, vkq, dacc, sbuf):
    # one_chunk over key indices i0 .. i1-1 (all visible): vkq f16-valued [DV] (reset here); -> (M, S).
    # The scores do not depend on the softmax state: all computed first (sbuf), then the online softmax.
    dv = vkq.shape[0]
    for i in range(i0, i1):
        s = dot_f16(keys, g, i, q16, dacc) * scale
        if softcap != f32(0.0):
            s = softcap * f32(math.tanh(s))
        sbuf[i - i0] = s
    for d in range(dv):
        vkq[d] = f32(0.0)
    S = f32(0.0)
    M = f32(-np.inf)
    for i in range(i0, i1):
        M, ms, vs, new_max = _online_step(sbuf[i - i0], M)
        if new_max:
            for d in range(dv):
                vkq[d] = f16r(vkq[d] * ms)
        for d in range(dv):
            vkq[d] = f16r(fma32(values[g, i, d], vs, vkq[d]))
        S = fma32(S, ms, vs)
    return M, S


@njit(cache=True)
def _vec_rowhead(q, keys, values, t, h, g, qpos0, kpos0, window, scale, softcap, mode, n_cells, n_chunks, out):
    dk = q.shape[2]
    dv = values.shape[2]
    q16 = np.empty(dk, np.float32)
    for d in range(dk):
        q16[d] = f16r(q[t, h, d])
    vkq = np.empty(dv, np.float32)
    dacc = np.empty(64, np.float32)
    qp = qpos0 + t
    sbuf = np.empty(qp + 1, np.float32)
    lo = 0 if window == 0 else max(0, qp - window + 1)   # visible positions lo .. qp
    o0 = h * dv
    if mode == MODE_SPLIT:
        cs = (n_cells + n_chunks - 1) // n_chunks
        mf = f32(-np.inf)
        sf = f32(0.0)
        acc = np.zeros(dv, np.float32)
        for c in range(n_chunks):
            a = max(c * cs, lo)
            b = min((c + 1) * cs, n_cells, qp + 1)
            if a >= b:
                continue
            mc, sc = _vec_chunk(q16, keys, values, g, a - kpos0, b - kpos0, scale, softcap, vkq, dacc, sbuf)
            if sc == f32(0.0):
                continue
            mf, sf = _merge_chunk(acc, vkq, 0, mf, sf, mc, sc)
        inv = f32(1.0) / sf if sf != f32(0.0) else f32(0.0)
        for d in range(dv):
            out[t, o0 + d] = acc[d] * inv
    else:
        mc, sc = _vec_chunk(q16, keys, values, g, lo - kpos0, qp + 1 - kpos0, scale, softcap, vkq, dacc, sbuf)
        inv = f32(1.0) / sc if sc != f32(0.0) else f32(0.0)
        for d in range(dv):
            out[t, o0 + d] = vkq[d] * inv


@njit(cache=True, parallel=True)
def fa_vec_ref(q, keys, values, qpos0, kpos0, window, scale, softcap, mode, n_cells, n_chunks, out):
    """The reference of :func:`fa_vec` (one (row, head) at a time, scalar code; the same bits,
    tested ``==``): MODE_VEC / MODE_SPLIT over every (row, head) of ``q``, the form the llama.cpp
    fixture was first matched with."""
    T, n_head, dk = q.shape
    grp = n_head // values.shape[0]
    for item in prange(T * n_head):
        t = item // n_head
        h = item % n_head
        _vec_rowhead(q, keys, values, t, h, h // grp, qpos0, kpos0, window, scale, softcap, mode, n_cells,
                     n_chunks, out)


@njit(cache=True, parallel=True)
def fa_tiled_ref(q, keys, values, qpos0, kpos0, window, scale, softcap, out):
    """The reference of :func:`fa_tiled` (one query row at a time; the same bits, tested ``==``):
    MODE_TILED over every (row, head) of ``q``. Work items are (head, block of TILE_Q rows):
    the K tile is packed transposed once per block."""
    T, n_head, dk = q.shape
    n_kv, S_len, dv = values.shape
    grp = n_head // n_kv
    nqb = (T + TILE_Q - 1) // TILE_Q
    for item in prange(n_head * nqb):
        h = item // nqb
        t0 = (item % nqb) * TILE_Q
        t1 = min(T, t0 + TILE_Q)
        g = h // grp
        kt = np.empty((dk, TILE_KV), np.float32)      # K tile transposed
        kq = np.empty(TILE_KV, np.float32)
        vkq = np.zeros((t1 - t0, dv), np.float32)
        M = np.full(t1 - t0, -np.inf, np.float32)
        S = np.zeros(t1 - t0, np.float32)
        qlo = qpos0 + t0
        qhi = qpos0 + t1 - 1
        for c0 in range(_first_cell(qlo, window), qhi + 1, TILE_KV):
            for tk in range(TILE_KV):
                p = c0 + tk
                if p >= kpos0 and p <= qhi:
                    for d in range(dk):
                        kt[d, tk] = keys[g, p - kpos0, d]
                else:
                    for d in range(dk):
                        kt[d, tk] = f32(0.0)
            for r in range(t1 - t0):
                a, b = _visible(qlo + r, window, c0)
                if a >= b:
                    continue
                _tile_kq_row(kt, q, t0 + r, h, kq)
                _tile_softmax(kq, c0, a, b, scale, softcap, r, M, S, vkq)
                _tile_vkq_row(kq, values, g, c0 - kpos0, a - c0, b - c0, r, vkq)
        for r in range(t1 - t0):
            inv = f32(1.0) / S[r] if S[r] != f32(0.0) else f32(0.0)
            for d in range(dv):
                out[t0 + r, h * dv + d] = vkq[r, d] * inv
