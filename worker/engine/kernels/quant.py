"""Quantized weights held in memory, and the kernels that multiply with them: llama.cpp's
CPU kernels on this machine kind (x86-64, AVX2 / AVX-512 VNNI, b11434) reproduced bit for bit.

The activations are first quantized per block to the type ggml pairs with the weight type
(``type_traits_cpu[type].vec_dot_type``: Q8_0 for Q8_0/Q4_0/Q5_0, Q8_1 for Q4_1/Q5_1, Q8_K
for the K-quants) with ggml's rounding rules (``quantize_row_q8_0`` / ``_q8_1`` of ggml-cpu's
x86 path: ``d = amax/127`` stored as fp16, ``q = rint(x * 127/amax)``;
``quantize_row_q8_K_ref``: ``d = max / -127`` in float32, ``q = min(127, nearest_int(x /
d))``). Integer dot products are exact; what decides the result is how llama.cpp combines
them with the scales in float32, which differs by kernel, and each form here follows one:

* the 32-block types (:data:`LANE_TYPES`, form ``"lanes"``): ggml's AVX2 ``vec_dot`` (and
  llamafile's tinyBLAS from two rows on, which sums alike) — eight float32 lanes of four
  elements per block accumulated by FMA, ``hsum_float_8``, plus the offset sum;
* Q4_K (``"q4k"``): llama.cpp repacks it on AVX2 machines; its gemv sums per super-block,
  its gemm (the first ``n - n % 4`` rows of a batch) per pair of sub-blocks;
* Q6_K (``"q6k"``): ``vec_dot``'s eight integer lanes below :data:`TILED_MIN_ROWS` rows, the
  tiled kernel's per-super-block FMA from there on.

llama.cpp picks by the row count of a matmul, which for a sequence alone is its own batch:
the model declares its sequences around a forward pass (:func:`row_groups`) and each row
gets the kernel llama.cpp would run for its sequence, so a sequence's results do not depend
on the other sequences of the pass. Tested against independent ports of those kernels and,
end to end, against llama.cpp's recorded logprobs of both shipped models (identical).

Two implementations of each kernel give the same bits (tested ``==`` at every row count and
mode): the reference ones (``quant_kernels.matmul_lanes`` / ``matmul_q4k`` / ``matmul_q6k``,
plain numba loops, on forms ``"lanes"`` / ``"q4k"`` / ``"q6k"``) and, where the CPU has
AVX512-VNNI (:func:`host_has_vnni`; ``MODELYARD_QUANT_VNNI=0`` keeps the reference), the VNNI
ones (``*_vnni``, forms ``"vlanes"`` / ``"vlanes4"`` / ``"vq4k"`` / ``"vq6k"``): the exact integer
parts by ``vpdpbusd`` on 16 output rows interleaved per vector, then the same float32
operations in the same order on explicit 16-lane vectors (:mod:`.simd`, no fast-math), several
activation rows per weight load. Q4_0 / Q4_1 are held there as packed nibbles.

Kernels are compiled once and cached on disk by numba (``cache=True``; the directory is
``NUMBA_CACHE_DIR`` or ``__pycache__`` beside this file).

Types with a kernel here: F32/F16/BF16 are kept as float32 arrays (no QWeight); Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q6_K become QWeights; any other type (Q2_K, Q3_K, Q5_K, IQ*) is
dequantized to float32 by the gguf package (:func:`supports`). Not reproduced: a Q4_K matrix
whose row count does not divide by 8 (llama.cpp does not repack it; it is multiplied here as
if it had been).
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import EngineError

QK = 32     # block of Q8_0 / Q4_* / Q5_*
QK_K = 256  # super-block of the K-quants

#: Types multiplied in the "lanes" form (:func:`to_lanes`), summed exactly as ggml's x86 AVX2
#: vec_dot / tinyBLAS kernels sum them (eight float32 lanes of four elements per block).
LANE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
#: Output rows interleaved in the lanes form (one 16-float vector per lane update).
LANE_ROWS = 16

#: ggml type name -> activation quantization ggml pairs with it (``vec_dot_type``).
ACT_TYPE = {"Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
            "Q4_K": "q8_K", "Q6_K": "q8_K"}


def supports(type_name: str) -> bool:
    """True when a tensor of this ggml type (``GGMLQuantizationType.name``) is held as a :class:`QWeight`."""
    return type_name in ACT_TYPE


# ------------------------------------------------------------------ GGUF blocks -> (q, d, m)

def _f16(raw: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 2]`` little-endian fp16 -> float32 ``[...]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def unpack(type_name: str, raw: np.ndarray, n_rows: int, n_cols: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Unpack a GGUF tensor of a 32-block type (:data:`LANE_TYPES`) into ``(q, d, m, B)``; the
    K-quants' stored form is :func:`kquant_parts` (their plain levels: ``QWeight.plain``).

    Args:
        type_name: ggml type (one of :data:`LANE_TYPES`).
        raw: uint8 ``[n_rows, bytes_per_row]`` stored bytes (``GGUFFile.raw``).
        n_rows, n_cols: the matrix shape ``[out, in]``; ``n_cols`` a multiple of the block size.
    Returns:
        q int8 ``[n_rows, nb, B]``, d float32 ``[n_rows, nb]``, m float32 ``[n_rows, nb]`` or None, B.
    Source: ggml ``block_*`` layouts (ggml-common.h) and ``dequantize_row_*`` (ggml-quants.c).
    Raises: EngineError("invalid_gguf") for a type without an int8 form or a size mismatch.
    """
    R = n_rows
    nsb = n_cols // QK
    if n_cols % QK:
        raise EngineError("invalid_gguf", f"{type_name} row of {n_cols} is not a multiple of {QK}")
    bsize = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}.get(type_name)
    if bsize is None:
        raise EngineError("invalid_gguf", f"tensor type {type_name} has no int8 form")
    if raw.shape != (R, nsb * bsize):
        raise EngineError("invalid_gguf", f"{type_name} tensor of {R}x{n_cols} has {raw.shape} bytes")
    b = raw.reshape(R, nsb, bsize)
    m: np.ndarray | None = None
    if type_name == "Q8_0":
        d = _f16(b[..., 0:2])                                        # [R, nb]
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8)           # [R, nb, 32]
        return q, d, None, QK
    # Q4_0, Q4_1, Q5_0, Q5_1
    d = _f16(b[..., 0:2])                                        # [R, nb]
    off = 2
    if type_name in ("Q4_1", "Q5_1"):
        m = _f16(b[..., 2:4])
        off = 4
    qh = None
    if type_name in ("Q5_0", "Q5_1"):
        qh = np.ascontiguousarray(b[..., off:off + 4]).view("<u4")[..., 0]  # [R, nb] uint32
        off += 4
    qs = b[..., off:off + 16]                                    # [R, nb, 16]
    lo = (qs & 0x0F).astype(np.int16)                            # elements 0..15
    hi = (qs >> 4).astype(np.int16)                              # elements 16..31
    if qh is not None:
        bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)  # [R, nb, 32]
        lo |= bits[..., :16] << 4
        hi |= bits[..., 16:] << 4
    q16 = np.concatenate([lo, hi], axis=-1)                      # [R, nb, 32]
    if type_name == "Q4_0":
        q16 -= 8
    elif type_name == "Q5_0":
        q16 -= 16
    return q16.astype(np.int8), d, m, QK


