"""Model base class, shared NumPy layers, weight cache, and ``load_model`` dispatch.

An architecture is one small file (``llama.py``, ``gemma3.py``) defining a
:class:`Model` subclass with three methods: ``_read_hparams`` (from the
``{arch}.*`` keys), ``_build_weights`` (dequantize, fuse, validate shapes) and
``_forward_hidden`` (one forward pass over a chunk of tokens), registered in
:data:`ARCHITECTURES` by ``general.architecture``. The parts they share live on
:class:`Model`: ``_read_attention_hparams`` (the common keys and their checks),
``_embedding_weights``, ``_qkv_weights``, ``_gated_ffn_weights``,
``_layer_weights`` and a default ``_make_cache``.

Weights are dequantized once to float32 (``GGUFFile.tensor``), fused (Q/K/V
into one matrix, gate/up into one) and kept as ``[out_features,
in_features]`` C-contiguous arrays used as ``x @ W.T`` (measured on this
machine: the same speed as a transposed copy used as ``x @ Wt``, within noise,
so no transpose is paid at load). The prepared arrays are cached in one packed
file under ``$XDG_CACHE_HOME/modelyard/npy/<sha256 of the GGUF>/<layout>/``
and memory-mapped read-only on the next load (several worker processes on one
file then share the pages); see :class:`WeightCache`.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import numpy as np

from ..errors import EngineError
from ..loading.gguf_loader import GGUFFile, atomic_write_bytes, cache_root
from ..attention import AttnBatch, Segment, attention, attention_mask, kernels  # noqa: F401 (re-exported)
from ..kv.cache import KVEntry, KVShape
from ..kernels.quant import (_SEQ_ROWS, QConcat, QWeight, cos_sin_libm, format_tag as quant_format, fuse, row_groups,
                    supports as quant_supports, thread_ceiling, use_threads)
from ..kernels.threadctl import ThreadGovernor

#: How weight matrices are held: ``"quantized"`` (the GGUF's own blocks, multiplied by the kernels
#: of :mod:`worker.engine.kernels.quant` exactly as llama.cpp's CPU backend computes) or ``"f32"`` (dequantized once,
#: sgemm; the reference). The default is "quantized": it is the faithful path (llama.cpp's
#: recorded logprobs to the bit), it holds a third to a quarter of f32's memory, and with the VNNI
#: kernels it costs less CPU per token than sgemm on float32 weights at every batch size
#: (scripts/bench_weights.py; README's `weights` row has the figures).
WEIGHT_MODES = ("quantized", "f32")
DEFAULT_WEIGHTS = "quantized"

#: A prepared weight matrix: float32 ``[out, in]`` or a quantized form with ``shape`` and ``matmul``.
Matrix = np.ndarray | QWeight | QConcat
#: A model's prepared weights by name: vectors (norms, ``rope_freqs``) float ndarrays, matrices a
#: :data:`Matrix`. One dict holds both, so an entry is typed Any: its name says which it is.
Weights = dict[str, Any]

#: ``general.architecture`` -> Model subclass (filled by :func:`register`).
ARCHITECTURES: dict[str, type[Model]] = {}

#: n_ctx used when the caller gives none: ``min(n_ctx_train, DEFAULT_MAX_CTX)``.
DEFAULT_MAX_CTX = 8192

#: ``progress(stage, done, total)``: hears the load's steps (see :class:`Model`); must not raise.
LoadProgressFn = Callable[[str, int, int], None]


def register(cls: type[Model]) -> type[Model]:
    """Class decorator: make ``cls`` loadable for ``general.architecture == cls.arch``."""
    ARCHITECTURES[cls.arch] = cls
    return cls


def load_model(gguf: GGUFFile, n_ctx: int | None = None, *, dtype: Any = np.float32,
               weight_cache: bool | None = None, cache_write: str = "background",
               weights: str = DEFAULT_WEIGHTS, progress: LoadProgressFn | None = None) -> Model:
    """Build the model for a parsed GGUF file.

    Args:
        gguf: from :func:`worker.engine.loading.gguf_loader.read_gguf`.
        n_ctx: KV cache size in tokens; None -> ``min({arch}.context_length, 8192)``.
            May exceed the training context (llama.cpp allows it too).
        dtype: compute dtype, ``np.float32`` (serving) or ``np.float64``
            (reference runs for tests; weights are upcast, never cached).
        weight_cache: use the cache of prepared weights (:class:`WeightCache`); None -> on
            unless the environment sets ``MODELYARD_WEIGHT_CACHE=0``. Files
            under ``WEIGHT_CACHE_MIN_BYTES`` (16 MiB) are never cached.
        cache_write: on a cache miss, write the cache's files in a background
            thread (``"background"``: the model is usable at once; see
            :meth:`Model.wait_weight_cache`) or before returning (``"sync"``).
        weights: ``"quantized"`` (weight matrices kept in the GGUF's quantized
            blocks, multiplied as ggml's vec_dot does) or ``"f32"`` (dequantized
            to float32, the reference path). A float64 model is always ``"f32"``.
        progress: see :class:`Model`.
    Returns:
        a :class:`Model` with an empty KV cache.
    Raises:
        EngineError("unsupported_architecture"): no class for ``general.architecture``
            (or an unsupported feature such as a RoPE scaling type).
        EngineError("invalid_gguf"): missing/ill-typed hyperparameter, missing
            tensor or tensor of the wrong shape.
        EngineError("invalid_params"): n_ctx not a positive integer, bad dtype, unknown weights mode.
    """
    _register_builtin()
    arch = gguf.architecture
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise EngineError("unsupported_architecture",
                          f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    if cache_write not in ("background", "sync"):
        raise EngineError("invalid_params", f"cache_write must be 'background' or 'sync', got {cache_write!r}")
    if weights not in WEIGHT_MODES:
        raise EngineError("invalid_params", f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    return cls(gguf, n_ctx, dtype=dtype, weight_cache=weight_cache, cache_write=cache_write, weights=weights,
               progress=progress)


def _register_builtin() -> None:
    # imported here (not at module top) so that llama.py / gemma3.py can import this module
    from . import gemma3, llama, qwen2, qwen3  # noqa: F401


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


# ------------------------------------------------------------------ weight cache

CACHE_ENV = "MODELYARD_WEIGHT_CACHE"
#: GGUF files smaller than this are dequantized on every load (milliseconds) and
#: never leave cache files behind (tests write many tiny GGUFs).
WEIGHT_CACHE_MIN_BYTES = 16 << 20
_cache_lock = threading.Lock()


class WeightCache:
    """Prepared weights (float32 arrays, or a quantized form's arrays), keyed by GGUF content, in
    one packed file.

    Directory: ``$XDG_CACHE_HOME/modelyard/npy/<sha256>/<layout>/`` where
    ``layout`` names the architecture class, the weights mode (for ``quantized`` with the
    in-memory form's :func:`~.quant.format_tag`: ``llama-v2-quantized-8-vnni``) and its
    ``layout_version`` (bumped whenever ``_build_weights`` changes). It holds
    ``weights.bin`` (every array's C-order bytes, each starting at a multiple of
    :data:`PACK_ALIGN` bytes) and ``manifest.json`` (per array: shape, dtype, byte offset; the
    file's total size). Both are written to temp files and renamed, the manifest last, so a
    directory without a manifest is never read and concurrent writers of identical content are
    harmless. A load maps ``weights.bin`` once (read-only) and makes every array a view of it:
    one ``mmap`` instead of one file open, header parse and mapping per array (a model has
    300-450 arrays; ~0.5 s of a cold start under load). A pack whose size differs from the
    manifest's, or an array outside it, is not read (the weights are rebuilt).
    """

    #: Byte alignment of every array in ``weights.bin`` (a cache line; 16-lane float32 loads).
    PACK_ALIGN = 64
    PACK_NAME = "weights.bin"

    def __init__(self, fingerprint: str, layout: str) -> None:
        self.dir = cache_root() / "npy" / fingerprint / layout

    def load(self) -> dict[str, Matrix] | None:
        """The cached arrays (read-only views of the mapped pack; quantized matrices rebuilt from
        their ``name@q`` / ``name@d`` / ... arrays, a concatenation from its parts ``name#i``), or
        None if absent/incomplete/corrupt or of another quantized form."""
        try:
            manifest = json.loads((self.dir / "manifest.json").read_text())
            if manifest.get("pack") != self.PACK_NAME:
                return None  # an older cache layout (one .npy per array): rebuilt
            if manifest.get("quant_format") != quant_format() and manifest.get("quantized"):
                return None  # quantized weights of another in-memory form: rebuilt
            path = self.dir / self.PACK_NAME
            size = int(manifest["pack_bytes"])
            if path.stat().st_size != size:
                return None
            buf = np.memmap(path, mode="r", dtype=np.uint8, shape=(size,)) if size else np.zeros(0, np.uint8)
            flat: dict[str, np.ndarray] = {}
            for name, (shape, dtype, offset) in manifest["arrays"].items():
                dt = np.dtype(dtype)
                n = dt.itemsize * math.prod(shape)
                if offset < 0 or offset + n > size or offset % dt.alignment:
                    return None
                a = np.ndarray(tuple(shape), dtype=dt, buffer=buf, offset=offset)
                a.flags.writeable = False
                flat[name] = a
            out: dict[str, Matrix] = {n: a for n, a in flat.items() if "@" not in n and "#" not in n}
            parts: dict[str, dict[str, np.ndarray]] = {}
            for k, a in flat.items():
                if "@" in k:
                    owner, part = k.split("@", 1)
                    parts.setdefault(owner, {})[part] = a
            for name, meta in manifest.get("quantized", {}).items():
                out[name] = QWeight.from_arrays(parts.get(name, {}), meta)
            for name, n_parts in manifest.get("concat", {}).items():  # a part is never itself a QConcat
                out[name] = QConcat([cast("QWeight | np.ndarray", out.pop(f"{name}#{i}")) if f"{name}#{i}" in out
                                     else flat[f"{name}#{i}"] for i in range(n_parts)])
            return out
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, weights: dict[str, Matrix]) -> None:
        """Write the pack, then the manifest (atomic renames). Errors are swallowed:
        a read-only or full disk only costs the next load time. Temp files left by a
        killed writer (older than an hour) and an older layout's ``.npy`` files are removed.
        A :class:`~.quant.QConcat` is saved part by part."""
        arrays: dict[str, np.ndarray] = {}
        quantized: dict[str, Any] = {}
        concat: dict[str, int] = {}

        def put(name: str, w: Any) -> bool:
            if isinstance(w, QWeight):
                quantized[name] = w.meta()
                arrays.update({f"{name}@{k}": a for k, a in w.arrays().items()})
            elif isinstance(w, np.ndarray):
                arrays[name] = w
            else:
                return False
            return True

        for name, w in weights.items():
            if isinstance(w, QConcat):
                concat[name] = len(w.parts)
                if not all(put(f"{name}#{i}", p) for i, p in enumerate(w.parts)):
                    return
            elif not put(name, w):
                return
        try:
            with _cache_lock:
                self.dir.mkdir(parents=True, exist_ok=True)
                now = time.time()
                for stale in self.dir.glob(".*.tmp"):
                    try:
                        if now - stale.stat().st_mtime > 3600:
                            stale.unlink()
                    except OSError:
                        pass
                path = self.dir / self.PACK_NAME
                tmp = self.dir / f".{self.PACK_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
                entries: dict[str, list[Any]] = {}
                try:
                    with open(tmp, "wb") as f:
                        off = 0
                        for name, arr in arrays.items():
                            a = np.ascontiguousarray(arr)
                            pad = -off % self.PACK_ALIGN
                            f.write(b"\0" * pad)
                            off += pad
                            entries[name] = [list(a.shape), str(a.dtype), off]
                            f.write(memoryview(a.reshape(-1)).cast("B"))  # type: ignore[arg-type]  # numpy types ndarray's buffer protocol for Python >= 3.12 only
                            off += a.nbytes
                    os.replace(tmp, path)
                finally:
                    if tmp.exists():
                        tmp.unlink()
                manifest = {"pack": self.PACK_NAME, "pack_bytes": off, "arrays": entries,
                            "quantized": quantized, "concat": concat, "quant_format": quant_format()}
                atomic_write_bytes(self.dir / "manifest.json", json.dumps(manifest).encode())
                for old in self.dir.glob("*.npy"):  # the layout before the pack
                    try:
                        old.unlink()
                    except OSError:
                        pass
        except OSError:
            pass


# ------------------------------------------------------------------ the model


class Model:
    """One loaded model and its KV cache (one sequence).

    Subclasses set ``arch`` and ``layout_version`` and implement
    ``_read_hparams``, ``_build_weights`` and ``_forward_hidden``.

    Attributes:
        n_ctx: KV cache capacity in tokens.
        n_ctx_train: ``{arch}.context_length``.
        n_vocab: vocabulary size (rows of the output projection).
        n_past: tokens currently in the KV cache.
        dtype: compute dtype (float32, or float64 for reference runs).
        load_timings: seconds spent per load phase (``weights``, ``cache_write``, ...).
        weights_from_cache: True when the prepared weights came from the weight cache (:class:`WeightCache`).

    ``progress`` (optional) is called as ``progress("preparing_tensors", done, total)``
    once per GGUF tensor dequantized while the weights are built (``total``: the file's
    tensor count; a weight-cache hit builds none, so it is not called).
    """

    arch: ClassVar[str] = ""
    layout_version: ClassVar[int] = 1
    #: The gated FFN's activation on the quantized path, a key of :data:`FFN_ACTS`: the kernel
    #: the load warms up (``engine._load_ffn_kernels``).
    ffn_act: ClassVar[str] = "silu"

    def __init__(self, gguf: GGUFFile, n_ctx: int | None = None, *, dtype: Any = np.float32,
                 weight_cache: bool | None = None, cache_write: str = "background",
                 weights: str = DEFAULT_WEIGHTS, progress: LoadProgressFn | None = None) -> None:
        self._progress = progress
        self._tensors_done = 0
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise EngineError("invalid_params", f"dtype must be float32 or float64, got {dtype!r}") from None
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise EngineError("invalid_params", f"dtype must be float32 or float64, got {dtype!r}")
        self.gguf = gguf
        #: "quantized" or "f32" (a float64 reference model is always "f32")
        self.weights = weights if self.dtype == np.float32 else "f32"
        #: the quantized path also follows ggml's other roundings where they are cheap to
        #: reproduce: q/k/v at float16 precision (f16 KV cache, flash attention), GELU's f16 table
        self.ggml_numerics = self.weights == "quantized"
        self.metadata = gguf.metadata
        md = gguf.metadata
        self.n_ctx_train = hp_int(md, f"{self.arch}.context_length")
        if n_ctx is None:
            n_ctx = min(self.n_ctx_train, DEFAULT_MAX_CTX)
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)) or n_ctx <= 0:
            raise EngineError("invalid_params", f"n_ctx must be a positive integer, got {n_ctx!r}")
        self.n_ctx = int(n_ctx)
        self.load_timings: dict[str, float] = {}
        self._cache_write = cache_write
        self._cache_thread: threading.Thread | None = None
        self._read_hparams(md)
        #: the thread count of each forward pass on the quantized path (:mod:`worker.engine.kernels.threadctl`)
        self.threads = ThreadGovernor()
        t0 = time.perf_counter()
        self.w = self._load_weights(weight_cache)
        self.load_timings["weights"] = time.perf_counter() - t0
        self.n_vocab = int(self.w["output"].shape[0] if "output" in self.w else self.w["tok_embd"].shape[0])
        self.weight_bytes = sum(int(w.nbytes) for w in self.w.values())
        self._setup()
        self.cache = self._make_cache()

    # -- to implement -----------------------------------------------------

    def _read_hparams(self, md: dict[str, Any]) -> None:
        raise NotImplementedError

    def _build_weights(self) -> Weights:
        """Prepared arrays by name (matrices from :meth:`matrix`, vectors from :meth:`tensor`;
        fused, validated)."""
        raise NotImplementedError

    def _setup(self) -> None:
        """Derived state after weights are loaded (RoPE tables, ...)."""

    @property
    def n_swa(self) -> int:
        """Sliding-window size in tokens (``{arch}.attention.sliding_window``, as
        ``llama_model_n_swa``), 0 for a model without sliding-window layers."""
        return int(getattr(self, "window", None) or 0)

    @property
    def kv_shape(self) -> KVShape:
        """KV layout: ``n_layer`` layers, ``n_head_kv`` heads of ``head_dim`` (keys and values)."""
        return KVShape(self.n_layer, self.n_head_kv, self.head_dim, self.head_dim, self.dtype)

    def _make_cache(self) -> KVEntry:
        """The KV entry of the single-sequence :meth:`forward` path (capacity n_ctx, lazy)."""
        return KVEntry(self.kv_shape, self.n_ctx, self.n_ctx)

    def _forward_hidden(self, tokens: np.ndarray, batch: AttnBatch, rows: np.ndarray) -> np.ndarray:
        """Run every block over the flat batch ``tokens [N]`` (positions ``batch.positions``),
        storing each segment's K/V in its entry through :func:`attention.attend`; the last
        block's FFN runs on the output rows only (:meth:`_keep_output_rows`).

        Returns the final-normed hidden states of ``rows`` (int ``[R]``): ``[R, n_embd]``.
        """
        raise NotImplementedError

    # -- shared by the architectures ----------------------------------------

    def _read_attention_hparams(self, md: dict[str, Any], *, check_embd_divisible: bool) -> None:
        """The ``{arch}.*`` keys of a dense RMSNorm/RoPE attention model.

        Sets n_embd, n_layer, n_ff, n_head, n_head_kv (default n_head; must
        divide n_head), head_dim (``attention.key_length``, default ``n_embd //
        n_head``), head_dim_v (``attention.value_length``, must equal head_dim),
        n_rot (``rope.dimension_count``, default head_dim; even, <= head_dim),
        eps, rope_base (``rope.freq_base``, default 10000) and rope_scale.
        ``check_embd_divisible``: without ``attention.key_length``, n_embd must
        be a multiple of n_head (llama); otherwise the floor is taken (gemma3).
        The architecture reads its own extra keys after this.

        Raises: EngineError("invalid_gguf"); EngineError("unsupported_architecture")
        for an unsupported RoPE scaling type.
        """
        a = self.arch
        self.n_embd = hp_int(md, f"{a}.embedding_length")
        self.n_layer = hp_int(md, f"{a}.block_count")
        self.n_ff = hp_int(md, f"{a}.feed_forward_length")
        self.n_head = hp_int(md, f"{a}.attention.head_count")
        self.n_head_kv = hp_int(md, f"{a}.attention.head_count_kv", self.n_head)
        if self.n_head % self.n_head_kv:
            raise EngineError("invalid_gguf", f"{a}.attention.head_count ({self.n_head}) is not a multiple of "
                              f"{a}.attention.head_count_kv ({self.n_head_kv})")
        if check_embd_divisible and self.n_embd % self.n_head and f"{a}.attention.key_length" not in md:
            raise EngineError("invalid_gguf", f"{a}.embedding_length ({self.n_embd}) is not a multiple of "
                              f"{a}.attention.head_count ({self.n_head})")
        self.head_dim = hp_int(md, f"{a}.attention.key_length", self.n_embd // self.n_head)
        self.head_dim_v = hp_int(md, f"{a}.attention.value_length", self.head_dim)
        if self.head_dim_v != self.head_dim:
            raise EngineError("invalid_gguf", f"{a}: key_length != value_length is not supported")
        self.n_rot = hp_int(md, f"{a}.rope.dimension_count", self.head_dim)
        if self.n_rot > self.head_dim or self.n_rot % 2:
            raise EngineError("invalid_gguf", f"{a}.rope.dimension_count ({self.n_rot}) must be even and <= "
                              f"the head size {self.head_dim}")
        self.eps = hp_float(md, f"{a}.attention.layer_norm_rms_epsilon")
        self.rope_base = hp_float(md, f"{a}.rope.freq_base", 10000.0)
        self.rope_scale = rope_freq_scale(md, a)

    def _embedding_weights(self) -> Weights:
        """``tok_embd`` ``[n_vocab, n_embd]``, ``output_norm`` ``[n_embd]`` and, when the
        file has it, ``output`` ``[n_vocab, n_embd]``; n_vocab from ``token_embd.weight``."""
        E, t = self.n_embd, self.tensor
        tok = self.gguf.tensors.get("token_embd.weight")
        if tok is None:
            raise EngineError("invalid_gguf", f"{self.gguf.path}: missing tensor 'token_embd.weight'")
        n_vocab = tok.np_shape[0]
        w: Weights = {
            "tok_embd": self.matrix("token_embd.weight", (n_vocab, E)),  # [n_vocab, n_embd]
            "output_norm": t("output_norm.weight", (E,)),      # [n_embd]
        }
        if self.has_tensor("output.weight"):
            w["output"] = self.matrix("output.weight", (n_vocab, E))     # [n_vocab, n_embd]
        return w

    def _qkv_weights(self, p: str) -> tuple[QWeight | np.ndarray, QWeight | np.ndarray, QWeight | np.ndarray]:
        """Block ``p``'s (e.g. ``"blk.3."``) Wq ``[n_head*hd, n_embd]``, Wk and Wv ``[n_kv*hd, n_embd]``."""
        E, hd, t = self.n_embd, self.head_dim, self.matrix
        return (t(p + "attn_q.weight", (self.n_head * hd, E)),      # [n_head*hd, n_embd]
                t(p + "attn_k.weight", (self.n_head_kv * hd, E)),   # [n_kv*hd, n_embd]
                t(p + "attn_v.weight", (self.n_head_kv * hd, E)))   # [n_kv*hd, n_embd]

    def _gated_ffn_weights(self, p: str) -> dict[str, Matrix]:
        """Block ``p``'s ``wgu`` (gate rows, then up rows) ``[2*n_ff, n_embd]`` and ``wdown`` ``[n_embd, n_ff]``."""
        E, nff, t = self.n_embd, self.n_ff, self.matrix
        return {
            p + "wgu": fuse_rows([t(p + "ffn_gate.weight", (nff, E)),
                                  t(p + "ffn_up.weight", (nff, E))]),  # [2*n_ff, n_embd]
            p + "wdown": t(p + "ffn_down.weight", (E, nff)),           # [n_embd, n_ff]
        }

    def _layer_weights(self, names: Sequence[str]) -> list[tuple[Any, ...]]:
        """Per layer, the prepared arrays ``blk.{i}.{name}`` in the order of ``names``."""
        return [tuple(self.w[f"blk.{i}.{n}"] for n in names) for i in range(self.n_layer)]

    # -- weights ----------------------------------------------------------

    def _load_weights(self, weight_cache: bool | None) -> Weights:
        if weight_cache is None:
            weight_cache = os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        use_cache = weight_cache and self.dtype == np.float32 and self.gguf.file_size >= WEIGHT_CACHE_MIN_BYTES
        # the quantized form's version too: entries of another form live beside it, not over it
        layout = f"{self.arch}-v{self.layout_version}-{self.weights}" + (
            f"-{quant_format()}" if self.weights == "quantized" else "")
        if use_cache:
            # the cache is keyed by the content fingerprint; a file never seen before (no memo:
            # gguf_loader hashes it in the background) cannot have a cache entry we could find
            # without waiting for the hash, so its weights are built and the write waits instead
            t0 = time.perf_counter()
            fp = self.gguf.fingerprint_nowait()
            self.load_timings["fingerprint"] = time.perf_counter() - t0
            if fp is not None:
                t0 = time.perf_counter()
                cached = WeightCache(fp, layout).load()
                self.load_timings["cache_read"] = time.perf_counter() - t0
                if cached is not None:
                    self.weights_from_cache = True
                    return cached
        self.weights_from_cache = False
        t0 = time.perf_counter()
        arrays = self._build_weights()
        self.load_timings["dequantize"] = time.perf_counter() - t0
        self.gguf.release_pages()  # the weights are copies: the file's pages need not stay resident
        if use_cache:
            def save() -> None:
                try:
                    fp = self.gguf.fingerprint
                except EngineError:
                    return  # the file was closed first: nothing to key the entry by
                WeightCache(fp, layout).save(arrays)

            if self._cache_write == "sync":
                t0 = time.perf_counter()
                save()
                self.load_timings["cache_write"] = time.perf_counter() - t0
            else:
                self._cache_thread = threading.Thread(target=save, daemon=True, name="modelyard-weight-cache-write")
                self._cache_thread.start()
        if self.dtype != np.float32:
            arrays = {k: v.astype(self.dtype) for k, v in arrays.items()}
        return arrays

    def matrix(self, name: str, shape: Sequence[int]) -> QWeight | np.ndarray:
        """A weight matrix ``[out, in]`` as the model multiplies with it: a :class:`~.quant.QWeight`
        on the quantized path when the tensor's type has an int8 form, else dequantized float32.

        Raises: EngineError("invalid_gguf") if missing or of another shape.
        """
        info = self.gguf.tensors.get(name)
        if self.weights == "quantized" and info is not None and len(shape) == 2 \
                and tuple(info.np_shape) == tuple(shape) and quant_supports(info.type.name):
            w = QWeight.from_raw(info.type.name, self.gguf.raw(name), int(shape[0]), int(shape[1]))
            self._tensor_prepared()
            return w
        return self.tensor(name, shape)

    def tensor(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """Dequantized float32 GGUF tensor, checked against the expected numpy shape.

        Raises: EngineError("invalid_gguf") if missing or of another shape.
        """
        info = self.gguf.tensors.get(name)
        if info is None:
            raise EngineError("invalid_gguf", f"{self.gguf.path}: missing tensor {name!r} "
                              f"(required by architecture {self.arch!r})")
        if tuple(info.np_shape) != tuple(shape):
            raise EngineError("invalid_gguf", f"{self.gguf.path}: tensor {name!r} has shape "
                              f"{list(info.np_shape)}, expected {list(shape)}")
        arr = self.gguf.tensor(name)
        self._tensor_prepared()
        return arr

    def _tensor_prepared(self) -> None:
        """One more GGUF tensor prepared into the weights: tell the load's progress callback."""
        if self._progress is not None:
            self._tensors_done += 1
            self._progress("preparing_tensors", self._tensors_done, len(self.gguf.tensors))

    def has_tensor(self, name: str) -> bool:
        return self.gguf.has_tensor(name)

    def wait_weight_cache(self, timeout: float | None = None) -> bool:
        """Wait for a background ``.npy`` cache write to finish; True when none is running."""
        th = self._cache_thread
        if th is not None:
            th.join(timeout)
            if th.is_alive():
                return False
            self._cache_thread = None
        return True

    # -- public API ---------------------------------------------------------

    @property
    def n_past(self) -> int:
        """Tokens in the single-sequence path's KV entry (``self.cache``)."""
        return self.cache.n_past

    def forward_batch(self, tokens: np.ndarray, batch: AttnBatch, rows: np.ndarray | Sequence[int]) -> np.ndarray:
        """One forward pass over a flat batch of several sequences' tokens.

        Args:
            tokens: ``[N]`` int64 ids, already checked to be in ``[0, n_vocab)``.
            batch: segments (which rows belong to which KV entry, at which
                positions) with ``sum(n) == N``; every position ``< n_ctx`` and
                within its entry's capacity.
            rows: indices into ``0..N-1`` whose logits are wanted.
        Returns:
            logits ``[len(rows), n_vocab]`` float32 (float64 model: float64).
        Writes each segment's K/V at positions ``pos0 .. pos0+n-1`` of its entry;
        it does not touch ``entry.tokens`` (the caller appends them once this returned).
        """
        if int(batch.positions.max(initial=-1)) >= self.n_ctx:
            raise EngineError("context_length_exceeded", f"position beyond the context of {self.n_ctx} tokens")
        out_rows = np.asarray(rows, dtype=np.int64)
        segs = batch.segments                                   # the sequences' micro-batches, as llama.cpp sees them
        token = row_groups([s.n for s in segs], [s.ub_rows for s in segs], [s.ubatch_row for s in segs])
        n_rows = int(tokens.shape[0])
        ceiling = thread_ceiling() if self.weights == "quantized" else 1
        n_threads = self.threads.choose(ceiling, n_rows)       # the numba kernels' threads for this pass
        if ceiling > 1:
            use_threads(n_threads)
        t0 = time.perf_counter()
        try:
            h = self._forward_hidden(tokens, batch, out_rows)   # [R, n_embd]
            logits = self._output(h)                            # [R, n_vocab]
        finally:
            _SEQ_ROWS.reset(token)
        if ceiling > 1:
            self.threads.record(ceiling, n_rows, n_threads, time.perf_counter() - t0)
        return logits

    def _keep_output_rows(self, batch: AttnBatch, rows: np.ndarray, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
        """The last block's rows after attention, as llama.cpp keeps them (``ggml_get_rows(cur,
        inp_out_ids)`` before the last FFN, llama-graph's ``inp_out_ids``): each ``x[rows]``, and
        the matmuls that follow see each sequence's output rows as its batch (their kernels
        depend on the row count). ``rows`` int ``[R]``, ascending."""
        starts = np.array([s.start for s in batch.segments], dtype=np.int64)
        seg = np.searchsorted(starts, rows, side="right") - 1                   # [R] segment of each row
        row_groups(np.bincount(seg, minlength=len(starts))[np.unique(seg)])    # reset with the pass's token
        return tuple(x[rows] for x in xs)

    def forward(self, tokens: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Single-sequence path: append ``tokens`` to ``self.cache`` at positions
        ``n_past .. n_past+T-1`` and return logits (tests and benchmarks).

        Args:
            tokens: ``T >= 1`` token ids (Python ints or a 1-D integer array).
            all_logits: return logits for every position instead of the last.
        Returns:
            logits ``[n_vocab]`` of the last token, or ``[T, n_vocab]`` if
            ``all_logits``; float32 (float64 for a float64 model), C-contiguous.
        Raises:
            EngineError("invalid_token"): an id outside ``[0, n_vocab)`` or not an integer.
            EngineError("invalid_params"): no tokens, or not a 1-D sequence.
            EngineError("context_length_exceeded"): ``n_past + T > n_ctx``.
        On any exception ``n_past`` is unchanged.
        """
        ids = self._check_tokens(tokens)
        t = ids.shape[0]
        pos0 = self.cache.n_past
        if pos0 + t > self.n_ctx:
            raise EngineError("context_length_exceeded",
                              f"cannot add {t} tokens at position {pos0}: the context holds {self.n_ctx} tokens")
        batch = AttnBatch([Segment(self.cache, 0, t, pos0)], self.dtype)
        logits = self.forward_batch(ids, batch, np.arange(t) if all_logits else [t - 1])  # [T or 1, n_vocab]
        self.cache.tokens.extend(int(i) for i in ids)
        return logits if all_logits else logits[0]

    def _output(self, h: np.ndarray) -> np.ndarray:
        """Output projection ``h @ W_out.T`` (tied to ``token_embd`` when no ``output.weight``)."""
        w = self.w["output"] if "output" in self.w else self.w["tok_embd"]  # [n_vocab, n_embd]
        return np.ascontiguousarray(linear(h, w))  # [T, n_vocab], rows contiguous for the samplers

    def truncate(self, n: int) -> None:
        """Single-sequence path: keep the first ``n`` cached positions (``0 <= n <= n_past``).

        Raises: EngineError("invalid_params") otherwise.
        """
        self.cache.truncate(n)

    def reset(self) -> None:
        """Single-sequence path: empty the KV cache."""
        self.cache.tokens.clear()

    def _check_tokens(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        if isinstance(tokens, np.ndarray):
            arr = tokens
        else:
            if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
                raise EngineError("invalid_params", f"tokens must be a sequence of ints, got {type(tokens).__name__}")
            for tok in tokens:
                if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                    raise EngineError("invalid_token", f"token ids must be integers, got {tok!r}")
            try:
                arr = np.array(tokens, dtype=np.int64)
            except OverflowError:
                raise EngineError("invalid_token", "token id out of range") from None
        if arr.ndim != 1:
            raise EngineError("invalid_params", f"tokens must be 1-D, got shape {arr.shape}")
        if arr.shape[0] == 0:
            raise EngineError("invalid_params", "forward needs at least one token")
        if arr.dtype.kind not in "iu":
            raise EngineError("invalid_token", f"token ids must be integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.n_vocab)
        if bad.any():
            tok = int(arr[np.argmax(bad)])
            raise EngineError("invalid_token", f"token id {tok} is outside the vocabulary [0, {self.n_vocab})")
        return arr.astype(np.int64, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, n_past={self.n_past})"


def fuse_rows(parts: Sequence[QWeight | np.ndarray]) -> Matrix:
    """Stack ``[out_i, in]`` matrices into one ``[sum(out_i), in]`` (C-contiguous float32, one
    QWeight when the quantized parts are compatible, else a QConcat; :func:`worker.engine.kernels.quant.fuse`)."""
    return fuse(parts)


__all__ = [
    "ARCHITECTURES", "AttnBatch", "DEFAULT_MAX_CTX", "DEFAULT_WEIGHTS", "LoadProgressFn", "Matrix", "Model", "RopeTable", "Segment",
    "WEIGHT_MODES", "WeightCache", "Weights", "attention", "attention_mask", "embed", "fuse_rows", "gated_ffn", "gelu_tanh",
    "gelu_tanh_ggml", "glu_ggml", "silu_ggml", "hp_float", "hp_int", "linear", "load_model", "register", "rms_norm",
    "rope_freq_scale", "silu",
]
