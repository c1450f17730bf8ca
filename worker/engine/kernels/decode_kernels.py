"""numba kernel of one llama-style block for one token (the decode step of a single sequence), as one
compiled call: the same kernels, in the same order, as the NumPy path of ``arch/model.py`` /
``arch/llama.py`` runs them (so the same bits, tested ``==``), without the Python between them.

Per block (``h = x + Wo . attn(rope(q), rope(k), v)``, ``x = h + Wdown . swiglu(Wgu . rms(h))``):
RMSNorm (``attn_kernels._rms_norm_part``), the q8_K levels of the activations (``kq_levels``), the
fused QKV matvec (``matmul_q4k_vnni`` / ``matmul_q6k_vnni``), RoPE (``attn_kernels.rope_rows``), K and
V rounded to f16 into the KV cache at the token's position (``f16r``, as ``attention.round_f16``),
flash attention (``attn_kernels.fa_vec``), the output projection and its residual, RMSNorm, the gate/up
matvec, SwiGLU (``attn_kernels._swiglu_part``), the down matvec and its residual.

A matrix is given as a :data:`KQ` tuple: the rows of a VNNI-form Q4_K part (``"vq4k"``) followed by
those of a VNNI-form Q6_K part (``"vq6k"``), either of them empty (``n == 0``, zero-size arrays of the
same types), as ``quant.kquant_matvec_parts`` builds it: the forms Q4_K_M files give.
Shapes: x float32 ``[1, n_embd]`` (updated in place), positions int64 ``[1]``, the layer's K/V cache
float32 ``[n_kv, n_alloc, head_dim]`` (C-contiguous, position = cell).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import njit
from numba.core import caching

#: the sources whose kernels this module's compile into its own (numba's cache of a function is keyed
#: by its own file's stamp alone: a changed callee in another file would leave a stale compiled block)
_DEPS = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
              for f in ("decode_kernels.py", "quant_kernels.py", "attn_kernels.py", "simd.py", "quant.py"))


class _DepsStamp:
    """numba cache locator part: this file's functions are stale when any of :data:`_DEPS` changed
    (the stamp: their latest mtime and their total size)."""

    _py_file: str

    def get_source_stamp(self):  # type: ignore[no-untyped-def]
        st = [os.stat(f) for f in _DEPS]
        return max(s.st_mtime for s in st), sum(s.st_size for s in st)

    @classmethod
    def from_function(cls, py_func, py_file):  # type: ignore[no-untyped-def]
        if os.path.abspath(py_file) != _DEPS[0]:
            return None
        return super().from_function(py_func, py_file)  # type: ignore[misc]


class _UserDirLocator(_DepsStamp, caching.UserProvidedCacheLocator):
    pass


class _InTreeLocator(_DepsStamp, caching.InTreeCacheLocator):
    pass


if _UserDirLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes[:0] = [_UserDirLocator, _InTreeLocator]

from .attn_kernels import _rms_norm_part, _swiglu_part, f16r, fa_vec, rope_rows
from .quant_kernels import kq_levels, matmul_q4k_vnni, matmul_q6k_vnni

f32 = numba.float32


@njit(cache=True)
def kq_matvec(x, w, gemm, tiled, out):
    # out[:, :n4 + n6] = x @ W.T for a KQ tuple w = (q4, sc4, mn4, d4, m4, n4, q6, sc6, d6, n6): one
    # quantization of x (f32 [T, K]) shared by both parts, as QConcat.matmul / matmul_kq_x compute it
    q4, sc4, mn4, d4, m4, n4, q6, sc6, d6, n6 = w
    xi, dy, bs16, bs32 = kq_levels(x)
    if n4 > 0:
        matmul_q4k_vnni(q4, sc4, mn4, d4, m4, xi, dy, bs32, gemm, n4, out)
    if n6 > 0:
        matmul_q6k_vnni(q6, sc6, d6, xi, dy, bs16, tiled, n6, out[:, n4:])


@njit(cache=True)
def llama_block_t1(x, pos, eps, attn_norm, ffn_norm, wqkv, wo, wgu, wdown, cos, sin, n_rot, n_head, n_kv, hd,
                   kc, vc, scale, mode, n_cells, n_chunks, gemm, tiled, n_ff):
    # one llama block for one token, in place on x f32 [1, E] (see the module docstring); kc / vc: the
    # layer's f16-valued K/V cache [n_kv, n_alloc, hd] (cell pos[0] written here); mode, n_cells,
    # n_chunks: attention.ggml_fa_mode's path and view for this token, GGML_DECODE_THREADS
    E = x.shape[1]
    nq = n_head * hd
    nk = n_kv * hd
    h = np.empty((1, E), np.float32)
    _rms_norm_part(x, attn_norm, eps, h, 0, 1)
    qkv = np.empty((1, nq + 2 * nk), np.float32)
    kq_matvec(h, wqkv, gemm, tiled, qkv)
    qk = np.empty((1, n_head + n_kv, hd), np.float32)           # q heads then k heads
    for j in range(nq + nk):
        qk[0, j // hd, j % hd] = qkv[0, j]
    rope_rows(qk, pos, cos, sin, n_rot, False)
    q = np.empty((1, n_head, hd), np.float32)
    for i in range(n_head):
        for d in range(hd):
            q[0, i, d] = qk[0, i, d]
    p = pos[0]
    for g in range(n_kv):
        for d in range(hd):
            kc[g, p, d] = f16r(qk[0, n_head + g, d])
            vc[g, p, d] = f16r(qkv[0, nq + nk + g * hd + d])
    a = np.empty((1, nq), np.float32)
    fa_vec(q, kc, vc, p, 0, 0, scale, f32(0.0), mode, n_cells, n_chunks, a)
    o = np.empty((1, E), np.float32)
    kq_matvec(a, wo, gemm, tiled, o)
    for i in range(E):
        x[0, i] = x[0, i] + o[0, i]
    _rms_norm_part(x, ffn_norm, eps, h, 0, 1)
    gu = np.empty((1, 2 * n_ff), np.float32)
    kq_matvec(h, wgu, gemm, tiled, gu)
    act = np.empty((1, n_ff), np.float32)
    _swiglu_part(gu, n_ff, act, 0, 1)
    kq_matvec(act, wdown, gemm, tiled, o)
    for i in range(E):
        x[0, i] = x[0, i] + o[0, i]


@njit(cache=True)
def _f16_value(bits):
    # the float32 value of IEEE binary16 bits (uint16; exact: every binary16 is a float32)
    b = np.int32(bits)
    s = -1.0 if b & 0x8000 else 1.0
    e = (b >> 10) & 31
    f = b & 1023
    if e == 31:
        return f32(s * np.inf) if f == 0 else f32(np.nan)
    if e == 0:
        return f32(s * f * 2.0 ** -24)
    return f32(s * (1024 + f) * 2.0 ** (e - 25))


@njit(cache=True)
def kq_row(w, r, out):
    # out f32 [K] = row r of a KQ tuple's matrix w, dequantized as QWeight.dequantize_rows computes it
    # (get_rows): Q4_K w = f32(q) * (d * sc) + (-(dmin * mn)), Q6_K w = f32(q - 32) * (d * sc), per
    # 32- / 16-element sub-block, the products in float32 (see the "vq4k" / "vq6k" layouts in
    # quant_kernels._q4k_row / _q6k_vec_row)
    q4, sc4, mn4, d4, m4, n4, q6, sc6, d6, n6 = w
    if r < n4:
        g, i = r // 16, r % 16
        for b in range(d4.shape[1]):
            dd = _f16_value(d4[g, b, i])
            dm = _f16_value(m4[g, b, i])
            for c in range(4):
                for h in range(2):
                    j = 2 * c + h
                    ds = dd * f32(sc4[g, b, j, i])
                    ms = -(dm * f32(mn4[g, b, j, i]))
                    for k4 in range(8):
                        for kk in range(4):
                            v = np.int32(q4[g, b, c, k4, i, kk])
                            lv = (v >> 4) if h else (v & 15)
                            out[b * 256 + j * 32 + 4 * k4 + kk] = f32(lv) * ds + ms
        return
    r -= n4
    g, i = r // 16, r % 16
    for b in range(d6.shape[1]):
        dd = _f16_value(d6[g, b, i])
        for e in range(256):
            v, rest = e // 32, e % 32
            l, k = rest // 4, rest % 4
            l4 = l & 3
            lo = np.int32(q6[g, b, (v * 4 + l4) * 64 + i * 4 + k])
            lo = (lo >> 4) if l >= 4 else (lo & 15)
            hb = np.int32(q6[g, b, 2048 + ((v >> 1) * 4 + l4) * 64 + i * 4 + k])
            hi = (hb >> (2 * ((l >> 2) + 2 * (v & 1)))) & 3
            out[b * 256 + e] = f32((lo | (hi << 4)) - 32) * (dd * f32(sc6[g, b, e // 16, i]))
