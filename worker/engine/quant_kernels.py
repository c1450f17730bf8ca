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

from .attn_kernels import fma32

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


#: float flags of the lane kernel: contraction to FMA (ggml's _mm256_fmadd_ps, and GCC's
#: -ffp-contract=fast for ``summs += m*s``), no reassociation: the order is the result.
_LANE_MATH = {"contract", "nnan", "ninf", "nsz"}
from .quant import LANE_ROWS  # noqa: E402  (one fact: the lanes form of quant.py)
#: row groups per work item of the lane kernel's parallel loop
_LANE_CHUNK = 4


@njit(parallel=True, fastmath=_LANE_MATH, cache=True)
def matmul_lanes(wi, d, m, has_m, xq3, dx, xs, out):
    # ggml's x86 AVX2 vec_dot of the 32-weight block types (ggml_vec_dot_q4_0_q8_0, _q4_1_q8_1,
    # _q5_0_q8_0, _q5_1_q8_1, _q8_0_q8_0 in ggml-cpu/arch/x86/quants.c; llamafile's
    # tinyBLAS_Q0_AVX, used from two rows on, sums the same way): per output, eight float32
    # lanes, lane l holding elements 4l..4l+3 of every block (maddubs + madd), acc_l =
    # fma(d_w*d_x, isum_l, acc_l) over the blocks in order; then hsum_float_8 ((l, l+4) pairs,
    # then (0,2) + (1,3)) and + summs, the in-order fma sum of m_w * s_x.
    # Layout ("lanes" form of quant.QWeight): block positions in lane order (position 8j+l holds
    # element 4l+j, for weights and activations alike) and 16 output rows interleaved, so the
    # innermost loop runs over 16 rows with contiguous loads (one zmm). isum_l is an integer
    # (|isum| < 2^24) computed exactly, so its own order does not matter.
    # wi int8 [ng, nb, 32, 16]; d, m f32 [ng, nb, 16]; xq3 f32 [T, nb, 32] (lane order);
    # dx, xs f32 [T, nb]; out f32 [T, ng*16].
    ng, nb = wi.shape[0], wi.shape[1]
    T = xq3.shape[0]
    G = LANE_ROWS
    for c in prange((ng + _LANE_CHUNK - 1) // _LANE_CHUNK):
        acc = np.empty((8, G), np.float32)
        summs = np.empty(G, np.float32)
        dd = np.empty(G, np.float32)
        for g in range(c * _LANE_CHUNK, min(ng, c * _LANE_CHUNK + _LANE_CHUNK)):
            for t in range(T):
                acc[:] = 0.0
                summs[:] = 0.0
                for b in range(nb):
                    dxb = dx[t, b]
                    for i in range(G):
                        dd[i] = d[g, b, i] * dxb
                    for l in range(8):
                        x0 = xq3[t, b, l]
                        x1 = xq3[t, b, 8 + l]
                        x2 = xq3[t, b, 16 + l]
                        x3 = xq3[t, b, 24 + l]
                        for i in range(G):
                            p = (f32(wi[g, b, l, i]) * x0 + f32(wi[g, b, 8 + l, i]) * x1
                                 + f32(wi[g, b, 16 + l, i]) * x2 + f32(wi[g, b, 24 + l, i]) * x3)
                            acc[l, i] += dd[i] * p
                    if has_m:
                        xsb = xs[t, b]
                        for i in range(G):
                            summs[i] += m[g, b, i] * xsb
                for i in range(G):
                    out[t, g * G + i] = ((((acc[0, i] + acc[4, i]) + (acc[2, i] + acc[6, i]))
                                          + ((acc[1, i] + acc[5, i]) + (acc[3, i] + acc[7, i]))) + summs[i])


@njit(cache=True)
def cos_sin_f32(ang, cos, sin):
    # cosf / sinf of float32 angles, element by element: numba lowers math.cos of a float32 to
    # the C library's cosf — the very function ggml's rope_yarn calls (glibc's is not correctly
    # rounded: ~1 % of a RoPE table differs from a float64 cos rounded to float32)
    a = ang.reshape(-1)
    c = cos.reshape(-1)
    s = sin.reshape(-1)
    for i in range(a.size):
        c[i] = math.cos(a[i])
        s[i] = math.sin(a[i])


@njit(parallel=True, cache=True)
def matmul_q4k(qs, sc, mn, dw, dmin, xi, dy, bs32, grouped, out):
    # ggml's repacked Q4_K kernels on x86 (ggml-cpu/arch/x86/repack.cpp; llama.cpp repacks every
    # Q4_K matrix whose row count divides by 8 on AVX2 machines). Per output the exact integers
    # of a span, isum = sum_j sc_j * sum_k q4 * q8 and imin = sum_j mn_j * bsum_j, then
    # acc = fma(isum, d_w*d_x, acc), accm = fma(imin, dmin_w*d_x, accm); out = acc - accm.
    # The span is a whole super-block in ggml_gemv_q4_K_8x8_q8_K and a pair of sub-blocks (64
    # elements) in ggml_gemm_q4_K_8x8_q8_K, which llama.cpp runs for the first n - n % 4 rows of
    # each batch (the rest by gemv): ``grouped[t]`` says which one row t is.
    # qs uint8 [O, nsb, 128] (the GGUF's bytes: chunk c of 32 holds sub-block 2c in the low
    # nibbles, 2c+1 in the high ones); sc, mn uint8 [O, nsb, 8]; dw, dmin f32 [O, nsb];
    # xi int8 [T, K]; dy f32 [T, nsb]; bs32 int32 [T, K/32] (sums of q8 per 32); grouped
    # uint8 [T]; out [T, O].
    O, nsb = qs.shape[0], qs.shape[1]
    T = xi.shape[0]
    for rb in prange((O + ROW_BLOCK - 1) // ROW_BLOCK):
        for r in range(rb * ROW_BLOCK, min(O, rb * ROW_BLOCK + ROW_BLOCK)):
            for t in range(T):
                acc = f32(0.0)
                accm = f32(0.0)
                pairs = grouped[t] != 0
                for b in range(nsb):
                    isum = 0
                    imin = 0
                    o = b * 256
                    dd = dw[r, b] * dy[t, b]
                    ddm = dmin[r, b] * dy[t, b]
                    for c in range(4):
                        slo = 0
                        shi = 0
                        for k in range(32):
                            v = np.int32(qs[r, b, c * 32 + k])
                            slo += (v & 15) * np.int32(xi[t, o + c * 64 + k])
                            shi += (v >> 4) * np.int32(xi[t, o + c * 64 + 32 + k])
                        isum += np.int32(sc[r, b, 2 * c]) * slo + np.int32(sc[r, b, 2 * c + 1]) * shi
                        imin += (np.int32(mn[r, b, 2 * c]) * bs32[t, b * 8 + 2 * c]
                                 + np.int32(mn[r, b, 2 * c + 1]) * bs32[t, b * 8 + 2 * c + 1])
                        if pairs:
                            acc = fma32(f32(isum), dd, acc)
                            accm = fma32(f32(imin), ddm, accm)
                            isum = 0
                            imin = 0
                    if not pairs:
                        acc = fma32(f32(isum), dd, acc)
                        accm = fma32(f32(imin), ddm, accm)
                out[t, r] = acc - accm


@njit(parallel=True, cache=True)
def matmul_q6k(q6, sc, dw, xi, dy, bs16, tiled, out):
    # Q6_K as llama.cpp multiplies it on this machine kind (it is not repacked on x86):
    # * rows whose batch has < 8 rows (``tiled[t] == 0``): ggml_vec_dot_q6_K_q8_K, x86 AVX2
    #   (ggml-cpu/arch/x86/quants.c): per super-block eight int32 lanes, lane l = sum over the
    #   elements e with e % 32 in [4l, 4l+4) of sc[e/16] * q6[e] * q8[e] (q6 unsigned, 0..63),
    #   minus 32 * (bsum16[2l] * sc[2l] + bsum16[2l+1] * sc[2l+1]); acc_l = fma(d_x*d_w,
    #   lane_l, acc_l) over the super-blocks; then hsum_float_8;
    # * the others: the tiled kernel's AVX512-VNNI microkernel (ggml-cpu/tiled/tiled-kernel.cpp
    #   ``tiled_run_micro_vnni_8x16``): per super-block the exact integer isum = sum sc * (q6 -
    #   32) * q8, out = fma(f32(isum) * d_w, d_x, out) (GCC contracts the epilogue's add of a
    #   product into an FMA), super-blocks in order.
    # q6 uint8 [O, nsb, 256]; sc int8 [O, nsb, 16]; dw f32 [O, nsb]; xi int8 [T, K]; dy f32
    # [T, nsb]; bs16 int32 [T, K/16]; tiled uint8 [T]; out [T, O].
    O, nsb = q6.shape[0], q6.shape[1]
    T = xi.shape[0]
    for rb in prange((O + ROW_BLOCK - 1) // ROW_BLOCK):
        lanes = np.empty(8, np.int32)
        acc = np.empty(8, np.float32)
        for r in range(rb * ROW_BLOCK, min(O, rb * ROW_BLOCK + ROW_BLOCK)):
            for t in range(T):
                acc[:] = 0.0
                tot = f32(0.0)
                for b in range(nsb):
                    o = b * 256
                    for l in range(8):
                        lanes[l] = 0
                    for v in range(8):
                        for l in range(8):
                            s = 0
                            for k in range(4):
                                e = v * 32 + 4 * l + k
                                s += np.int32(q6[r, b, e]) * np.int32(xi[t, o + e])
                            lanes[l] += np.int32(sc[r, b, 2 * v + (l >> 2)]) * s
                    for l in range(8):
                        lanes[l] -= 32 * (bs16[t, b * 16 + 2 * l] * np.int32(sc[r, b, 2 * l])
                                          + bs16[t, b * 16 + 2 * l + 1] * np.int32(sc[r, b, 2 * l + 1]))
                    if tiled[t] != 0:
                        isum = 0
                        for l in range(8):
                            isum += lanes[l]
                        tot = fma32(f32(isum) * dw[r, b], dy[t, b], tot)
                    else:
                        d = dy[t, b] * dw[r, b]
                        for l in range(8):
                            acc[l] = fma32(d, f32(lanes[l]), acc[l])
                if tiled[t] != 0:
                    out[t, r] = tot
                else:
                    out[t, r] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
