"""The NumPy layers every architecture shares, rounded as ggml rounds them: RMSNorm, the
(quantized or float32) linear map, the gated FFN and its activations, embedding rows, RoPE
tables, and the ``{arch}.*`` hyperparameter readers.

Shapes: activations are float32 ``[T, n]`` (T tokens of the flat batch; float64 on the
reference path), weight matrices ``[out_features, in_features]`` (:data:`Matrix`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..attention import kernels
from ..errors import EngineError
from ..kernels.quant import QConcat, QWeight, cos_sin_libm, fuse

#: A prepared weight matrix: float32 ``[out, in]`` or a quantized form with ``shape`` and ``matmul``.
Matrix = np.ndarray | QWeight | QConcat
#: A model's prepared weights by name: vectors (norms, ``rope_freqs``) float ndarrays, matrices a
#: :data:`Matrix`. One dict holds both, so an entry is typed Any: its name says which it is.
Weights = dict[str, Any]


# ------------------------------------------------------------------ hparams helpers

def hp_int(md: dict[str, Any], key: str, default: int | None = None, *, minimum: int = 1) -> int:
    """Integer hyperparameter ``md[key]`` (>= minimum); ``default`` when absent.

    Raises: EngineError("invalid_gguf") when absent without default, not an
    integer, or below ``minimum``.
    """
    v = md.get(key, default)
    if v is None:
        raise EngineError("invalid_gguf", f"missing hyperparameter {key}")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise EngineError("invalid_gguf", f"hyperparameter {key} must be an integer >= {minimum}, got {v!r}")
    return v


def hp_float(md: dict[str, Any], key: str, default: float | None = None, *, positive: bool = True) -> float:
    """Float hyperparameter (ints accepted); ``default`` when absent.

    Raises: EngineError("invalid_gguf") when absent without default, not a
    finite number, or not > 0 when ``positive``.
    """
    v = md.get(key, default)
    if v is None:
        raise EngineError("invalid_gguf", f"missing hyperparameter {key}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise EngineError("invalid_gguf", f"hyperparameter {key} must be a {'positive ' if positive else ''}"
                          f"finite number, got {v!r}")
    return float(v)


def rope_freq_scale(md: dict[str, Any], arch: str) -> float:
    """``1 / {arch}.rope.scaling.factor`` for linear scaling, 1.0 for none.

    Source: llama-model.cpp ``load_hparams`` (``rope_freq_scale_train``).
    Raises: EngineError("unsupported_architecture") for yarn/longrope/... scaling.
    """
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None, "linear"):
        raise EngineError("unsupported_architecture", f"RoPE scaling type {kind!r} is not supported")
    if kind != "linear" or not md.get(f"{arch}.rope.scaling.factor"):
        return 1.0
    return 1.0 / hp_float(md, f"{arch}.rope.scaling.factor")


# ------------------------------------------------------------------ numpy layers

#: attn_kernels.PAIRWISE_MAX (not imported here: the float32 path never imports numba)
_PAIRWISE_MAX = 6144


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, kernel: bool = False) -> np.ndarray:
    """RMSNorm over the last axis: ``x * (1 / sqrt(mean(x^2) + eps)) * w``, rounded as ggml rounds.

    Args: x ``[..., n]``, w ``[n]`` (weights used as stored; Gemma's ``1 + w``
    is already folded in by convert_hf_to_gguf.py). Returns ``[..., n]``, x's dtype.
    Source: ggml ``ggml_compute_forward_rms_norm_f32`` then ``ggml_mul``
    (llama-graph.cpp ``build_norm`` with LLM_NORM_RMS): the squares are float32
    products summed in double (``ggml_float``), ``mean`` is rounded to float32,
    ``scale = 1.0f/sqrtf(mean + eps)`` in float32, and ``y = (x*scale)*w`` — a
    multiplication by the reciprocal, not a division (1 ULP apart otherwise, which
    flips 8-bit activation levels downstream on the quantized path). A float64 ``x``
    is computed in float64 throughout.

    ``kernel``: a float32 ``x`` through the numba kernel :func:`worker.engine.kernels.attn_kernels.rms_norm_rows` (the
    quantized path, which has numba loaded): the same operations, numpy's pairwise float64 sum
    included, so the same bits (tested ``==``), in one pass instead of six NumPy ones.
    """
    if kernel and x.dtype == np.float32 and x.shape[-1] <= _PAIRWISE_MAX:
        attn_kernels = kernels()

        n = x.shape[-1]
        xc = np.ascontiguousarray(x).reshape(-1, n)                   # [R, n]
        wr = np.ascontiguousarray(w, dtype=np.float32).view()         # one kernel signature: read-only
        wr.flags.writeable = False
        out = np.empty(xc.shape, np.float32)
        attn_kernels.rms_norm_rows(xc, wr, np.float32(eps), out)
        return out.reshape(x.shape)
    dt = x.dtype
    sq = np.multiply(x, x).astype(np.float64, copy=False)               # [..., n] x*x in x's dtype, summed in double
    mean = (sq.sum(axis=-1, keepdims=True) / x.shape[-1]).astype(dt)   # [..., 1]
    scale = dt.type(1.0) / np.sqrt(mean + dt.type(eps))                # [..., 1] in x's dtype
    return (x * scale) * w


def linear(x: np.ndarray, w: Matrix) -> np.ndarray:
    """``x @ w.T``: x ``[T, in]``, w ``[out, in]`` -> ``[T, out]`` (for a float32 ``w``, a
    transposed, Fortran-ordered view; ``np.ascontiguousarray`` it where rows must be contiguous).

    A quantized ``w`` (:class:`~.quant.QWeight`) multiplies as ggml's vec_dot does
    (activations quantized per block first; see :mod:`worker.engine.kernels.quant`).

    Computed as ``(w @ x.T).T``: OpenBLAS then takes a faster kernel for the
    small row counts of batched decode (measured on this machine kind, 2 threads,
    SmolLM2's shapes: 1.1-1.6x at T=1, 1.9-2.0x at T=8, 1.4-1.6x at T=32, 1.1-1.2x
    at T=256; scripts/bench_engine.py). Same result up to float rounding.
    """
    if not isinstance(w, np.ndarray):
        return w.matmul(x)
    return (w @ x.T).T


def gated_ffn(h: np.ndarray, wgu: Matrix, wdown: Matrix, n_ff: int, act: Any) -> np.ndarray:
    """The gated feed-forward of llama-style blocks: ``Wdown . (act(Wgate . h) * Wup . h)``.

    Args: h ``[T, n_embd]``; wgu ``[2*n_ff, n_embd]`` (gate rows, then up rows, see
    ``Model._gated_ffn_weights``); wdown ``[n_embd, n_ff]``; act elementwise (silu, gelu).
    ``act`` :func:`silu_ggml` / :func:`gelu_tanh_ggml` (the quantized path): ``act(gate) * up``
    in one numba pass (:func:`worker.engine.kernels.attn_kernels.swiglu_rows` / ``geglu_rows``, the same operations:
    the same bits). Returns ``[T, n_embd]``. Source: llama-graph.cpp ``build_ffn`` with LLM_FFN_PAR.
    """
    gu = linear(h, wgu)                               # [T, 2*n_ff]
    if act is silu_ggml or act is gelu_tanh_ggml:
        return linear(glu_ggml(gu, n_ff, act), wdown)
    return linear(act(gu[:, :n_ff]) * gu[:, n_ff:], wdown)  # [T, n_ff] -> [T, n_embd]


def glu_ggml(gu: np.ndarray, n_ff: int, act: Any) -> np.ndarray:
    """``act(gu[:, :n_ff]) * gu[:, n_ff:]`` for ``act`` :func:`silu_ggml` or :func:`gelu_tanh_ggml`,
    by one numba kernel (the same float32 operations as those functions, then the product).
    float32 ``[T, 2*n_ff]`` -> float32 ``[T, n_ff]``."""
    attn_kernels = kernels()

    gu = np.ascontiguousarray(gu, dtype=np.float32)
    out = np.empty((gu.shape[0], n_ff), np.float32)
    if act is silu_ggml:
        attn_kernels.swiglu_rows(gu, n_ff, out)
    else:
        attn_kernels.geglu_rows(gu, n_ff, _gelu_table(), out)
    return out


def embed(w: QWeight | np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Rows ``tokens [T]`` of an embedding matrix ``[n_vocab, n_embd]`` as float32 ``[T, n_embd]``
    (dequantized rows for a quantized matrix, as ggml's ``get_rows``)."""
    if isinstance(w, QWeight):
        return w.dequantize_rows(tokens)
    return w[tokens]


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` (ggml_silu), same shape and dtype."""
    return x / (1.0 + np.exp(-x))


def silu_ggml(x: np.ndarray) -> np.ndarray:
    """SiLU as ggml's CPU kernels compute it on this machine kind (``ggml_vec_swiglu_f32``,
    AVX-512: ``x / (1 + ggml_v_expf(-x))`` in blocks of 16 per row, libm ``expf`` for the rest;
    :func:`worker.engine.kernels.attn_kernels.silu_rows`). float32 ``[T, n]`` -> float32 ``[T, n]``."""
    attn_kernels = kernels()

    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    attn_kernels.silu_rows(x, out)
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Source: ggml-cpu vec.h ``ggml_gelu_f32`` (GELU_COEF_A = 0.044715,
    SQRT_2_OVER_PI = 0.79788456...). Same shape and dtype.
    """
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    inner = x * x
    inner *= x.dtype.type(0.044715)
    inner += 1.0
    inner *= x
    inner *= c
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= x
    inner *= x.dtype.type(0.5)
    return inner


def gelu_tanh_ggml(x: np.ndarray) -> np.ndarray:
    """GELU as ggml's CPU kernel computes it (``ggml_vec_gelu_f32`` / ``ggml_vec_geglu_f32`` with
    ``GGML_GELU_FP16``): the input rounded to float16 and looked up in ggml's float16 table
    (:func:`worker.engine.kernels.attn_kernels.gelu_table_f16`: ggml_gelu_f32 with GCC's fma and libm's tanhf), 0 at
    ``x <= -10`` and ``x`` at ``x >= 10``. float32 ``[...]`` -> same shape."""
    table = _gelu_table()
    y = table[x.astype(np.float16).view(np.uint16)]
    y[x <= -10.0] = 0.0
    big = x >= 10.0
    y[big] = x[big]
    return y


#: The gated FFN activations of the quantized path by name (``Model.ffn_act``): the function
#: :func:`gated_ffn` fuses with the up projection (the load warms the kernel of its model's).
FFN_ACTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"silu": silu_ggml, "gelu": gelu_tanh_ggml}

_GELU_TABLE: list[np.ndarray] = []


def _gelu_table() -> np.ndarray:
    """float32 ``[65536]``: ggml_table_gelu_f16 indexed by fp16 bit pattern (built once)."""
    if not _GELU_TABLE:
        attn_kernels = kernels()
        xs = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        table = np.empty(65536, np.float32)
        attn_kernels.gelu_table_f16(xs, table)
        _GELU_TABLE.append(table)
    return _GELU_TABLE[0]


class RopeTable:
    """cos/sin of RoPE angles for every position ``0 .. n_ctx-1``, rounded as ggml rounds them.

    ``theta[p, i] = freq_scale * (p * theta_scale^i) / freq_factor[i]`` for ``i < n_rot/2``
    with ``theta_scale = powf(base, -2.0f/n_rot)`` and the powers built by repeated float32
    multiplication (``theta *= theta_scale``), cos/sin of the float32 angle rounded to float32.
    Source: ggml-cpu ops.cpp ``ggml_compute_forward_rope_flt`` / ``ggml_rope_cache_init`` /
    ``rope_yarn`` with ext_factor 0 (no YaRN); ``freq_factors`` from the optional
    ``rope_freqs.weight`` tensor (Llama 3.1 style). A float64 table (``dtype=np.float64``,
    reference runs) takes the exact angles ``p * base^(-2i/n_rot)`` instead. ``libm``: cos/sin
    by the C library's ``cosf``/``sinf`` as ggml calls them (the quantized path; glibc's are not
    correctly rounded, ~1 % of a table differs), else float64 cos/sin rounded to float32.

    Attributes: cos, sin: ``[n_ctx, n_rot/2]`` in ``dtype``.
    """

    def __init__(self, n_ctx: int, n_rot: int, base: float, freq_scale: float = 1.0,
                 freq_factors: np.ndarray | None = None, dtype: Any = np.float32, libm: bool = False) -> None:
        if n_rot <= 0 or n_rot % 2:
            raise EngineError("invalid_gguf", f"RoPE dimension count must be positive and even, got {n_rot}")
        self.n_rot = n_rot
        self.dtype = np.dtype(dtype)
        #: the rotation by the numba kernel :func:`worker.engine.kernels.attn_kernels.rope_rows` (the libm tables' path)
        self.kernel = bool(libm) and self.dtype == np.float32
        half = n_rot // 2
        pos = np.arange(n_ctx, dtype=np.float64)
        if self.dtype == np.float64:
            inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)   # [n_rot/2]
            if freq_factors is not None:
                inv = inv / np.asarray(freq_factors, dtype=np.float64)
            ang = pos[:, None] * (freq_scale * inv)[None, :]                     # [n_ctx, n_rot/2]
        else:
            f32 = np.float32
            # powf of float32 arguments, correctly rounded (what glibc's powf returns here)
            theta_scale = f32(np.float64(f32(base)) ** np.float64(f32(-2.0) / f32(n_rot)))
            ang = np.empty((n_ctx, half), np.float32)                            # [n_ctx, n_rot/2]
            ang[:, 0] = pos.astype(np.float32)
            for i in range(1, half):
                np.multiply(ang[:, i - 1], theta_scale, out=ang[:, i])           # theta *= theta_scale
            if freq_factors is not None:
                ang /= np.asarray(freq_factors, dtype=np.float32)[None, :]
            ang *= f32(freq_scale)
            if libm:
                self.cos, self.sin = cos_sin_libm(ang)
                return
            ang = ang.astype(np.float64)
        self.cos = np.cos(ang).astype(self.dtype)
        self.sin = np.sin(ang).astype(self.dtype)

    def apply_neox(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate pairs ``(x[i], x[i + n_rot/2])`` ("NEOX" pairing, ggml ``rotate_pairs`` with
        ``n_offset = n_dims/2``), in place; see :meth:`_rotate`. Returns x."""
        half = self.n_rot // 2
        if self.kernel and x.dtype == np.float32 and x.ndim == 3:
            return self._rotate_kernel(x, positions, True)
        self._rotate(x[..., :half], x[..., half:self.n_rot], positions)
        return x

    def apply_norm(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate adjacent pairs ``(x[2i], x[2i+1])`` ("NORM" pairing of llama-arch models, ggml
        ``rotate_pairs`` with ``n_offset = 1``), in place; see :meth:`_rotate`. Returns x."""
        if self.kernel and x.dtype == np.float32 and x.ndim == 3:
            return self._rotate_kernel(x, positions, False)
        self._rotate(x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2], positions)
        return x

    def _rotate_kernel(self, x: np.ndarray, positions: np.ndarray, neox: bool) -> np.ndarray:
        """:meth:`_rotate` of every pair of float32 ``x [T, n_heads, hd]`` in place by one numba pass
        (:func:`worker.engine.kernels.attn_kernels.rope_rows`: the same operations, the same bits)."""
        attn_kernels = kernels()

        attn_kernels.rope_rows(x, np.ascontiguousarray(positions, dtype=np.int64), self.cos, self.sin,
                               self.n_rot, neox)
        return x

    def _rotate(self, x0: np.ndarray, x1: np.ndarray, positions: np.ndarray) -> None:
        """``(x0, x1) <- (x0*cos - x1*sin, x0*sin + x1*cos)`` in place.

        Args: x0, x1 ``[T, n_heads, n_rot/2]`` views of the pair members; positions ``[T]``
        int, each in ``[0, n_ctx)``; dims ``>= n_rot`` are not touched.
        Source: ggml-cpu ops.cpp ``rotate_pairs``, which GCC (-ffp-contract=fast, FMA)
        compiles to ``fma(x0, cos, -(x1*sin))`` and ``fma(x0, sin, x1*cos)``; in float32 that
        is what is computed here (the fma through float64, where the product is exact).
        """
        cos = self.cos[positions][:, None, :]   # [T, 1, n_rot/2]
        sin = self.sin[positions][:, None, :]   # [T, 1, n_rot/2]
        if x0.dtype == np.float64:
            r0 = x0 * cos - x1 * sin
            r1 = x1 * cos + x0 * sin
        else:
            a = x0.astype(np.float64)
            r0 = (a * cos - (x1 * sin)).astype(x0.dtype)   # fma(x0, cos, -(x1*sin))
            r1 = (a * sin + (x1 * cos)).astype(x0.dtype)   # fma(x0, sin, x1*cos)
        x0[...] = r0
        x1[...] = r1


def fuse_rows(parts: Sequence[QWeight | np.ndarray]) -> Matrix:
    """Stack ``[out_i, in]`` matrices into one ``[sum(out_i), in]`` (C-contiguous float32, one
    QWeight when the quantized parts are compatible, else a QConcat; :func:`worker.engine.kernels.quant.fuse`)."""
    return fuse(parts)


__all__ = [
    "FFN_ACTS", "Matrix", "RopeTable", "Weights", "embed", "fuse_rows", "gated_ffn", "gelu_tanh", "gelu_tanh_ggml", "glu_ggml",
    "hp_float", "hp_int", "linear", "rms_norm", "rope_freq_scale", "silu", "silu_ggml",
]