# ------------------------------------------------------------------ numba kernels

_kernels: dict[str, Any] = {}
_threads: int | None = None  # the share asked for before numba was imported


def _compile() -> dict[str, Any]:
    """The kernels (compiled on first use, or loaded from numba's on-disk cache), once per process."""
    if not _kernels:
        from . import quant_kernels as k
        _kernels.update(quant_q8_0=k.quant_q8_0, quant_q8_K=k.quant_q8_K, matmul_lanes=k.matmul_lanes,
                        matmul_q4k=k.matmul_q4k, matmul_q6k=k.matmul_q6k, cos_sin_f32=k.cos_sin_f32,
                        matmul_lanes_vnni=k.matmul_lanes_vnni, matmul_q4k_vnni=k.matmul_q4k_vnni,
                        matmul_q6k_vnni=k.matmul_q6k_vnni, lane_levels=k.lane_levels,
                        quant_q8_K_int=k.quant_q8_K_int, matmul_kq_x=k.matmul_kq_x, kq_levels=k.kq_levels,
                        matmul_lanes_x=k.matmul_lanes_x)
        if _threads is not None:
            set_num_threads(_threads)
    return _kernels


def set_num_threads(n: int) -> None:
    """Threads of the numba kernels for calls from the calling thread (numba's setting is per
    thread: call it on the thread that runs the model), at most ``NUMBA_NUM_THREADS``.

    Before the kernels are first used (numba not imported: it costs ~90 MiB and 0.4 s, which
    a float32-only worker never pays) the value is kept and applied at first use."""
    global _threads
    _threads = int(n)
    if not _kernels:
        return
    import numba
    _applied.n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(_applied.n)


def thread_ceiling() -> int:
    """The most threads a forward pass may use: the share given by :func:`set_num_threads`, at
    most numba's thread count (``NUMBA_NUM_THREADS``; 1 before the kernels are loaded)."""
    if not _kernels:
        return 1
    import numba
    top = numba.config.NUMBA_NUM_THREADS
    return max(1, min(top, _threads)) if _threads is not None else top


def use_threads(n: int) -> None:
    """Run the kernels called from this thread on ``n`` threads (a pass's choice, at most
    :func:`thread_ceiling`; numba's setting is per calling thread). No-op before the kernels
    are loaded."""
    if _kernels and getattr(_applied, "n", None) != n:
        import numba
        numba.set_num_threads(n)
        _applied.n = n


_applied = threading.local()   # the count use_threads last set on each thread


_NO_M3 = np.zeros((0, 0, 0), np.float32)
_NO_M3.flags.writeable = False
_NO_M3_H = np.zeros((0, 0, 0), np.uint16)   # the VNNI forms' (fp16 bits)
_NO_M3_H.flags.writeable = False


