"""numba kernels of :mod:`worker.engine.quant` (imported on first use: numba takes ~0.4 s to import).

Module-level functions so that numba's on-disk cache (``cache=True``) finds them again in
the next process; see :mod:`.quant` for what they compute and the ggml sources they follow.
Shapes: weights q3 int8 ``[O, nb, B]``, d/m float32 ``[O, nb]``; activations float32
``[T, K]`` (``xf3`` viewed ``[T, nb, B]``), xs float32 ``[T, K/32]``; out float32 ``[T, O]``.
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
def quant_q8_0(x, xf, xs, with_s, fp16_s):
    # x f32 [T, K] -> xf f32 [T, K] = q * d (q int, d fp16); xs f32 [T, K/32] = s (Q8_1) when with_s
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
            d16 = f16_round(d)
            isum = 0
            for j in range(32):
                qv = np.rint(x[t, o + j] * idv)
                isum += int(qv)
                xf[t, o + j] = f32(qv) * d16
            if with_s:
                s = d * f32(isum)
                xs[t, b] = f16_round(s) if fp16_s else s


@njit(cache=True)
def quant_q8_K(x, xf, xs):
    # quantize_row_q8_K_ref: per 256, max = the value of largest |x|; xs per 32 = d * sum(q)
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
                    xf[t, o + j] = f32(0.0)
                for j in range(8):
                    xs[t, sb * 8 + j] = f32(0.0)
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
                    xf[t, o + g * 32 + j] = f32(v) * d
                xs[t, sb * 8 + g] = d * f32(isum)


@njit(parallel=True, fastmath=True, cache=True)
def matmul_q(q3, d, m, has_m, xf3, xs, out):
    # out[t, r] = sum_b d[r,b] * sum_j q3[r,b,j] * xf3[t,b,j]  (+ m[r,b] * xs[t,b])
    O, nb, B = q3.shape
    T = xf3.shape[0]
    for r in prange(O):
        t = 0
        while t + 4 <= T:
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
                    s0 += w * xf3[t, b, j]
                    s1 += w * xf3[t + 1, b, j]
                    s2 += w * xf3[t + 2, b, j]
                    s3 += w * xf3[t + 3, b, j]
                db = d[r, b]
                a0 += db * s0
                a1 += db * s1
                a2 += db * s2
                a3 += db * s3
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
            acc = f32(0.0)
            for b in range(nb):
                s = f32(0.0)
                for j in range(B):
                    s += f32(q3[r, b, j]) * xf3[t, b, j]
                acc += d[r, b] * s
                if has_m:
                    acc += m[r, b] * xs[t, b]
            out[t, r] = acc
            t += 1


@njit(fastmath=True, cache=True)
def dequant(q3, d, m, has_m, r0, out):
    # out [n, nb*B] = d * q (+ m) of rows r0 .. r0+n-1
    n = out.shape[0]
    nb, B = q3.shape[1], q3.shape[2]
    for i in range(n):  # serial: the sgemm that follows has the cores (no two thread pools spinning)
        r = r0 + i
        for b in range(nb):
            db = d[r, b]
            mb = m[r, b] if has_m else f32(0.0)
            for j in range(B):
                out[i, b * B + j] = db * f32(q3[r, b, j]) + mb
