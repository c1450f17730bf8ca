"""numba kernels of :mod:`worker.engine.kernels.quant` (imported on first use: numba takes ~0.4 s to import).

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
from numba.np.ufunc.parallel import _iget_num_threads  # numba's get_num_threads by symbol (cacheable)

from .attn_kernels import PAR_MIN, PAR_ROWS, f16r, fma32

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
def _quant_q8_0_part(x, xq, dx, xs, with_s, fp16_s, t0, t1):
    # x f32 [T, K] -> xq f32 [T, K] integer levels q; dx f32 [T, K/32] = d (fp16-rounded);
    # xs f32 [T, K/32] = s = d * sum(q) (fp16 for Q8_1) when with_s
    # amax = the largest |x| of the block (NaN skipped, as ``if a > amax`` skips it), found by an
    # integer max over the bits (the same value; LLVM vectorizes it, a float max it does not)
    T, K = x.shape
    xb = x.view(np.int32)
    bits = np.empty(1, np.int32)
    fbits = bits.view(np.float32)
    for t in range(t0, t1):
        for b in range(K // 32):
            o = b * 32
            mb = 0
            for j in range(32):
                v = xb[t, o + j] & 0x7FFFFFFF
                if v > 0x7F800000:
                    v = 0
                mb = max(mb, v)
            bits[0] = mb
            amax = fbits[0]
            d = amax / f32(127.0)
            idv = f32(127.0) / amax if amax != 0.0 else f32(0.0)
            isum = np.int32(0)
            for j in range(32):
                qv = np.rint(x[t, o + j] * idv)
                isum += np.int32(qv)
                xq[t, o + j] = qv
            dx[t, b] = f16r(d)                    # = f16_round (both: binary16 ties to even), in one instruction
            if with_s:
                s = d * f32(isum)
                xs[t, b] = f16r(s) if fp16_s else s


@njit(cache=True, parallel=True)
def quant_q8_0(x, xq, dx, xs, with_s, fp16_s):
    # quant_q8_0: its rows by _quant_q8_0_part, in parallel over blocks of PAR_ROWS rows from
    # PAR_MIN elements on (each row computed alone: the same bits whatever the split)
    T = x.shape[0]
    if x.size < PAR_MIN:
        _quant_q8_0_part(x, xq, dx, xs, with_s, fp16_s, 0, T)
        return
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _quant_q8_0_part(x, xq, dx, xs, with_s, fp16_s, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


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


@njit(cache=True)
def _quant_q8_K_int_part(x, xb, xi, dy, bs16, t0, t1):
    # quant_q8_K's levels as int8, in a form LLVM vectorizes: x f32 [T, K] (xb: its bits, int32
    # [T, K]) -> xi int8 [T, K] (the levels), dy f32 [T, K/256] (the super-block's d), bs16 int32
    # [T, K/16] (sums of the levels per 16). The same values: the largest |x| by its bits (NaN
    # skipped, as quant_q8_K's ``a > amax`` skips it), its first occurrence's sign, then the
    # same float32 operations per level.
    T, K = x.shape
    for t in range(t0, t1):
        for sb in range(K // 256):
            o = sb * 256
            mb = 0
            for j in range(256):
                b = xb[t, o + j] & 0x7FFFFFFF
                if b > 0x7F800000:
                    b = 0
                mb = max(mb, b)
            if mb == 0:
                for j in range(256):
                    xi[t, o + j] = 0
                for j in range(16):
                    bs16[t, sb * 16 + j] = 0
                dy[t, sb] = f32(0.0)
                continue
            mx = f32(0.0)
            for j in range(256):
                if xb[t, o + j] & 0x7FFFFFFF == mb:
                    mx = x[t, o + j]
                    break
            iscale = f32(-127.0) / mx
            dy[t, sb] = f32(1.0) / iscale
            for g in range(16):
                isum = np.int32(0)
                for j in range(16):
                    v = np.rint(iscale * x[t, o + g * 16 + j])
                    if v > f32(127.0):
                        v = f32(127.0)
                    iv = np.int32(v)
                    isum += iv
                    xi[t, o + g * 16 + j] = np.int8(iv)
                bs16[t, sb * 16 + g] = isum


@njit(cache=True, parallel=True)
def quant_q8_K_int(x, xb, xi, dy, bs16):
    # quant_q8_K_int: its rows by _quant_q8_K_int_part, in parallel over blocks of PAR_ROWS rows from
    # PAR_MIN elements on (each row computed alone: the same bits whatever the split)
    T = x.shape[0]
    if x.size < PAR_MIN:
        _quant_q8_K_int_part(x, xb, xi, dy, bs16, 0, T)
        return
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _quant_q8_K_int_part(x, xb, xi, dy, bs16, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


#: output rows per work item of the parallel loop (the item's weights stay in L1/L2 while
#: every activation tile passes over them)
ROW_BLOCK = 16


#: float flags of the lane kernel: contraction to FMA (ggml's _mm256_fmadd_ps, and GCC's
#: -ffp-contract=fast for ``summs += m*s``), no reassociation: the order is the result.
_LANE_MATH = {"contract", "nnan", "ninf", "nsz"}
from .quant import LANE_ROWS  # noqa: E402  (one fact: the lanes form of quant.py)
#: row groups per work item of the lane kernel's parallel loop
_LANE_CHUNK = 4
#: how far ahead (bytes of a row group's weights) the Q6_K and 32-block kernels' decode rows
#: prefetch into L2 (simd.prefetch; the scales as many blocks ahead): Q6_K's two interleaved
#: runs of levels are not followed by the hardware prefetcher, and the 32-block kernels gained
#: too; the Q4_K kernel did not (docs/engine.md, "VNNI kernels"). 8-32 KiB measured alike.
_PF_BYTES = 16384


@njit(cache=True)
def _workers(n_items):
    # iterations of a parallel loop whose threads take its n_items work items as they come
    # (simd.claim): one per thread, at most one per item. numba splits a prange's iterations
    # evenly over its threads beforehand; taken this way, a thread that another process keeps
    # off its core holds at most the item it took, the others do the rest. Each item is
    # computed whole by one thread in one order: the bits do not depend on which.
    # (numba.get_num_threads() itself holds a ctypes pointer: a kernel calling it is not cached)
    return min(_iget_num_threads(), n_items)


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


# ------------------------------------------------------------------ AVX512-VNNI kernels
# The same float32 operations as the kernels above, in the same order, with the exact integer
# parts done by vpdpbusd on explicit 16-lane vectors (:mod:`.simd`); tested equal (==) to them.

from .simd import ISA, addw, claim, dpbusd_s, maddubs, maddw_s, prefetch, q6_level  # noqa: E402
from .simd import (dpbusd, i2f, iadd, ibcast4, iload16_s8, iload16_u8, iload64, imul, isplat,  # noqa: E402
                   isub, izero, nib_hi, nib_lo, vadd, vfma, vfma_s, vload, vload_h, vmul, vmul_s, vstore, vstore_row,
                   vsub, vzero)


@njit(cache=True)
def _lane_levels_part(xq, bias, x8, nxc, t0, t1):
    # the VNNI lanes kernel's activations: x8 int8 [T, K] = the levels xq (float32 [T, K]);
    # nxc int32 [T, K/4] = -bias * the sum of each 4 consecutive levels (one int32 lane's)
    T, K = xq.shape
    for t in range(t0, t1):
        for j in range(K // 4):
            s = 0
            for k in range(4):
                v = np.int32(xq[t, 4 * j + k])
                x8[t, 4 * j + k] = np.int8(v)
                s += v
            nxc[t, j] = -bias * s


@njit(cache=True, parallel=True)
def lane_levels(xq, bias, x8, nxc):
    # lane_levels: its rows by _lane_levels_part, in parallel over blocks of PAR_ROWS rows from
    # PAR_MIN elements on (each row computed alone: the same bits whatever the split)
    T = xq.shape[0]
    if xq.size < PAR_MIN:
        _lane_levels_part(xq, bias, x8, nxc, 0, T)
        return
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _lane_levels_part(xq, bias, x8, nxc, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


@njit(cache=True)
def _vl(packed, acc, dd, wv, x8, xo, c):
    # one lane update of matmul_lanes for 16 rows: acc = fma(d_w*d_x, isum_l, acc), isum_l =
    # sum_k (w+bias)*x - bias*sum_k x (c = -bias*sum_k x: the dpbusd's start), exact in int32
    # (packed nibbles: their pair products fit int16, the short form on AVX2)
    if packed:
        return vfma(dd, i2f(dpbusd_s(isplat(c), wv, ibcast4(x8, xo))), acc)
    return vfma(dd, i2f(dpbusd(isplat(c), wv, ibcast4(x8, xo))), acc)


@njit(cache=True)
def _vl_half(w, o, packed, h):
    # lanes 4h..4h+3 of one block of a row group (see _vl_group), as u8 bytes in int32 lanes
    if packed:
        if h == 0:
            return nib_lo(iload64(w, o)), nib_lo(iload64(w, o + 64)), nib_lo(iload64(w, o + 128)), nib_lo(iload64(w, o + 192))
        return nib_hi(iload64(w, o)), nib_hi(iload64(w, o + 64)), nib_hi(iload64(w, o + 128)), nib_hi(iload64(w, o + 192))
    o += 256 * h
    return iload64(w, o), iload64(w, o + 64), iload64(w, o + 128), iload64(w, o + 192)


@njit(cache=True)
def _vl_prefetch(w, d, m, has_m, blk, wb):
    # the cache lines _PF_BYTES ahead of block blk (wb bytes of weights, 32 of d / m) of a VNNI
    # lanes form
    o = blk * wb + _PF_BYTES
    for k in range(wb // 64):
        prefetch(w, o + 64 * k)
    prefetch(d, blk * 32 + _PF_BYTES * 32 // wb)
    if has_m:
        prefetch(m, blk * 32 + _PF_BYTES * 32 // wb)


@njit(cache=True)
def _vl_group(w, g, packed, d, m, x8, nxc, dx, xs, dst, col, scr):
    # dst[t, col:col+16] = matmul_lanes' outputs of row group g for every row t (the same float32
    # operations in the same order). Weights w uint8: unpacked [ng, nb, 8, 16, 4] (byte (l, i, k)
    # of block b = level + 128 of row 16g+i, element 4l+k), or packed [ng, nb, 4, 16, 4] (low
    # nibble: lane l, high nibble: lane l+4; the stored 4-bit value, level + 8 for Q4_0, the level
    # for Q4_1); d, m uint16 [ng, nb, 16] (the GGUF's fp16 bits, widened by vload_h; m [0, 0, 0]: no offset); x8 int8 [T, K]; nxc int32
    # [T, nb, 8] = -bias * the sum of lane l's four activation levels (zeros for bias 0); dx, xs
    # f32 [T, nb]; scr f32 [>= 256] scratch. Four activation rows per pass share each weight load,
    # lanes 0-3 of all blocks first, then lanes 4-7 (each lane's own block order is kept); the
    # last T % 4 rows go one at a time.
    T, K = x8.shape
    nb = K // 32
    wb = 256 if packed else 512
    has_m = m.shape[0] != 0
    t = 0
    while t + 4 <= T:
        for h in range(2):
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            b0 = vzero()
            b1 = vzero()
            b2 = vzero()
            b3 = vzero()
            c0 = vzero()
            c1 = vzero()
            c2 = vzero()
            c3 = vzero()
            e0 = vzero()
            e1 = vzero()
            e2 = vzero()
            e3 = vzero()
            for b in range(nb):
                if h == 0 and t == 0:       # the first pass streams the group's weights
                    _vl_prefetch(w, d, m, has_m, g * nb + b, wb)
                w0, w1, w2, w3 = _vl_half(w, (g * nb + b) * wb, packed, h)
                dw = vload_h(d, (g * nb + b) * 16)
                l0 = 4 * h
                xo = t * K + b * 32 + 16 * h
                dd = vmul_s(dw, dx[t, b])
                a0 = _vl(packed, a0, dd, w0, x8, xo, nxc[t, b, l0])
                a1 = _vl(packed, a1, dd, w1, x8, xo + 4, nxc[t, b, l0 + 1])
                a2 = _vl(packed, a2, dd, w2, x8, xo + 8, nxc[t, b, l0 + 2])
                a3 = _vl(packed, a3, dd, w3, x8, xo + 12, nxc[t, b, l0 + 3])
                xo += K
                dd = vmul_s(dw, dx[t + 1, b])
                b0 = _vl(packed, b0, dd, w0, x8, xo, nxc[t + 1, b, l0])
                b1 = _vl(packed, b1, dd, w1, x8, xo + 4, nxc[t + 1, b, l0 + 1])
                b2 = _vl(packed, b2, dd, w2, x8, xo + 8, nxc[t + 1, b, l0 + 2])
                b3 = _vl(packed, b3, dd, w3, x8, xo + 12, nxc[t + 1, b, l0 + 3])
                xo += K
                dd = vmul_s(dw, dx[t + 2, b])
                c0 = _vl(packed, c0, dd, w0, x8, xo, nxc[t + 2, b, l0])
                c1 = _vl(packed, c1, dd, w1, x8, xo + 4, nxc[t + 2, b, l0 + 1])
                c2 = _vl(packed, c2, dd, w2, x8, xo + 8, nxc[t + 2, b, l0 + 2])
                c3 = _vl(packed, c3, dd, w3, x8, xo + 12, nxc[t + 2, b, l0 + 3])
                xo += K
                dd = vmul_s(dw, dx[t + 3, b])
                e0 = _vl(packed, e0, dd, w0, x8, xo, nxc[t + 3, b, l0])
                e1 = _vl(packed, e1, dd, w1, x8, xo + 4, nxc[t + 3, b, l0 + 1])
                e2 = _vl(packed, e2, dd, w2, x8, xo + 8, nxc[t + 3, b, l0 + 2])
                e3 = _vl(packed, e3, dd, w3, x8, xo + 12, nxc[t + 3, b, l0 + 3])
            if h == 0:                      # lanes 0-3 of the 4 rows wait in the scratch
                vstore(scr, 0, a0)
                vstore(scr, 16, a1)
                vstore(scr, 32, a2)
                vstore(scr, 48, a3)
                vstore(scr, 64, b0)
                vstore(scr, 80, b1)
                vstore(scr, 96, b2)
                vstore(scr, 112, b3)
                vstore(scr, 128, c0)
                vstore(scr, 144, c1)
                vstore(scr, 160, c2)
                vstore(scr, 176, c3)
                vstore(scr, 192, e0)
                vstore(scr, 208, e1)
                vstore(scr, 224, e2)
                vstore(scr, 240, e3)
        sa = vzero()
        sb = vzero()
        sc = vzero()
        se = vzero()
        if has_m:
            for b in range(nb):
                mv = vload_h(m, (g * nb + b) * 16)
                sa = vfma_s(mv, xs[t, b], sa)
                sb = vfma_s(mv, xs[t + 1, b], sb)
                sc = vfma_s(mv, xs[t + 2, b], sc)
                se = vfma_s(mv, xs[t + 3, b], se)
        # hsum_float_8: (l, l+4) pairs, then (0,2) + (1,3); then + summs
        vstore_row(dst, t, col, vadd(vadd(vadd(vadd(vload(scr, 0), a0), vadd(vload(scr, 32), a2)),
                                          vadd(vadd(vload(scr, 16), a1), vadd(vload(scr, 48), a3))), sa))
        vstore_row(dst, t + 1, col, vadd(vadd(vadd(vadd(vload(scr, 64), b0), vadd(vload(scr, 96), b2)),
                                              vadd(vadd(vload(scr, 80), b1), vadd(vload(scr, 112), b3))), sb))
        vstore_row(dst, t + 2, col, vadd(vadd(vadd(vadd(vload(scr, 128), c0), vadd(vload(scr, 160), c2)),
                                              vadd(vadd(vload(scr, 144), c1), vadd(vload(scr, 176), c3))), sc))
        vstore_row(dst, t + 3, col, vadd(vadd(vadd(vadd(vload(scr, 192), e0), vadd(vload(scr, 224), e2)),
                                              vadd(vadd(vload(scr, 208), e1), vadd(vload(scr, 240), e3))), se))
        t += 4
    while t < T:
        # lanes 0-3 of every block first, then lanes 4-7 (each lane's own block order kept; 4
        # accumulators, not 8: AVX2's 16 registers hold them without spilling), then the offsets
        for h in range(2):
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            l0 = 4 * h
            for b in range(nb):
                if h == 0 and t == 0:       # the group's first pass (else it is in the caches)
                    _vl_prefetch(w, d, m, has_m, g * nb + b, wb)
                w0, w1, w2, w3 = _vl_half(w, (g * nb + b) * wb, packed, h)
                da = vmul_s(vload_h(d, (g * nb + b) * 16), dx[t, b])
                xa = t * K + b * 32 + 16 * h
                a0 = _vl(packed, a0, da, w0, x8, xa, nxc[t, b, l0])
                a1 = _vl(packed, a1, da, w1, x8, xa + 4, nxc[t, b, l0 + 1])
                a2 = _vl(packed, a2, da, w2, x8, xa + 8, nxc[t, b, l0 + 2])
                a3 = _vl(packed, a3, da, w3, x8, xa + 12, nxc[t, b, l0 + 3])
            if h == 0:
                vstore(scr, 0, a0)
                vstore(scr, 16, a1)
                vstore(scr, 32, a2)
                vstore(scr, 48, a3)
        sa = vzero()
        if has_m:
            for b in range(nb):
                sa = vfma_s(vload_h(m, (g * nb + b) * 16), xs[t, b], sa)
        # hsum_float_8: (l, l+4) pairs, then (0,2) + (1,3); then + summs
        vstore_row(dst, t, col, vadd(vadd(vadd(vadd(vload(scr, 0), a0), vadd(vload(scr, 32), a2)),
                                          vadd(vadd(vload(scr, 16), a1), vadd(vload(scr, 48), a3))), sa))
        t += 1


@njit(parallel=True, cache=True)
def matmul_lanes_vnni(w, packed, d, m, x8, nxc, dx, xs, n_out, out):
    # matmul_lanes' outputs (bit for bit) from the VNNI forms of quant.QWeight ("vlanes" /
    # "vlanes4", see _vl_group). out f32 [T, >= n_out] (rows may be strided): columns 0..n_out-1.
    ng = d.shape[0]
    T = x8.shape[0]
    n_items = (ng + _LANE_CHUNK - 1) // _LANE_CHUNK
    taken = np.zeros(1, np.int64)
    for _ in prange(_workers(n_items)):                  # each thread takes items as it comes (claim)
        scr = np.empty(256, np.float32)
        c = claim(taken)
        while c < n_items:
            for g in range(c * _LANE_CHUNK, min(ng, c * _LANE_CHUNK + _LANE_CHUNK)):
                if (g + 1) * LANE_ROWS <= n_out:
                    _vl_group(w, g, packed, d, m, x8, nxc, dx, xs, out, g * LANE_ROWS, scr)
                else:
                    tmp = np.empty((T, LANE_ROWS), np.float32)
                    _vl_group(w, g, packed, d, m, x8, nxc, dx, xs, tmp, 0, scr)
                    for t in range(T):
                        for i in range(n_out - g * LANE_ROWS):
                            out[t, g * LANE_ROWS + i] = tmp[t, i]
            c = claim(taken)


@njit(cache=True)
def _q4k_row(q, sc, mn, d, m, g, xi, t, bs32, dy, pairs, dst, col):
    # dst[t, col:col+16] = matmul_q4k's outputs of row group g (the same float32 operations):
    # per span the exact integers isum = sum_j sc_j * sum_k q4 * q8, imin = sum_j mn_j * bsum_j
    # (vpdpbusd on the stored nibbles, 16 rows per int32 vector), acc = fma(isum, d_w*d_x, acc),
    # accm = fma(imin, dmin_w*d_x, accm), the span a super-block or (pairs) a pair of sub-blocks;
    # out = acc - accm. Layout ("vq4k" form): q uint8 [ng, nsb, 4, 8, 16, 4] (byte (c, k4, i, kk)
    # = the stored byte c*32 + 4*k4 + kk of row 16g+i: low nibble sub-block 2c, high 2c+1),
    # sc / mn uint8 [ng, nsb, 8, 16], d / m uint16 [ng, nsb, 16] (d, dmin: the GGUF's fp16 bits).
    nsb = d.shape[1]
    K = xi.shape[1]
    acc = vzero()
    accm = vzero()
    for b in range(nsb):
        base = g * nsb + b
        qo = base * 2048
        so = base * 128
        dd = vmul_s(vload_h(d, base * 16), dy[t, b])
        ddm = vmul_s(vload_h(m, base * 16), dy[t, b])
        isum = izero()
        imin = izero()
        xo = t * K + b * 256
        for c in range(4):
            slo = izero()
            shi = izero()
            for k4 in range(8):
                v = iload64(q, qo + (c * 8 + k4) * 64)
                slo = dpbusd(slo, nib_lo(v), ibcast4(xi, xo + c * 64 + 4 * k4))
                shi = dpbusd(shi, nib_hi(v), ibcast4(xi, xo + c * 64 + 32 + 4 * k4))
            isum = iadd(isum, iadd(imul(iload16_u8(sc, so + 32 * c), slo), imul(iload16_u8(sc, so + 32 * c + 16), shi)))
            imin = iadd(imin, iadd(imul(iload16_u8(mn, so + 32 * c), isplat(bs32[t, b * 8 + 2 * c])),
                                   imul(iload16_u8(mn, so + 32 * c + 16), isplat(bs32[t, b * 8 + 2 * c + 1]))))
            if pairs:
                acc = vfma(i2f(isum), dd, acc)
                accm = vfma(i2f(imin), ddm, accm)
                isum = izero()
                imin = izero()
        if not pairs:
            acc = vfma(i2f(isum), dd, acc)
            accm = vfma(i2f(imin), ddm, accm)
    vstore_row(dst, t, col, vsub(acc, accm))


#: the K-quant kernels take the AVX2 rows (int16 partial sums, as ggml's AVX2 kernels) where the
#: host has no VNNI (a compile-time constant of the kernels)
_AVX2 = ISA == "avx2"


@njit(cache=True)
def _q4_prefetch(q, sc, mn, d, m, qo, so, base):
    # the scale lines _PF_BYTES of levels ahead of super-block base of a "vq4k" form (128 bytes of sc
    # and of mn, 32 of d and of m per 2048 of levels); on AVX2 hosts (measured on a Zen 2 here) the
    # single-thread stream from DRAM ran well below the memory's speed without software prefetch
    prefetch(sc, so + _PF_BYTES // 16)
    prefetch(mn, so + _PF_BYTES // 16)
    prefetch(d, base * 32 + _PF_BYTES // 64)
    prefetch(m, base * 32 + _PF_BYTES // 64)


@njit(cache=True)
def _q4_prefetch_q(q, o):
    # the 512 bytes of levels at byte o + _PF_BYTES of a "vq4k" form (a quarter super-block ahead)
    p = o + _PF_BYTES
    prefetch(q, p)
    prefetch(q, p + 64)
    prefetch(q, p + 128)
    prefetch(q, p + 192)
    prefetch(q, p + 256)
    prefetch(q, p + 320)
    prefetch(q, p + 384)
    prefetch(q, p + 448)


@njit(cache=True)
def _q4k_row_avx2(q, sc, mn, d, m, g, xi, t, bs32, dy, pairs, dst, col):
    # _q4k_row (the same form, operations and bits) for AVX2: the nibble products of a sub-block
    # summed in int16 lanes (8 vpmaddubsw pairs of at most 2*15*127 = 3810 each: |sum| <= 30480,
    # exact), then scaled by vpmaddwd against the sub-block scale (exact int32)
    nsb = d.shape[1]
    K = xi.shape[1]
    acc = vzero()
    accm = vzero()
    for b in range(nsb):
        base = g * nsb + b
        qo = base * 2048
        so = base * 128
        dd = vmul_s(vload_h(d, base * 16), dy[t, b])
        ddm = vmul_s(vload_h(m, base * 16), dy[t, b])
        isum = izero()
        imin = izero()
        xo = t * K + b * 256
        if t == 0:                      # the group's first row streams its weights (see _q4_prefetch)
            _q4_prefetch(q, sc, mn, d, m, qo, so, base)
        for c in range(4):
            if t == 0:
                _q4_prefetch_q(q, qo + 512 * c)
            slo = izero()
            shi = izero()
            for k4 in range(8):
                v = iload64(q, qo + (c * 8 + k4) * 64)
                slo = addw(slo, maddubs(nib_lo(v), ibcast4(xi, xo + c * 64 + 4 * k4)))
                shi = addw(shi, maddubs(nib_hi(v), ibcast4(xi, xo + c * 64 + 32 + 4 * k4)))
            isum = iadd(isum, iadd(maddw_s(slo, iload16_u8(sc, so + 32 * c)), maddw_s(shi, iload16_u8(sc, so + 32 * c + 16))))
            imin = iadd(imin, iadd(imul(iload16_u8(mn, so + 32 * c), isplat(bs32[t, b * 8 + 2 * c])),
                                   imul(iload16_u8(mn, so + 32 * c + 16), isplat(bs32[t, b * 8 + 2 * c + 1]))))
            if pairs:
                acc = vfma(i2f(isum), dd, acc)
                accm = vfma(i2f(imin), ddm, accm)
                isum = izero()
                imin = izero()
        if not pairs:
            acc = vfma(i2f(isum), dd, acc)
            accm = vfma(i2f(imin), ddm, accm)
    vstore_row(dst, t, col, vsub(acc, accm))


@njit(cache=True)
def _group_dst(out, g, n_out, T):
    # where row group g's outputs are written: (out, its first column, True) when the group is
    # whole within n_out columns, else (a scratch [T, 16], 0, False) copied into out afterwards
    full = (g + 1) * LANE_ROWS <= n_out
    return (out if full else np.empty((T, LANE_ROWS), np.float32)), (g * LANE_ROWS if full else 0), full


@njit(parallel=True, cache=True)
def matmul_q4k_vnni(q, sc, mn, d, m, xi, dy, bs32, grouped, n_out, out):
    # matmul_q4k's outputs (bit for bit) from the "vq4k" form (see _q4k_row); out f32 [T, >= n_out]
    # (rows may be strided): columns 0..n_out-1
    ng = d.shape[0]
    T = xi.shape[0]
    n_items = (ng + _LANE_CHUNK - 1) // _LANE_CHUNK
    taken = np.zeros(1, np.int64)
    for _ in prange(_workers(n_items)):                  # each thread takes items as it comes (claim)
        c = claim(taken)
        while c < n_items:
            for g in range(c * _LANE_CHUNK, min(ng, c * _LANE_CHUNK + _LANE_CHUNK)):
                tmp, col, full = _group_dst(out, g, n_out, T)
                for t in range(T):
                    if _AVX2:
                        _q4k_row_avx2(q, sc, mn, d, m, g, xi, t, bs32, dy, grouped[t] != 0, tmp, col)
                    else:
                        _q4k_row(q, sc, mn, d, m, g, xi, t, bs32, dy, grouped[t] != 0, tmp, col)
                if not full:
                    for t in range(T):
                        for i in range(n_out - g * LANE_ROWS):
                            out[t, g * LANE_ROWS + i] = tmp[t, i]
            c = claim(taken)


#: bytes per row group and super-block of the packed "vq6k" levels (quant.pack_q6: 192 per row)
_Q6_GB = 3072


@njit(cache=True)
def _q6_chunk(q, qo, v, l):
    # the levels of lane l (0..7) of 32-element group v (0..7) of a row group's super-block at
    # byte qo of the packed "vq6k" form (quant.pack_q6), as 64 bytes: (row i, element 4l+k) at 4i+k
    l4 = l & 3
    return q6_level(iload64(q, qo + (v * 4 + l4) * 64), iload64(q, qo + 2048 + ((v >> 1) * 4 + l4) * 64),
                    (l >> 2) | ((2 * (v & 1) + (l >> 2)) << 1))


@njit(cache=True)
def _q6_prefetch(q, sc, qo, so, v):
    # the cache lines _PF_BYTES ahead of step v (0..7) of a super-block at qo / so of the "vq6k"
    # form: 384 bytes of levels (a super-block's 3072 in 8 steps) and half a line of scales
    p = qo + _PF_BYTES + v * 384
    prefetch(q, p)
    prefetch(q, p + 64)
    prefetch(q, p + 128)
    prefetch(q, p + 192)
    prefetch(q, p + 256)
    prefetch(q, p + 320)
    prefetch(sc, so + _PF_BYTES // 12 + 32 * v)


@njit(cache=True)
def _q6k_vec_row(q, sc, d, g, xi, t, bs16, dy, dst, col):
    # dst[t, col:col+16] = matmul_q6k's vec_dot outputs of row group g (same float32 operations):
    # per super-block eight exact int32 lanes, lane l = sum_v sc[2v + l//4] * sum_k q6 * q8 over
    # elements v*32 + 4l + k, minus 32 * (bsum16[2l] sc[2l] + bsum16[2l+1] sc[2l+1]);
    # acc_l = fma(d_x*d_w, lane_l, acc_l); hsum_float_8. Layout ("vq6k" form): q uint8
    # [ng, nsb, 64, 16, 4] (byte (e4, i, k) = the 6-bit level 0..63 of row 16g+i, element 4*e4+k),
    # sc int8 [ng, nsb, 16, 16] (sub-block j, row i), d uint16 [ng, nsb, 16] (the GGUF's fp16 bits).
    nsb = d.shape[1]
    K = xi.shape[1]
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    a4 = vzero()
    a5 = vzero()
    a6 = vzero()
    a7 = vzero()
    for b in range(nsb):
        base = g * nsb + b
        qo = base * _Q6_GB
        so = base * 256
        xo = t * K + b * 256
        l0 = izero()
        l1 = izero()
        l2 = izero()
        l3 = izero()
        l4 = izero()
        l5 = izero()
        l6 = izero()
        l7 = izero()
        prefetch(d, base * 32 + _PF_BYTES // 96)
        for v in range(8):
            _q6_prefetch(q, sc, qo, so, v)
            s0 = iload16_s8(sc, so + 32 * v)
            s1 = iload16_s8(sc, so + 32 * v + 16)
            x = xo + v * 32
            z = izero()
            l0 = iadd(l0, imul(s0, dpbusd(z, _q6_chunk(q, qo, v, 0), ibcast4(xi, x))))
            l1 = iadd(l1, imul(s0, dpbusd(z, _q6_chunk(q, qo, v, 1), ibcast4(xi, x + 4))))
            l2 = iadd(l2, imul(s0, dpbusd(z, _q6_chunk(q, qo, v, 2), ibcast4(xi, x + 8))))
            l3 = iadd(l3, imul(s0, dpbusd(z, _q6_chunk(q, qo, v, 3), ibcast4(xi, x + 12))))
            l4 = iadd(l4, imul(s1, dpbusd(z, _q6_chunk(q, qo, v, 4), ibcast4(xi, x + 16))))
            l5 = iadd(l5, imul(s1, dpbusd(z, _q6_chunk(q, qo, v, 5), ibcast4(xi, x + 20))))
            l6 = iadd(l6, imul(s1, dpbusd(z, _q6_chunk(q, qo, v, 6), ibcast4(xi, x + 24))))
            l7 = iadd(l7, imul(s1, dpbusd(z, _q6_chunk(q, qo, v, 7), ibcast4(xi, x + 28))))
        bo = b * 16
        l0 = isub(l0, _q6_corr(sc, so, bs16, t, bo, 0))
        l1 = isub(l1, _q6_corr(sc, so, bs16, t, bo, 1))
        l2 = isub(l2, _q6_corr(sc, so, bs16, t, bo, 2))
        l3 = isub(l3, _q6_corr(sc, so, bs16, t, bo, 3))
        l4 = isub(l4, _q6_corr(sc, so, bs16, t, bo, 4))
        l5 = isub(l5, _q6_corr(sc, so, bs16, t, bo, 5))
        l6 = isub(l6, _q6_corr(sc, so, bs16, t, bo, 6))
        l7 = isub(l7, _q6_corr(sc, so, bs16, t, bo, 7))
        dd = vmul_s(vload_h(d, base * 16), dy[t, b])
        a0 = vfma(dd, i2f(l0), a0)
        a1 = vfma(dd, i2f(l1), a1)
        a2 = vfma(dd, i2f(l2), a2)
        a3 = vfma(dd, i2f(l3), a3)
        a4 = vfma(dd, i2f(l4), a4)
        a5 = vfma(dd, i2f(l5), a5)
        a6 = vfma(dd, i2f(l6), a6)
        a7 = vfma(dd, i2f(l7), a7)
    vstore_row(dst, t, col, vadd(vadd(vadd(a0, a4), vadd(a2, a6)), vadd(vadd(a1, a5), vadd(a3, a7))))


@njit(cache=True, inline="always")
def _q6_chunk_c(q, qo, vp, par, l):
    # _q6_chunk of group v = 2 vp + par, lane l, where the caller passes par and l as constants (after
    # numba's inlining the shifts and selects of q6_level fold: a few instructions fewer per chunk)
    l4 = l & 3
    return q6_level(iload64(q, qo + ((2 * vp + par) * 4 + l4) * 64), iload64(q, qo + 2048 + (vp * 4 + l4) * 64),
                    (l >> 2) | ((2 * par + (l >> 2)) << 1))


@njit(cache=True, inline="always")
def _q6_pair_avx2(q, sc, d, g, xi, t, bs16, dy, scr, la):
    # lanes la, la + 1 of _q6k_vec_row_avx2 (la a constant at the call) over every super-block, their
    # sums stored at scr[16 la] and scr[16 la + 16]; the first pair (la == 0) streams the prefetches
    nsb = d.shape[1]
    K = xi.shape[1]
    sh = la >> 2                                # both lanes of the pair take sub-block 2v + sh
    a0 = vzero()
    a1 = vzero()
    for b in range(nsb):
        base = g * nsb + b
        qo = base * _Q6_GB
        so = base * 256
        xo = t * K + b * 256
        l0 = izero()
        l1 = izero()
        if la == 0:
            prefetch(d, base * 32 + _PF_BYTES // 96)
        for vp in range(4):                     # groups v = 2 vp (par 0) and 2 vp + 1 (par 1)
            v = 2 * vp
            if la == 0:
                _q6_prefetch(q, sc, qo, so, v)
                _q6_prefetch(q, sc, qo, so, v + 1)
            s = iload16_s8(sc, so + 32 * v + 16 * sh)
            x = xo + v * 32 + 4 * la
            l0 = iadd(l0, maddw_s(maddubs(_q6_chunk_c(q, qo, vp, 0, la), ibcast4(xi, x)), s))
            l1 = iadd(l1, maddw_s(maddubs(_q6_chunk_c(q, qo, vp, 0, la + 1), ibcast4(xi, x + 4)), s))
            s = iload16_s8(sc, so + 32 * v + 32 + 16 * sh)
            x += 32
            l0 = iadd(l0, maddw_s(maddubs(_q6_chunk_c(q, qo, vp, 1, la), ibcast4(xi, x)), s))
            l1 = iadd(l1, maddw_s(maddubs(_q6_chunk_c(q, qo, vp, 1, la + 1), ibcast4(xi, x + 4)), s))
        bo = b * 16
        l0 = isub(l0, _q6_corr(sc, so, bs16, t, bo, la))
        l1 = isub(l1, _q6_corr(sc, so, bs16, t, bo, la + 1))
        dd = vmul_s(vload_h(d, base * 16), dy[t, b])
        a0 = vfma(dd, i2f(l0), a0)
        a1 = vfma(dd, i2f(l1), a1)
    vstore(scr, 16 * la, a0)
    vstore(scr, 16 * la + 16, a1)


@njit(cache=True)
def _q6k_vec_row_avx2(q, sc, d, g, xi, t, bs16, dy, dst, col, scr):
    # _q6k_vec_row (the same form, operations and bits) for AVX2, two lanes at a time (lanes
    # 2p, 2p+1 over every super-block, then the next pair: each lane's own fma chain over the
    # super-blocks is kept, and 2 int + 2 float accumulators fit AVX2's 16 registers); each lane's
    # 4-element products by vpmaddubsw (levels 0..63: at most 2*63*127 per int16, exact) scaled by
    # vpmaddwd against the sub-block scale (exact int32). scr f32 [>= 128] holds the lanes' sums.
    _q6_pair_avx2(q, sc, d, g, xi, t, bs16, dy, scr, 0)
    _q6_pair_avx2(q, sc, d, g, xi, t, bs16, dy, scr, 2)
    _q6_pair_avx2(q, sc, d, g, xi, t, bs16, dy, scr, 4)
    _q6_pair_avx2(q, sc, d, g, xi, t, bs16, dy, scr, 6)
    # hsum_float_8 of the lanes: ((0+4) + (2+6)) + ((1+5) + (3+7))
    vstore_row(dst, t, col, vadd(vadd(vadd(vload(scr, 0), vload(scr, 64)), vadd(vload(scr, 32), vload(scr, 96))),
                                 vadd(vadd(vload(scr, 16), vload(scr, 80)), vadd(vload(scr, 48), vload(scr, 112)))))


@njit(cache=True)
def _q6_sub_avx2(c0, c1, c2, c3, xi, x, scj):
    # scj * sum_k q6 * q8 over one 16-element sub-block for 16 rows (exact int32), its levels the
    # four lane chunks c0..c3 (_q6_chunk): two int16 sums of two vpmaddubsw each (at most
    # 4*63*127 = 32004), scaled by vpmaddwd
    return iadd(maddw_s(addw(maddubs(c0, ibcast4(xi, x)), maddubs(c1, ibcast4(xi, x + 4))), scj),
                maddw_s(addw(maddubs(c2, ibcast4(xi, x + 8)), maddubs(c3, ibcast4(xi, x + 12))), scj))


@njit(cache=True)
def _q6_corr(sc, so, bs16, t, bo, l):
    # 32 * (bsum16[2l] * sc[2l] + bsum16[2l+1] * sc[2l+1]) for the 16 rows (exact int32)
    return imul(isplat(np.int32(32)), iadd(imul(iload16_s8(sc, so + 32 * l), isplat(bs16[t, bo + 2 * l])),
                                           imul(iload16_s8(sc, so + 32 * l + 16), isplat(bs16[t, bo + 2 * l + 1]))))


@njit(cache=True)
def _q6_sub(c0, c1, c2, c3, xi, x, c):
    # sum_k q6 * q8 over one 16-element sub-block for 16 rows, started at c (exact int32), its
    # levels the four lane chunks c0..c3 (_q6_chunk)
    return dpbusd(dpbusd(dpbusd(dpbusd(c, c0, ibcast4(xi, x)), c1, ibcast4(xi, x + 4)), c2, ibcast4(xi, x + 8)),
                  c3, ibcast4(xi, x + 12))


@njit(cache=True)
def _q6k_tiled_rows(q, sc, d, g, xi, t, n, bs16, dy, dst, col):
    # dst[t..t+n-1, col:col+16] (n = 1 or 4 rows sharing each weight load) = matmul_q6k's tiled
    # outputs of row group g (same float32 operations): per super-block the exact isum = sum_j
    # sc_j * (sum_k q6 * q8 - 32 * bsum16_j) over the 16 sub-blocks, out = fma(f32(isum) * d_w,
    # d_x, out), super-blocks in order. Layout as _q6k_vec_row.
    nsb = d.shape[1]
    K = xi.shape[1]
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    o3 = vzero()
    four = n == 4
    for b in range(nsb):
        base = g * nsb + b
        qo = base * _Q6_GB
        so = base * 256
        xo = t * K + b * 256
        i0 = izero()
        i1 = izero()
        i2 = izero()
        i3 = izero()
        for j in range(16):
            scj = iload16_s8(sc, so + 16 * j)
            x = xo + 16 * j
            v = j >> 1
            h = 4 * (j & 1)
            c0 = _q6_chunk(q, qo, v, h)
            c1 = _q6_chunk(q, qo, v, h + 1)
            c2 = _q6_chunk(q, qo, v, h + 2)
            c3 = _q6_chunk(q, qo, v, h + 3)
            if _AVX2:                   # the same exact integers: scj * sum + scj * (-32 * bsum)
                i0 = iadd(i0, iadd(_q6_sub_avx2(c0, c1, c2, c3, xi, x, scj), imul(scj, isplat(-32 * bs16[t, b * 16 + j]))))
                if four:
                    i1 = iadd(i1, iadd(_q6_sub_avx2(c0, c1, c2, c3, xi, x + K, scj), imul(scj, isplat(-32 * bs16[t + 1, b * 16 + j]))))
                    i2 = iadd(i2, iadd(_q6_sub_avx2(c0, c1, c2, c3, xi, x + 2 * K, scj), imul(scj, isplat(-32 * bs16[t + 2, b * 16 + j]))))
                    i3 = iadd(i3, iadd(_q6_sub_avx2(c0, c1, c2, c3, xi, x + 3 * K, scj), imul(scj, isplat(-32 * bs16[t + 3, b * 16 + j]))))
                continue
            i0 = iadd(i0, imul(scj, _q6_sub(c0, c1, c2, c3, xi, x, isplat(-32 * bs16[t, b * 16 + j]))))
            if four:
                i1 = iadd(i1, imul(scj, _q6_sub(c0, c1, c2, c3, xi, x + K, isplat(-32 * bs16[t + 1, b * 16 + j]))))
                i2 = iadd(i2, imul(scj, _q6_sub(c0, c1, c2, c3, xi, x + 2 * K, isplat(-32 * bs16[t + 2, b * 16 + j]))))
                i3 = iadd(i3, imul(scj, _q6_sub(c0, c1, c2, c3, xi, x + 3 * K, isplat(-32 * bs16[t + 3, b * 16 + j]))))
        dw = vload_h(d, base * 16)
        o0 = vfma_s(vmul(i2f(i0), dw), dy[t, b], o0)
        if four:
            o1 = vfma_s(vmul(i2f(i1), dw), dy[t + 1, b], o1)
            o2 = vfma_s(vmul(i2f(i2), dw), dy[t + 2, b], o2)
            o3 = vfma_s(vmul(i2f(i3), dw), dy[t + 3, b], o3)
    vstore_row(dst, t, col, o0)
    if four:
        vstore_row(dst, t + 1, col, o1)
        vstore_row(dst, t + 2, col, o2)
        vstore_row(dst, t + 3, col, o3)


@njit(parallel=True, cache=True)
def matmul_q6k_vnni(q, sc, d, xi, dy, bs16, tiled, n_out, out):
    # matmul_q6k's outputs (bit for bit) from the "vq6k" form (see _q6k_vec_row); per row the
    # vec_dot or (tiled[t]) the tiled kernel; out f32 [T, >= n_out] (rows may be strided)
    ng = d.shape[0]
    T = xi.shape[0]
    n_items = (ng + _LANE_CHUNK - 1) // _LANE_CHUNK
    taken = np.zeros(1, np.int64)
    for _ in prange(_workers(n_items)):                  # each thread takes items as it comes (claim)
        scr = np.empty(128, np.float32)
        c = claim(taken)
        while c < n_items:
            for g in range(c * _LANE_CHUNK, min(ng, c * _LANE_CHUNK + _LANE_CHUNK)):
                tmp, col, full = _group_dst(out, g, n_out, T)
                t = 0
                while t < T:
                    if tiled[t] != 0:
                        if t + 4 <= T and tiled[t + 1] != 0 and tiled[t + 2] != 0 and tiled[t + 3] != 0:
                            _q6k_tiled_rows(q, sc, d, g, xi, t, 4, bs16, dy, tmp, col)
                            t += 4
                        else:
                            _q6k_tiled_rows(q, sc, d, g, xi, t, 1, bs16, dy, tmp, col)
                            t += 1
                    else:
                        if _AVX2:
                            _q6k_vec_row_avx2(q, sc, d, g, xi, t, bs16, dy, tmp, col, scr)
                        else:
                            _q6k_vec_row(q, sc, d, g, xi, t, bs16, dy, tmp, col)
                        t += 1
                if not full:
                    for t in range(T):
                        for i in range(n_out - g * LANE_ROWS):
                            out[t, g * LANE_ROWS + i] = tmp[t, i]
            c = claim(taken)


@njit(cache=True)
def _kq_quantize(x, xi, dy, bs16, bs32):
    # quant_q8_K_int's values of x (f32 [T, K]) into xi / dy / bs16, and bs32 int32 [T, K/32] (the
    # sums per 32), in parallel over blocks of PAR_ROWS rows from PAR_MIN elements on (each row alone)
    T = x.shape[0]
    xb = x.view(np.int32)
    if x.size < PAR_MIN:
        _quant_q8_K_int_part(x, xb, xi, dy, bs16, 0, T)
    else:
        _quant_q8_K_int_par(x, xb, xi, dy, bs16)
    for t in range(T):
        for j in range(bs32.shape[1]):
            bs32[t, j] = bs16[t, 2 * j] + bs16[t, 2 * j + 1]


@njit(cache=True, parallel=True)
def _quant_q8_K_int_par(x, xb, xi, dy, bs16):
    T = x.shape[0]
    for c in prange((T + PAR_ROWS - 1) // PAR_ROWS):
        _quant_q8_K_int_part(x, xb, xi, dy, bs16, c * PAR_ROWS, min(T, c * PAR_ROWS + PAR_ROWS))


@njit(cache=True)
def kq_levels(x):
    """x f32 [T, K] (C-contiguous) -> (xi int8 [T, K], dy f32 [T, K/256], bs16 int32 [T, K/16],
    bs32 int32 [T, K/32]): quant_q8_K_int's levels, scales and sums, with the sums per 32."""
    T, K = x.shape
    xi = np.empty((T, K), np.int8)
    dy = np.empty((T, K // 256), np.float32)
    bs16 = np.empty((T, K // 16), np.int32)
    bs32 = np.empty((T, K // 32), np.int32)
    _kq_quantize(x, xi, dy, bs16, bs32)
    return xi, dy, bs16, bs32


@njit(cache=True)
def matmul_kq_x(x, is_q4, q, sc, mn, d, m, gemm, tiled, n_out, out):
    # out[:, :n_out] = x @ W.T for a VNNI-form K-quant W ("vq4k" when is_q4, else "vq6k"; mn / m
    # unused for Q6_K) from float32 activations x [T, K]: quant_q8_K_int's levels, then
    # matmul_q4k_vnni / matmul_q6k_vnni — one call from Python instead of three
    xi, dy, bs16, bs32 = kq_levels(x)
    if is_q4:
        matmul_q4k_vnni(q, sc, mn, d, m, xi, dy, bs32, gemm, n_out, out)
    else:
        matmul_q6k_vnni(q, sc, d, xi, dy, bs16, tiled, n_out, out)


@njit(cache=True)
def matmul_lanes_x(x, with_s, fp16_s, w, packed, d, m, bias, n_out, out):
    # out[:, :n_out] = x @ W.T for a VNNI 32-block form W ("vlanes" / "vlanes4"; m [0, 0, 0]: no
    # offset) from float32 activations x [T, K]: quant_q8_0's levels, scales and sums (q8_1's when
    # fp16_s), lane_levels with ``bias``, then matmul_lanes_vnni — one call from Python instead of three
    T, K = x.shape
    nb = K // 32
    xq = np.empty((T, K), np.float32)
    dx = np.empty((T, nb), np.float32)
    xs = np.zeros((T, nb), np.float32)
    quant_q8_0(x, xq, dx, xs, with_s, fp16_s)
    x8 = np.empty((T, K), np.int8)
    nxc = np.empty((T, nb, 8), np.int32)
    lane_levels(xq, bias, x8, nxc.reshape(T, nb * 8))
    matmul_lanes_vnni(w, packed, d, m, x8, nxc, dx, xs, n_out, out)