def quantize_activations(x: np.ndarray, act: str, with_s: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize activation rows as ggml does before a vec_dot.

    Args:
        x: float32 ``[T, K]``.
        act: ``"q8_0"``, ``"q8_1"`` or ``"q8_K"``.
        with_s: also compute ``s = d * sum(q)`` per 32-block (needed by weights with an offset).
    Returns:
        xq float32 ``[T, K]`` (the integer levels ``q``), dx float32 ``[T, K/32]`` (the scale
        ``d`` of each 32-block: fp16-rounded for q8_0/q8_1, the super-block's for q8_K),
        xs float32 ``[T, K/32]`` (``s``; zeros when not ``with_s``). ``xq * dx`` is the
        dequantized activation.
    """
    k = _compile()
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    xq = np.empty_like(x)
    dx = np.empty((T, K // QK), np.float32)
    xs = np.zeros((T, K // QK), np.float32)
    if act == "q8_K":
        k["quant_q8_K"](x, xq, dx, xs)
    else:
        k["quant_q8_0"](x, xq, dx, xs, with_s or act == "q8_1", act == "q8_1")
    return xq, dx, xs


def quantize_q8_K_int(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`quantize_activations` ``(x, "q8_K", ...)`` in the form the VNNI K-quant kernels read,
    in one pass: x float32 ``[T, K]`` -> the levels int8 ``[T, K]``, the super-block scales
    ``d`` float32 ``[T, K/256]`` and the levels' sums per 16, int32 ``[T, K/16]`` (the same values,
    tested ``==``)."""
    k = _compile()
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    xi = np.empty((T, K), np.int8)
    dy = np.empty((T, K // QK_K), np.float32)
    bs16 = np.empty((T, K // 16), np.int32)
    k["quant_q8_K_int"](x, x.view(np.int32), xi, dy, bs16)
    return xi, dy, bs16


def cos_sin_libm(ang: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(cosf(ang), sinf(ang))`` float32, shaped as ``ang`` (float32): the C library's own
    functions, as ggml's RoPE calls them (through the numba kernels)."""
    ang = np.ascontiguousarray(ang, dtype=np.float32)
    cos, sin = np.empty_like(ang), np.empty_like(ang)
    _compile()["cos_sin_f32"](ang, cos, sin)
    return cos, sin


#: Version of the in-memory forms below, recorded in the weight cache's manifest (a cache of
#: another version is rebuilt).
FORMAT_VERSION = 10

#: Environment switch: ``MODELYARD_QUANT_VNNI=0`` keeps the reference forms and kernels on a CPU
#: with AVX512-VNNI or AVX2 (same bits, slower); on any other CPU they are the only ones.
VNNI_ENV = "MODELYARD_QUANT_VNNI"
_vnni: bool | None = None


def host_has_vnni() -> bool:
    """Whether the VNNI forms and their vector kernels are used: the CPU numba compiles for (the
    host, unless ``NUMBA_CPU_NAME`` names another) has AVX512-VNNI (with F and BW), or AVX2 with
    FMA and F16C (the kernels' integer dot products then lowered to ``vpmaddubsw`` +
    ``vpmaddwd``, as ggml's AVX2 kernels take them: :data:`.simd.ISA`; :data:`AVX2_ENV` off keeps
    the reference there), and they are not switched off by :data:`VNNI_ENV`. Decided once per
    process (imports llvmlite, not numba)."""
    global _vnni
    if _vnni is None:
        if not _env_on(VNNI_ENV) or os.environ.get("NUMBA_CPU_NAME", "host") not in ("", "host"):
            _vnni = False
        else:
            from llvmlite import binding
            f = binding.get_host_cpu_features()
            _vnni = bool((f.get("avx512vnni") and f.get("avx512bw") and f.get("avx512f"))
                         or (f.get("avx2") and f.get("fma") and f.get("f16c") and _env_on(AVX2_ENV)))
    return _vnni


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


#: Environment switch: ``MODELYARD_VECTOR_AVX2=0`` keeps the reference forms and kernels on a CPU
#: with AVX2 but not AVX512-VNNI (same bits, slower); AVX512-VNNI hosts use the vector kernels
#: whatever it says (:data:`VNNI_ENV` turns them off everywhere).
AVX2_ENV = "MODELYARD_VECTOR_AVX2"


def format_tag() -> str:
    """The weight cache's tag of the quantized forms this process builds (``10-vnni`` where the
    32-block types are held in the VNNI forms)."""
    return f"{FORMAT_VERSION}-vnni" if host_has_vnni() else str(FORMAT_VERSION)


#: The sequences of the current forward pass: per row, the row count of its sequence's batch
#: and its index there (int64 ``[2, N]``), set by the model around a pass (:func:`row_groups`).
#: llama.cpp picks some kernels by a matmul's row count, which for a sequence alone is its own
#: chunk: the kernels here choose per row what llama.cpp would run for that sequence. Unset, a
#: call's rows are taken as one sequence.
_SEQ_ROWS: contextvars.ContextVar[np.ndarray | None] = contextvars.ContextVar("seq_rows", default=None)
#: From this many rows of a batch on, llama.cpp multiplies a non-repacked K-quant (Q6_K here) in
#: its tiled kernel (ggml-cpu/tiled/tiled.cpp ``ggml_tiled_min_batch``), below it by ``vec_dot``.
TILED_MIN_ROWS = 8


def row_groups(segment_rows: Sequence[int] | np.ndarray, ubatch_rows: Sequence[int] | None = None,
               ubatch_first: Sequence[int] | None = None) -> contextvars.Token:
    """Declare the rows of the next matmuls as consecutive segments of ``segment_rows[i]``
    rows (a forward pass's segments, in order); returns the token for ``_SEQ_ROWS.reset``.

    Segment ``i`` is rows ``ubatch_first[i] ..`` of a sequence's micro-batch of
    ``ubatch_rows[i]`` rows (``attention.Segment.ubatch``: a micro-batch run in slices over
    several passes); the kernels choose as for that whole micro-batch. None: each segment is
    its own micro-batch."""
    n = np.asarray(segment_rows, dtype=np.int64)
    ub = n if ubatch_rows is None else np.asarray(ubatch_rows, dtype=np.int64)
    first = np.zeros_like(n) if ubatch_first is None else np.asarray(ubatch_first, dtype=np.int64)
    if not n.size:
        return _SEQ_ROWS.set(np.zeros((2, 0), np.int64))
    return _SEQ_ROWS.set(np.stack([np.repeat(ub, n), np.concatenate([f + np.arange(k) for f, k in zip(first, n)])]))


def _seq_rows(T: int) -> np.ndarray:
    rows = _SEQ_ROWS.get()
    if rows is None or rows.shape[1] != T:
        rows = np.stack([np.full(T, T), np.arange(T)])
    return rows


#: (the declared rows object, T, gemm_rows, tiled_rows) of the last call: every matmul of a pass
#: asks the same, so they are computed once per pass (a tuple: replaced whole, read whole)
_ROW_FLAGS: tuple[Any, int, np.ndarray, np.ndarray] = (None, -1, np.zeros(0, np.uint8), np.zeros(0, np.uint8))


def _row_flags(T: int) -> tuple[np.ndarray, np.ndarray]:
    global _ROW_FLAGS
    declared = _SEQ_ROWS.get()
    c = _ROW_FLAGS
    if c[0] is declared and c[1] == T:
        return c[2], c[3]
    n, idx = _seq_rows(T)
    gemm = (idx < n - n % 4).astype(np.uint8)
    tiled = (n >= TILED_MIN_ROWS).astype(np.uint8)
    _ROW_FLAGS = (declared, T, gemm, tiled)
    return gemm, tiled


def gemm_rows(T: int) -> np.ndarray:
    """uint8 ``[T]``: 1 where llama.cpp's repacked Q4_K gemm takes the row (the first ``n - n % 4``
    rows of a sequence's batch of ``n``), 0 where its gemv does (shared by the pass's matmuls: not to be written)."""
    return _row_flags(T)[0]


def tiled_rows(T: int) -> np.ndarray:
    """uint8 ``[T]``: 1 where llama.cpp's tiled K-quant matmul takes the row (its sequence's batch
    has at least :data:`TILED_MIN_ROWS` rows), 0 where ``vec_dot`` does (shared: not to be written)."""
    return _row_flags(T)[1]


def kquant_parts(type_name: str, raw: np.ndarray, n_rows: int, n_cols: int) -> dict[str, np.ndarray]:
    """The kernel form of a Q4_K / Q6_K tensor from its stored bytes (uint8 ``[n_rows, bytes]``).

    Q4_K: ``q`` uint8 ``[O, nsb, 128]`` (the stored nibbles), ``sc`` / ``mn`` uint8 ``[O, nsb, 8]``
    (the 6-bit sub-block scales and mins, ``get_scale_min_k4``), ``d`` / ``m`` float32 ``[O, nsb]``
    (the super-block's fp16 ``d`` and ``dmin``). Q6_K: ``q`` uint8 ``[O, nsb, 256]`` (the 6-bit
    levels, unsigned 0..63), ``sc`` int8 ``[O, nsb, 16]``, ``d`` float32 ``[O, nsb]``.
    Source: ggml-common.h ``block_q4_K`` / ``block_q6_K``, ggml-quants.c ``dequantize_row_*``.
    Raises: EngineError("invalid_gguf") on a size mismatch.
    """
    R, nsb = n_rows, n_cols // QK_K
    bsize = {"Q4_K": 144, "Q6_K": 210}[type_name]
    if n_cols % QK_K or raw.shape != (R, nsb * bsize):
        raise EngineError("invalid_gguf", f"{type_name} tensor of {R}x{n_cols} has {raw.shape} bytes")
    b = raw.reshape(R, nsb, bsize)
    if type_name == "Q4_K":
        s = b[..., 4:16].astype(np.uint8)                             # [R, nsb, 12]
        sc = np.empty((R, nsb, 8), np.uint8)
        mn = np.empty((R, nsb, 8), np.uint8)
        sc[..., :4] = s[..., 0:4] & 63
        mn[..., :4] = s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        return {"q": np.ascontiguousarray(b[..., 16:144]), "sc": sc, "mn": mn,
                "d": _f16(b[..., 0:2]), "m": _f16(b[..., 2:4])}
    ql = b[..., 0:128].reshape(R, nsb, 2, 64)                          # per 128-half: 64 bytes
    qh = b[..., 128:192].reshape(R, nsb, 2, 32)                        # per 128-half: 32 bytes
    q = np.empty((R, nsb, 2, 4, 32), np.uint8)
    q[..., 0, :] = (ql[..., 0:32] & 0x0F) | (((qh >> 0) & 3) << 4)
    q[..., 1, :] = (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4)
    q[..., 2, :] = (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q[..., 3, :] = (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    return {"q": q.reshape(R, nsb, 256), "sc": np.ascontiguousarray(b[..., 192:208]).view(np.int8),
            "d": _f16(b[..., 208:210])}


def lane_order(a: np.ndarray) -> np.ndarray:
    """``[..., 32]`` blocks in element order -> lane order: position ``8j + l`` holds element
    ``4l + j`` (lane l of ggml's AVX2 dot products sums elements 4l..4l+3). A copy."""
    sh = a.shape
    return np.ascontiguousarray(a.reshape(sh[:-1] + (8, 4)).swapaxes(-1, -2)).reshape(sh)


def element_order(a: np.ndarray) -> np.ndarray:
    """Inverse of :func:`lane_order`. A copy."""
    sh = a.shape
    return np.ascontiguousarray(a.reshape(sh[:-1] + (4, 8)).swapaxes(-1, -2)).reshape(sh)


def to_lanes(q: np.ndarray, d: np.ndarray, m: np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Plain ``q`` int8 ``[O, nb, 32]``, ``d``/``m`` float32 ``[O, nb]`` -> the lanes form:
    ``wi`` int8 ``[ng, nb, 32, LANE_ROWS]`` (lane-ordered blocks, rows interleaved by
    :data:`LANE_ROWS`), ``d``/``m`` float32 ``[ng, nb, LANE_ROWS]``; ``O`` padded with zero rows to
    ``ng * LANE_ROWS``."""
    return _interleave(lane_order(q)), _interleave(d), None if m is None else _interleave(m)


def _interleave(a: np.ndarray) -> np.ndarray:
    """``[O, ...]`` -> ``[ng, ..., LANE_ROWS]``: rows interleaved by 16, ``O`` padded with zeros."""
    G = LANE_ROWS
    ng = -(-a.shape[0] // G)
    if ng * G != a.shape[0]:
        a = np.concatenate([a, np.zeros((ng * G - a.shape[0],) + a.shape[1:], a.dtype)])
    return np.ascontiguousarray(np.moveaxis(a.reshape((ng, G) + a.shape[1:]), 1, -1))


def to_f16_bits(a: np.ndarray) -> np.ndarray:
    """float32 scales -> uint16 IEEE binary16 bit patterns of the same shape (the VNNI forms'
    ``d`` / ``m``, widened back exactly by ``simd.vload_h``). Every scale of a GGUF block type is
    stored as fp16, so this is exact; raises EngineError("invalid_params") for a value binary16
    cannot hold exactly (never the case for scales read from a GGUF)."""
    h = np.ascontiguousarray(a, dtype=np.float32).astype(np.float16)
    if not np.array_equal(h.astype(np.float32), a, equal_nan=True):
        raise EngineError("invalid_params", "a block scale is not an fp16 value")
    return h.view(np.uint16)


def from_f16_bits(a: np.ndarray) -> np.ndarray:
    """Inverse of :func:`to_f16_bits`: uint16 binary16 bits -> float32 (exact), C-contiguous."""
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def from_lanes(wi: np.ndarray, d: np.ndarray, m: np.ndarray | None, rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The plain ``(q [n, nb, 32], d [n, nb], m)`` of ``rows`` (int ``[n]``) of a lanes form."""
    g, i = np.divmod(np.asarray(rows, dtype=np.int64), LANE_ROWS)
    return (element_order(wi[g, :, :, i]), np.ascontiguousarray(d[g, :, i]),
            None if m is None else np.ascontiguousarray(m[g, :, i]))


#: The 32-block types held as packed nibbles in the VNNI form (``"vlanes4"``); the others as bytes.
PACKED_TYPES = ("Q4_0", "Q4_1")


def _nibble_bias(m: np.ndarray | None) -> int:
    # the stored 4-bit value of the packed form is level + 8 for Q4_0 (no offset), the level for Q4_1
    return 8 if m is None else 0


def to_vlanes(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, packed: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Plain ``q`` int8 ``[O, nb, 32]``, ``d``/``m`` float32 ``[O, nb]`` -> the VNNI forms
    (``quant_kernels._vl_group``): ``w`` uint8 ``[ng, nb, 8, 16, 4]`` (byte ``(l, i, k)`` of block b
    = level + 128 of row ``16g+i``, element ``4l+k``: one vpdpbusd int32 lane per row and lane),
    or ``packed`` uint8 ``[ng, nb, 4, 16, 4]`` (low nibble: lane l, high nibble: lane l+4; the
    level + :func:`_nibble_bias`); ``d``/``m`` uint16 ``[ng, nb, LANE_ROWS]``: the fp16 bits
    (:func:`to_f16_bits`) interleaved as :func:`to_lanes`. ``O`` padded with zero rows.
    Raises: EngineError("invalid_params") if a packed level does not fit 4 bits."""
    O, nb, _ = q.shape
    G = LANE_ROWS
    ng = -(-O // G)
    qp = np.concatenate([q, np.zeros((ng * G - O, nb, 32), q.dtype)]) if ng * G != O else q
    q5 = qp.reshape(ng, G, nb, 8, 4).transpose(0, 2, 3, 1, 4).astype(np.int16)   # [ng, nb, 8, 16, 4]
    if packed:
        u = q5 + _nibble_bias(m)
        if u.min(initial=0) < 0 or u.max(initial=0) > 15:
            raise EngineError("invalid_params", "levels do not fit the packed 4-bit form")
        w = np.ascontiguousarray((u[:, :, :4] | (u[:, :, 4:] << 4)).astype(np.uint8))
    else:
        w = np.ascontiguousarray((q5 + 128).astype(np.uint8))
    return w, to_f16_bits(_interleave(d)), None if m is None else to_f16_bits(_interleave(m))


def from_vlanes(w: np.ndarray, d: np.ndarray, m: np.ndarray | None, packed: bool, rows: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The plain ``(q [n, nb, 32], d [n, nb], m)`` of ``rows`` (int ``[n]``) of a VNNI form."""
    g, i = np.divmod(np.asarray(rows, dtype=np.int64), LANE_ROWS)
    p = w[g, :, :, i, :].astype(np.int16)                                        # [n, nb, 8|4, 4]
    if packed:
        p = np.concatenate([p & 15, p >> 4], axis=2) - _nibble_bias(m)
    else:
        p = p - 128
    return (p.reshape(len(g), -1, 32).astype(np.int8), from_f16_bits(d[g, :, i]),
            None if m is None else from_f16_bits(m[g, :, i]))


#: Where each K-quant array's row axis goes in the VNNI forms (after the group axis 0), and the
#: shape of its per-row part there: ``q4k`` q ``[nsb, 4, 8, 4]`` (row axis before the last: one
#: vpdpbusd int32 lane per row), sc / mn ``[nsb, 8]``, d / m ``[nsb]`` (row axis last).
_VK_AXES = {"q": -2, "sc": -1, "mn": -1, "d": -1, "m": -1}
_VK_QSHAPE = {"q4k": (4, 8, 4), "q6k": (64, 4)}


def to_vkquant(kind: str, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`kquant_parts` arrays (``kind`` ``"q4k"`` / ``"q6k"``) -> the VNNI form's (``"vq4k"`` /
    ``"vq6k"``, ``quant_kernels._q4k_row`` / ``_q6k_vec_row``): rows interleaved by 16 (padded with
    zero rows) on the axis :data:`_VK_AXES` names; ``d`` / ``m`` as uint16 fp16 bits (:func:`to_f16_bits`)."""
    out = {}
    for k, a in parts.items():
        O, nsb = a.shape[0], a.shape[1]
        if k == "q":
            a = a.reshape((O, nsb) + _VK_QSHAPE[kind])
        ng = -(-O // LANE_ROWS)
        if ng * LANE_ROWS != O:
            a = np.concatenate([a, np.zeros((ng * LANE_ROWS - O,) + a.shape[1:], a.dtype)])
        a = a.reshape((ng, LANE_ROWS) + a.shape[1:])
        out[k] = np.ascontiguousarray(np.moveaxis(a, 1, _VK_AXES[k]))
        if k in ("d", "m"):
            out[k] = to_f16_bits(out[k])
        elif k == "q" and kind == "q6k":
            out[k] = pack_q6(out[k])
    return out


def pack_q6(lv: np.ndarray) -> np.ndarray:
    """The "vq6k" levels uint8 ``[ng, nsb, 64, 16, 4]`` (byte ``(e4, i, k)`` = the 6-bit level of row
    ``16g+i``, element ``4*e4+k``; ``e4 = 8v + l``: lane l of 32-element group v) -> the packed
    form the kernels read, uint8 ``[ng, nsb, 3072]`` (192 bytes per row and super-block, as the
    GGUF's ``ql`` + ``qh``): bytes ``0..2047`` ``[v, l4, 16, 4]`` hold the low 4 bits of lane l4
    (low nibble) and of lane l4+4 (high nibble) of group v; bytes ``2048..3071`` ``[vp, l4, 16, 4]``
    hold the top 2 bits of (group 2vp, lane l4), (2vp, l4+4), (2vp+1, l4), (2vp+1, l4+4) in bit
    pairs 0-1, 2-3, 4-5, 6-7 (``quant_kernels._q6_chunk``)."""
    ng, nsb = lv.shape[:2]
    a = lv.reshape(ng, nsb, 8, 8, 16, 4)                              # [.., v, l, i, k]
    ql = (a[:, :, :, 0:4] & 15) | ((a[:, :, :, 4:8] & 15) << 4)     # [.., v, l4, i, k]
    h = (a >> 4).reshape(ng, nsb, 4, 2, 8, 16, 4)                    # [.., vp, v&1, l, i, k]
    qh = h[:, :, :, 0, 0:4] | (h[:, :, :, 0, 4:8] << 2) | (h[:, :, :, 1, 0:4] << 4) | (h[:, :, :, 1, 4:8] << 6)
    return np.ascontiguousarray(np.concatenate([ql.reshape(ng, nsb, 2048), qh.reshape(ng, nsb, 1024)], axis=-1),
                                dtype=np.uint8)


def unpack_q6(q: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_q6`: uint8 ``[ng, nsb, 3072]`` -> ``[ng, nsb, 64, 16, 4]``."""
    ng, nsb = q.shape[:2]
    ql = q[..., :2048].reshape(ng, nsb, 8, 4, 16, 4)
    qh = q[..., 2048:].reshape(ng, nsb, 4, 4, 16, 4)
    lv = np.empty((ng, nsb, 8, 8, 16, 4), np.uint8)
    lv[:, :, :, 0:4] = ql & 15
    lv[:, :, :, 4:8] = ql >> 4
    for par in range(2):                                             # v = 2vp + par
        lv[:, :, par::2, 0:4] |= ((qh >> (4 * par)) & 3) << 4
        lv[:, :, par::2, 4:8] |= ((qh >> (4 * par + 2)) & 3) << 4
    return lv.reshape(ng, nsb, 64, 16, 4)


def from_vkquant(kind: str, arrays: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of :func:`to_vkquant` for ``rows`` (int ``[n]``): the :func:`kquant_parts` arrays."""
    g, i = np.divmod(np.asarray(rows, dtype=np.int64), LANE_ROWS)
    n = np.arange(len(g))
    out = {}
    for k, a in arrays.items():
        a = a[g]                                   # only the rows' lane groups: [n, ...] (never the whole matrix)
        if k == "q" and kind == "q6k":
            a = unpack_q6(a)
        a = np.moveaxis(a, _VK_AXES[k], 1)[n, i]
        out[k] = (np.ascontiguousarray(a.reshape(len(g), a.shape[1], -1)) if k == "q" else
                  from_f16_bits(a) if k in ("d", "m") else np.ascontiguousarray(a))
    return out


class QWeight:
    """A quantized ``[out, in]`` weight matrix (see the module docstring), in the form its
    exact kernel reads (``kind``):

    * ``"lanes"`` (:data:`LANE_TYPES`, :func:`to_lanes`): q int8 ``[ng, nb, 32, 16]`` levels,
      d / m float32 ``[ng, nb, 16]`` (block scale / offset), rows interleaved by 16 and padded;
      ``quant_kernels.matmul_lanes``;
    * ``"q4k"`` / ``"q6k"`` (:func:`kquant_parts`): per super-block the stored levels ``q``,
      integer sub-block scales ``sc`` (and mins ``mn``), fp16 ``d`` (and ``dmin`` as ``m``);
      ``quant_kernels.matmul_q4k`` / ``matmul_q6k``;
    * the VNNI forms (CPUs with AVX512-VNNI): ``"vlanes"`` (:func:`to_vlanes`: level + 128 bytes,
      ``[ng, nb, 8, 16, 4]``), ``"vlanes4"`` (Q4_0 / Q4_1 as packed nibbles ``[ng, nb, 4, 16, 4]``),
      ``"vq4k"`` / ``"vq6k"`` (:func:`to_vkquant`: the same arrays with rows interleaved by 16);
      ``quant_kernels.matmul_lanes_vnni`` / ``matmul_q4k_vnni`` / ``matmul_q6k_vnni``. Their
      ``d`` / ``m`` are the GGUF's fp16 scales as uint16 bits (half the bytes of float32; the
      kernels widen them exactly), so a VNNI form holds the file's scale bytes.

    Attributes:
        q, d, m, sc, mn: as above (None where a form has none); n_rows: ``O``.
        act: activation quantization (``"q8_0"``, ``"q8_1"``, ``"q8_K"``).
        types: the ggml type name(s) it came from (a fused matrix may list several).
    """

    __slots__ = ("q", "d", "m", "sc", "mn", "act", "types", "kind", "n_rows")
    KINDS = ("lanes", "vlanes", "vlanes4", "q4k", "q6k", "vq4k", "vq6k")
    LANE_KINDS = ("lanes", "vlanes", "vlanes4")

    def __init__(self, kind: str, act: str, types: Sequence[str], n_rows: int, q: np.ndarray, d: np.ndarray,
                 m: np.ndarray | None = None, sc: np.ndarray | None = None, mn: np.ndarray | None = None) -> None:
        if kind not in self.KINDS:
            raise EngineError("invalid_params", f"unknown quantized form {kind!r}")
        for a in (q, d, m, sc, mn):
            if a is not None:
                a.flags.writeable = False  # immutable, and one kernel signature for built and memory-mapped weights
        self.q, self.d, self.m, self.sc, self.mn = q, d, m, sc, mn
        self.kind, self.act, self.types, self.n_rows = kind, act, tuple(types), int(n_rows)

    @classmethod
    def lanes(cls, q: np.ndarray, d: np.ndarray, m: np.ndarray | None, act: str, types: Sequence[str],
              kind: str | None = None) -> QWeight:
        """A 32-block form of plain ``q`` int8 ``[O, nb, 32]``, ``d``/``m`` ``[O, nb]``: ``kind``, or
        where the CPU has AVX512-VNNI (:func:`host_has_vnni`) ``"vlanes4"`` when every type is one
        of :data:`PACKED_TYPES` and ``"vlanes"`` otherwise, else ``"lanes"`` (the reference)."""
        if kind is None:
            kind = ("lanes" if not host_has_vnni() else
                    "vlanes4" if all(t in PACKED_TYPES for t in types) else "vlanes")
        if kind == "lanes":
            wi, di, mi = to_lanes(q, d, m)
        elif kind in ("vlanes", "vlanes4"):
            wi, di, mi = to_vlanes(q, d, m, kind == "vlanes4")
        else:
            raise EngineError("invalid_params", f"{kind!r} is not a 32-block form")
        return cls(kind, act, types, q.shape[0], wi, di, mi)

    @classmethod
    def from_raw(cls, type_name: str, raw: np.ndarray, n_rows: int, n_cols: int) -> QWeight:
        """From a GGUF tensor's stored bytes (uint8 ``[n_rows, bytes_per_row]``).
        Raises: EngineError("invalid_gguf") for a type without a kernel or a size mismatch."""
        if type_name in ("Q4_K", "Q6_K"):
            parts = kquant_parts(type_name, raw, n_rows, n_cols)
            return cls.kquant(type_name.lower().replace("_", ""), ACT_TYPE[type_name], (type_name,), n_rows, parts)
        q, d, m, _ = unpack(type_name, raw, n_rows, n_cols)
        return cls.lanes(q, d, m, ACT_TYPE[type_name], (type_name,))

    @classmethod
    def kquant(cls, kind: str, act: str, types: Sequence[str], n_rows: int, parts: dict[str, np.ndarray],
               vnni: bool | None = None) -> QWeight:
        """A K-quant weight from its :func:`kquant_parts` arrays (``kind`` ``"q4k"`` / ``"q6k"``): in
        the VNNI form (``"vq4k"`` / ``"vq6k"``) when ``vnni`` (None: :func:`host_has_vnni`)."""
        if host_has_vnni() if vnni is None else vnni:
            return cls("v" + kind, act, types, n_rows, **to_vkquant(kind, parts))
        return cls(kind, act, types, n_rows, **parts)

    def kquant_parts(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """A K-quant's :func:`kquant_parts` arrays of ``rows`` (all when None)."""
        if self.kind in ("vq4k", "vq6k"):
            return from_vkquant(self.kind[1:], self.arrays(), np.arange(self.n_rows) if rows is None else rows)
        return {k: a if rows is None else np.ascontiguousarray(a[np.asarray(rows, dtype=np.int64)])
                for k, a in self.arrays().items()}

    def plain(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(q, d, m)`` of ``rows`` (all when None) as per-block levels: q int8 ``[n, nb, B]``
        (B = 32, or 16 for Q6_K), d / m float32 ``[n, nb]``; weight ``w = d * q + m`` exactly as
        ggml's ``dequantize_row_*`` computes it (for Q4_K ``d = d_super * sc`` and ``m =
        -dmin_super * mn``, for Q6_K ``d = d_super * sc``: products exact in float32)."""
        rows = np.arange(self.n_rows) if rows is None else np.asarray(rows, dtype=np.int64)
        if self.kind == "lanes":
            return from_lanes(self.q, self.d, self.m, rows)
        if self.kind in ("vlanes", "vlanes4"):
            return from_vlanes(self.q, self.d, self.m, self.kind == "vlanes4", rows)
        n, nsb = len(rows), self.q.shape[1]
        p = self.kquant_parts(rows)
        d = p["d"][..., None]                                                # [n, nsb, 1]
        if self.kind in ("q4k", "vq4k"):
            qs = p["q"].reshape(n, nsb, 4, 32)
            q: np.ndarray = np.empty((n, nsb, 8, 32), np.int8)
            q[:, :, 0::2] = qs & 0x0F                                        # sub-block 2c: low nibbles of chunk c
            q[:, :, 1::2] = qs >> 4                                          # sub-block 2c+1: high nibbles
            m = -(p["m"][..., None] * p["mn"].astype(np.float32))
            return (q.reshape(n, nsb * 8, 32), (d * p["sc"].astype(np.float32)).reshape(n, -1),
                    m.reshape(n, -1))
        q = (p["q"].astype(np.int16) - 32).astype(np.int8).reshape(n, nsb * 16, 16)
        return q, (d * p["sc"].astype(np.float32)).reshape(n, -1), None

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return self.n_rows, int(self.q.shape[1] * (QK if self.kind in self.LANE_KINDS else QK_K))

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays().values()))

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to persist (those of its form that are present)."""
        return {k: getattr(self, k) for k in ("q", "d", "m", "sc", "mn") if getattr(self, k) is not None}

    def meta(self) -> list[Any]:
        """What rebuilds it with its :meth:`arrays` (:meth:`from_arrays`): JSON-able."""
        return [self.kind, self.act, list(self.types), self.n_rows]

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: Sequence[Any]) -> QWeight:
        """Inverse of :meth:`arrays` + :meth:`meta`. Raises KeyError/ValueError/EngineError on a mismatch."""
        kind, act, types, n_rows = meta
        return cls(kind, act, types, n_rows, **arrays)

    def _compatible(self, o: QWeight) -> bool:
        return (self.act == o.act and self.kind == o.kind and self.q.shape[1:] == o.q.shape[1:]
                and (self.m is None) == (o.m is None))

    def take_rows(self, rows: np.ndarray) -> QWeight:
        """A copy with rows reordered/selected (``rows`` int ``[n]``)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.kind in self.LANE_KINDS:
            return QWeight.lanes(*self.plain(rows), self.act, self.types, self.kind)
        return QWeight.kquant(self.kind[-3:], self.act, self.types, len(rows), self.kquant_parts(rows),
                              self.kind.startswith("v"))

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """float32 ``[len(rows), in]`` of the selected rows (embedding lookups)."""
        q, d, m = self.plain(rows)
        w = q.astype(np.float32) * d[..., None]                  # [n, nb, B]
        if m is not None:
            w += m[..., None]
        return w.reshape(len(rows), -1)

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]`` (tests, fallbacks)."""
        return self.dequantize_rows(np.arange(self.n_rows))

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T`` with ggml's activation quantization: x float32 ``[T, in]`` -> float32
        ``[T, out]`` (C-contiguous), row-deterministic (see the module docstring).

        Raises: EngineError("invalid_params") when ``in`` differs.
        """
        kind = self.kind
        if kind == "vq4k" or kind == "vq6k":                             # quantize + multiply in one call
            if x.ndim != 2 or x.shape[1] != self.q.shape[1] * QK_K:
                raise EngineError("invalid_params", f"matmul of {tuple(x.shape)} with a {list(self.shape)} weight")
            T = x.shape[0]
            out = np.empty((T, self.n_rows), np.float32)
            if T:
                gemm, tiled = _row_flags(T)
                mn = self.mn if self.mn is not None else self.sc
                m = self.m if self.m is not None else self.d
                _compile()["matmul_kq_x"](np.ascontiguousarray(x, dtype=np.float32), kind == "vq4k", self.q, self.sc,
                                          mn, self.d, m, gemm, tiled, self.n_rows, out)
            return out
        if kind == "vlanes" or kind == "vlanes4":                        # quantize + multiply in one call
            if x.ndim != 2 or x.shape[1] != self.q.shape[1] * QK:
                raise EngineError("invalid_params", f"matmul of {tuple(x.shape)} with a {list(self.shape)} weight")
            T = x.shape[0]
            out = np.empty((T, self.n_rows), np.float32)
            if T:
                q81 = self.act == "q8_1"
                _compile()["matmul_lanes_x"](np.ascontiguousarray(x, dtype=np.float32), self.m is not None or q81, q81,
                                             self.q, kind == "vlanes4", self.d,
                                             self.m if self.m is not None else _NO_M3_H,
                                             128 if kind == "vlanes" else _nibble_bias(self.m), self.n_rows, out)
            return out
        O, K = self.shape
        if x.ndim != 2 or x.shape[1] != K:
            raise EngineError("invalid_params", f"matmul of {tuple(x.shape)} with a [{O}, {K}] weight")
        out = np.empty((x.shape[0], O), np.float32)
        xq, dx, xs = quantize_activations(x, self.act, self.m is not None)  # [T, K], [T, K/32], [T, K/32]
        self.matmul_quantized(xq, dx, xs, out)
        return out

    def _matmul_kquant(self, xi: np.ndarray, dy: np.ndarray, bs16: np.ndarray, out: np.ndarray,
                       bs32: np.ndarray | None = None) -> None:
        """A VNNI K-quant's ``out[T, O]`` from :func:`quantize_q8_K_int`'s levels, super-block
        scales and sums per 16 (and per 32 when given; ``out`` may be a column slice)."""
        k = _compile()
        T = xi.shape[0]
        if T == 0:
            return
        if self.kind == "vq4k":
            if bs32 is None:
                bs32 = bs16.reshape(T, -1, 2).sum(-1, dtype=np.int32)    # [T, K/32]
            k["matmul_q4k_vnni"](self.q, self.sc, self.mn, self.d, self.m, xi, dy, bs32, gemm_rows(T), self.n_rows, out)
        else:
            k["matmul_q6k_vnni"](self.q, self.sc, self.d, xi, dy, bs16, tiled_rows(T), self.n_rows, out)

    def matmul_quantized(self, xq: np.ndarray, dx: np.ndarray, xs: np.ndarray, out: np.ndarray) -> None:
        """``out[T, O] = x @ W.T`` from activations already quantized (:func:`quantize_activations`
        with this weight's ``act``; ``xs`` filled when it has an offset). ``out`` may be a column slice."""
        k = _compile()
        T = xq.shape[0]
        if T == 0:                                                       # e.g. the last block of a chunk with no output row
            return
        if self.kind == "lanes":
            nb = self.q.shape[1]
            xl = lane_order(xq.reshape(T, nb, 32))                   # [T, nb, 32] lane order
            m = self.m if self.m is not None else _NO_M3
            full = self.q.shape[0] * LANE_ROWS
            if full == self.n_rows and out.flags.c_contiguous:
                k["matmul_lanes"](self.q, self.d, m, self.m is not None, xl, dx, xs, out)
            else:
                tmp = np.empty((T, full), np.float32)
                k["matmul_lanes"](self.q, self.d, m, self.m is not None, xl, dx, xs, tmp)
                out[:] = tmp[:, :self.n_rows]
            return
        if self.kind in ("vlanes", "vlanes4"):
            nb = self.q.shape[1]
            x8 = np.empty(xq.shape, np.int8)                             # [T, K] the levels
            nxc = np.empty((T, nb, 8), np.int32)                         # -bias * their sum per lane
            k["lane_levels"](xq, 128 if self.kind == "vlanes" else _nibble_bias(self.m), x8, nxc.reshape(T, -1))
            m = self.m if self.m is not None else _NO_M3_H
            k["matmul_lanes_vnni"](self.q, self.kind == "vlanes4", self.d, m, x8, nxc, dx, xs,
                                   self.n_rows, out)
            return
        xi = xq.astype(np.int8)                                          # [T, K] the q8_K levels
        dy = np.ascontiguousarray(dx[:, ::QK_K // QK])                   # [T, nsb] the super-block d
        res = out if out.flags.c_contiguous else np.empty((T, self.n_rows), np.float32)
        if self.kind in ("vq4k", "vq6k"):
            self._matmul_kquant(xi, dy, xi.reshape(T, -1, 16).sum(-1, dtype=np.int32), out)   # bs16 [T, K/16]
            return
        if self.kind == "q4k":
            bs32 = xi.reshape(T, -1, 32).sum(-1, dtype=np.int32)         # [T, K/32]
            k["matmul_q4k"](self.q, self.sc, self.mn, self.d, self.m, xi, dy, bs32, gemm_rows(T), res)
        else:
            bs16 = xi.reshape(T, -1, 16).sum(-1, dtype=np.int32)         # [T, K/16]
            k["matmul_q6k"](self.q, self.sc, self.d, xi, dy, bs16, tiled_rows(T), res)
        if res is not out:
            out[:] = res


class QConcat:
    """Row-wise concatenation of weights that cannot share one QWeight (different forms, block
    or activation types, or a float32 part): ``x @ [W0; W1; ...].T`` as one ``[T, sum(out)]``.
    Parts of one activation type share one quantization of ``x``."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[QWeight | np.ndarray]) -> None:
        self.parts = list(parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x float32 ``[T, in]`` -> ``[T, sum(out)]``."""
        O, K = self.shape
        if x.ndim != 2 or x.shape[1] != K:
            raise EngineError("invalid_params", f"matmul of {tuple(x.shape)} with a [{O}, {K}] weight")
        out = np.empty((x.shape[0], O), np.float32)
        kquant = [p for p in self.parts if isinstance(p, QWeight) and p.kind in ("vq4k", "vq6k")]
        if len(kquant) == len(self.parts):
            if x.shape[0]:                                               # one quantization, int8 levels
                xi, dy, bs16, bs32 = _compile()["kq_levels"](np.ascontiguousarray(x, dtype=np.float32))
                o0 = 0
                for q in kquant:
                    q._matmul_kquant(xi, dy, bs16, out[:, o0:o0 + q.n_rows], bs32)
                    o0 += q.n_rows
            return out
        quantized: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        with_s = any(isinstance(p, QWeight) and p.m is not None for p in self.parts)
        o0 = 0
        for p in self.parts:
            o1 = o0 + p.shape[0]
            if isinstance(p, QWeight):
                if p.act not in quantized:
                    quantized[p.act] = quantize_activations(x, p.act, with_s)
                p.matmul_quantized(*quantized[p.act], out[:, o0:o1])
            else:
                out[:, o0:o1] = x @ p.T
            o0 = o1
        return out


_KQ_EMPTY: dict[str, tuple[np.ndarray, ...]] = {}


def _kq_empty(kind: str) -> tuple[np.ndarray, ...]:
    """Zero-size read-only arrays of the types of a ``kind`` ("vq4k" / "vq6k") form's arrays (its
    ``q, sc, mn, d, m`` / ``q, sc, d``): an absent part of :func:`kquant_matvec_parts`."""
    if kind not in _KQ_EMPTY:
        name = "Q4_K" if kind == "vq4k" else "Q6_K"
        w = QWeight.from_raw(name, np.zeros((16, 144 if kind == "vq4k" else 210), np.uint8), 16, 256)
        have = w.arrays()
        out = []
        for a in (have[k] for k in (("q", "sc", "mn", "d", "m") if kind == "vq4k" else ("q", "sc", "d"))):
            e = np.zeros((0,) * a.ndim, a.dtype)
            e.flags.writeable = False
            out.append(e)
        _KQ_EMPTY[kind] = tuple(out)
    return _KQ_EMPTY[kind]


def kquant_matvec_parts(w: QWeight | QConcat | np.ndarray) -> tuple[Any, ...] | None:
    """The arguments ``decode_kernels.kq_matvec`` takes for ``w``: ``(q4, sc4, mn4, d4, m4, n4, q6, sc6,
    d6, n6)``, its rows as a VNNI-form Q4_K part of ``n4`` rows followed by a VNNI-form Q6_K part of
    ``n6`` (an absent part: :func:`_kq_empty` arrays, 0 rows). None for any other matrix (another
    form, a float32 part, or parts in another order): the compiled decode step does not take it."""
    parts = list(w.parts) if isinstance(w, QConcat) else [w]
    if not all(isinstance(p, QWeight) and p.kind in ("vq4k", "vq6k") for p in parts):
        return None
    kinds = [p.kind for p in parts if isinstance(p, QWeight)]
    if kinds not in (["vq4k"], ["vq6k"], ["vq4k", "vq6k"]):
        return None
    by = {p.kind: p for p in parts if isinstance(p, QWeight)}
    p4, p6 = by.get("vq4k"), by.get("vq6k")
    a4 = (p4.q, p4.sc, p4.mn, p4.d, p4.m) if p4 is not None else _kq_empty("vq4k")
    a6 = (p6.q, p6.sc, p6.d) if p6 is not None else _kq_empty("vq6k")
    return (*a4, p4.n_rows if p4 is not None else 0, *a6, p6.n_rows if p6 is not None else 0)


def fuse(parts: Sequence[QWeight | np.ndarray]) -> QWeight | QConcat | np.ndarray:
    """Stack ``[out_i, in]`` weights row-wise: float32 arrays concatenated; runs of adjacent
    QWeights of the same form, block and activation type merged into one QWeight; one QWeight
    when that is all, else a QConcat of the runs."""
    arrays = [p for p in parts if isinstance(p, np.ndarray)]
    if len(arrays) == len(parts):
        return np.ascontiguousarray(np.concatenate(arrays, axis=0))
    runs: list[list[QWeight | np.ndarray]] = []
    for p in parts:
        prev = runs[-1][-1] if runs else None
        if isinstance(p, QWeight) and isinstance(prev, QWeight) and prev._compatible(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    merged: list[QWeight | np.ndarray] = []
    for run in runs:
        if len(run) == 1:
            merged.append(run[0])
            continue
        qs = [p for p in run if isinstance(p, QWeight)]
        first = qs[0]
        if first.kind in QWeight.LANE_KINDS:
            plains = [p.plain() for p in qs]
            mm = None if plains[0][2] is None else np.concatenate([pl[2] for pl in plains])
            merged.append(QWeight.lanes(np.concatenate([pl[0] for pl in plains]),
                                        np.concatenate([pl[1] for pl in plains]), mm, first.act,
                                        tuple(t for p in qs for t in p.types), first.kind))
            continue
        pp = [p.kquant_parts() for p in qs]
        cat = {k: np.concatenate([p[k] for p in pp]) for k in pp[0]}
        merged.append(QWeight.kquant(first.kind[-3:], first.act, tuple(t for p in qs for t in p.types),
                                     sum(p.n_rows for p in qs), cat, first.kind.startswith("v")))
    return merged[0] if len(merged) == 1 else QConcat(merged)


__all__ = ["ACT_TYPE", "AVX2_ENV", "FORMAT_VERSION", "LANE_ROWS", "LANE_TYPES", "PACKED_TYPES", "VNNI_ENV", "QConcat", "QWeight", "cos_sin_libm",
           "format_tag", "fuse", "gemm_rows", "host_has_vnni", "kquant_matvec_parts", "kquant_parts", "row_groups", "tiled_rows", "quantize_activations", "quantize_q8_K_int", "set_num_threads", "supports",
           "thread_ceiling", "unpack", "use_threads"]
