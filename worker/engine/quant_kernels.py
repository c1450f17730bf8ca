"""numba kernels of :mod:`worker.engine.quant` (imported on first use: numba takes ~0.4 s to import).

Module-level functions so that numba's on-disk cache (``cache=True``) finds them again in
the next process; see :mod:`.quant` for what they compute and the ggml sources they follow.
Shapes: weights q3 int8 ``[O, nb, B]``, d/m float32 ``[O, nb]``; activations: integer levels
xq float32 ``[T, K]`` (``xq3`` viewed ``[T, nb, B]``), scales dx and sums xs float32 ``[T, K/32]``;
out float32 ``[T, O]``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

f32 = numba.float32


@njit(cache=True)
def f16_round(v):
    # IEEE binary16 round-to-nearest-even of a float32 (ggml's GGML_FP32_TO_FP16), as float32
    a = abs(v)
    if a == 0.0 or a >= 65520.0:
        return v if a < 65520.0 else np.float32(math.copysign(np.inf, v))
    if a < 6.103515625e-05:                       # fp16 subnormal: steps of 2^-24
        return np.float32(np.rint(np.float64(v) * 16777216.0) / 16777216.0)
    _, e = math.frexp(a)                          # a = f * 2^e, f in [0.5, 1)
    step = math.ldexp(1.0, e - 11)                # 11 significant bits
    return np.float32(np.rint(np.float64(v) / step) * step)


@njit(cache=True)
def quant_q8_0(x, xq, dx, xs, with_s, fp16_s):
    # x f32 [T, K] -> xq f32 [T, K] integer levels q; dx f32 [T, K/32] = d (fp16-rounded);
    # xs f32 [T, K/32] = s = d * sum(q) (fp16 for Q8_1) when with_s
    T, K = x.shape
    for t in range(T):
        for b in range(K // 32):
            o = b * 32
            amax = f32(0.0)
            for j in range(32):
                a = abs(x[t, o + j])
                if a > amax:
                    amax = a
            d = amax / f32(127.0)
            idv = f32(127.0) / amax if amax != 0.0 else f32(0.0)
            isum = 0
            for j in range(32):
                qv = np.rint(x[t, o + j] * idv)
                isum += int(qv)
                xq[t, o + j] = f32(qv)
            dx[t, b] = f16_round(d)
            if with_s:
                s = d * f32(isum)
                xs[t, b] = f16_round(s) if fp16_s else s


@njit(cache=True)
def quant_q8_K(x, xq, dx, xs):
    # quantize_row_q8_K_ref: per 256, max = the value of largest |x|; dx per 32 = the
    # super-block's d (repeated), xs per 32 = d * sum(q)
    T, K = x.shape
    for t in range(T):
        for sb in range(K // 256):
            o = sb * 256
            amax = f32(0.0)
            mx = f32(0.0)
            for j in range(256):
                a = abs(x[t, o + j])
                if a > amax:
                    amax = a
                    mx = x[t, o + j]
            if amax == 0.0:
                for j in range(256):
                    xq[t, o + j] = f32(0.0)
                for j in range(8):
                    xs[t, sb * 8 + j] = f32(0.0)
                    dx[t, sb * 8 + j] = f32(0.0)
                continue
            iscale = f32(-127.0) / mx
            d = f32(1.0) / iscale
            for g in range(8):
                isum = 0
                for j in range(32):
                    v = np.rint(iscale * x[t, o + g * 32 + j])
                    if v > 127.0:
                        v = 127.0
                    isum += int(v)
                    xq[t, o + g * 32 + j] = f32(v)
                xs[t, sb * 8 + g] = d * f32(isum)
                dx[t, sb * 8 + g] = d


#: output rows per work item of the parallel loop (the item's weights stay in L1/L2 while
#: every activation tile passes over them)
ROW_BLOCK = 16


@njit(parallel=True, fastmath=True, cache=True)
def matmul_q(q3, d, m, has_m, xq3, dx, xs, out):
    # out[t, r] = sum_b (d[r,b] * dx[t,b']) * isum(r, b, t)  (+ m[r,b] * xs[t,b]),  b' = b*B/32,
    # isum = sum_j q3[r,b,j] * xq3[t,b,j]: integers held in float32, exact (|isum| < 2^24), so
    # the order the vectorized j loop sums in cannot change it; the blocks are accumulated in
    # order b = 0, 1, .. with the same operations for every row t, whichever tile (4 rows or
    # the 1-row tail) it falls in: a row's result does not depend on T or on the other rows.
    O, nb, B = q3.shape
    T = xq3.shape[0]
    sh = 1 if B == 16 else 0
    for rb in prange((O + ROW_BLOCK - 1) // ROW_BLOCK):
        r1 = min(O, rb * ROW_BLOCK + ROW_BLOCK)
        t = 0
        while t + 4 <= T:
            for r in range(rb * ROW_BLOCK, r1):
                a0 = f32(0.0)
                a1 = f32(0.0)
                a2 = f32(0.0)
                a3 = f32(0.0)
                for b in range(nb):
                    s0 = f32(0.0)
                    s1 = f32(0.0)
                    s2 = f32(0.0)
                    s3 = f32(0.0)
                    for j in range(B):
                        w = f32(q3[r, b, j])
                        s0 += w * xq3[t, b, j]
                        s1 += w * xq3[t + 1, b, j]
                        s2 += w * xq3[t + 2, b, j]
                        s3 += w * xq3[t + 3, b, j]
                    db = d[r, b]
                    bx = b >> sh
                    a0 += (db * dx[t, bx]) * s0
                    a1 += (db * dx[t + 1, bx]) * s1
                    a2 += (db * dx[t + 2, bx]) * s2
                    a3 += (db * dx[t + 3, bx]) * s3
                    if has_m:
                        mb = m[r, b]
                        a0 += mb * xs[t, b]
                        a1 += mb * xs[t + 1, b]
                        a2 += mb * xs[t + 2, b]
                        a3 += mb * xs[t + 3, b]
                out[t, r] = a0
                out[t + 1, r] = a1
                out[t + 2, r] = a2
                out[t + 3, r] = a3
            t += 4
        while t < T:
            for r in range(rb * ROW_BLOCK, r1):
                acc = f32(0.0)
                for b in range(nb):
                    s = f32(0.0)
                    for j in range(B):
                        s += f32(q3[r, b, j]) * xq3[t, b, j]
                    acc += (d[r, b] * dx[t, b >> sh]) * s
                    if has_m:
                        acc += m[r, b] * xs[t, b]
                out[t, r] = acc
            t += 1


@njit(parallel=True, fastmath=True, cache=True)
def matmul_qp(qs, bias, d, m, has_m, xq3, dx, xs, out):
    # 4-bit weights packed as the GGUF stores them: qs uint8 [O, nb, H=16] (byte j: element j in
    # the low nibble, element j+16 in the high one); level = nibble - bias. Same sums and
    # accumulation order as matmul_q (exact block sums, blocks in order, the same operations for
    # every row). The loops run to H read from the shape (not a constant 16): a constant trip
    # count lets LLVM unroll them and vectorize the block loop instead, reordering the blocks.
    O, nb, H = qs.shape
    T = xq3.shape[0]
    fb = f32(bias)
    for rb in prange((O + ROW_BLOCK - 1) // ROW_BLOCK):
        r1 = min(O, rb * ROW_BLOCK + ROW_BLOCK)
        t = 0
        while t + 4 <= T:
            for r in range(rb * ROW_BLOCK, r1):
                a0 = f32(0.0)
                a1 = f32(0.0)
                a2 = f32(0.0)
                a3 = f32(0.0)
                for b in range(nb):
                    s0 = f32(0.0)
                    s1 = f32(0.0)
                    s2 = f32(0.0)
                    s3 = f32(0.0)
                    for j in range(H):
                        v = np.int32(qs[r, b, j])
                        wl = f32(v & 15) - fb
                        wh = f32(v >> 4) - fb
                        s0 += wl * xq3[t, b, j] + wh * xq3[t, b, j + H]
                        s1 += wl * xq3[t + 1, b, j] + wh * xq3[t + 1, b, j + H]
                        s2 += wl * xq3[t + 2, b, j] + wh * xq3[t + 2, b, j + H]
                        s3 += wl * xq3[t + 3, b, j] + wh * xq3[t + 3, b, j + H]
                    db = d[r, b]
                    a0 += (db * dx[t, b]) * s0
                    a1 += (db * dx[t + 1, b]) * s1
                    a2 += (db * dx[t + 2, b]) * s2
                    a3 += (db * dx[t + 3, b]) * s3
                    if has_m:
                        mb = m[r, b]
                        a0 += mb * xs[t, b]
                        a1 += mb * xs[t + 1, b]
                        a2 += mb * xs[t + 2, b]
                        a3 += mb * xs[t + 3, b]
                out[t, r] = a0
                out[t + 1, r] = a1
                out[t + 2, r] = a2
                out[t + 3, r] = a3
            t += 4
        while t < T:
            for r in range(rb * ROW_BLOCK, r1):
                acc = f32(0.0)
                for b in range(nb):
                    s = f32(0.0)
                    for j in range(H):
                        v = np.int32(qs[r, b, j])
                        s += (f32(v & 15) - fb) * xq3[t, b, j] + (f32(v >> 4) - fb) * xq3[t, b, j + H]
                    acc += (d[r, b] * dx[t, b]) * s
                    if has_m:
                        acc += m[r, b] * xs[t, b]
                out[t, r] = acc
            t += 1
