"""The quantized path's kernel warm-up: numba's import and the kernel signatures a load will run,
loaded from numba's on-disk cache (or compiled into it) ahead of the first token.

Three doors: :func:`preload_kernels` (a process that knows it will load a quantized model starts
the file-independent part early, on a thread), :func:`warm_up_kernels` / :func:`warm_up_slices`
(``Engine.load``'s two phases: before the model is built, overlapping the GGUF reading, and after,
for the column-slice matmuls its fused parts need), and :func:`compile_kernels` (the set-up step
``scripts/compile_kernels.py``: every signature, for every weight type).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from .loading import resident

__all__ = ["column_slice_types", "compile_kernels", "preload_kernels", "take_preload", "warm_up_kernels",
           "warm_up_slices"]

_preload_lock = threading.Lock()
_preload_thread: threading.Thread | None = None


def preload_kernels() -> None:
    """Start loading, on a daemon thread, the part of the quantized path's kernels that does not
    depend on the file: numba's import (~0.2 s), the kernel modules, the activation quantization
    and both flash-attention kernels (from numba's on-disk cache). For a process that knows it
    will call ``Engine.load(..., weights="quantized")`` (the worker, from its arguments) and has
    other start-up work to overlap with it; the next such load waits for it instead of doing it
    again. Returns at once; a second call while one is pending does nothing. Failures are
    logged and otherwise ignored (the load then does the work itself)."""
    global _preload_thread
    with _preload_lock:
        if _preload_thread is None:
            _preload_thread = threading.Thread(target=_warm_up_common, daemon=True, name="modelyard-preload")
            _preload_thread.start()


def take_preload() -> threading.Thread | None:
    """The pending :func:`preload_kernels` thread, once (the next load starts from scratch)."""
    global _preload_thread
    with _preload_lock:
        th, _preload_thread = _preload_thread, None
    return th


def compile_kernels(type_names: Iterable[str] | None = None) -> None:
    """Compile every kernel signature the quantized path runs, or load it from numba's on-disk
    cache where that is current (``__pycache__`` beside ``worker/engine/kernels/*_kernels.py``, or
    ``NUMBA_CACHE_DIR``): the file-independent ones (activation quantization, both flash-attention
    kernels, SiLU, GELU's table, RoPE's cos/sin) and the matmuls of each GGUF type name in
    ``type_names`` (None: every type with a kernel, ``quant.ACT_TYPE``). The same set as
    ``Engine.load(weights="quantized")``'s warm-up; for a set-up step (``scripts/compile_kernels.py``)
    that fills the cache once per checkout, so that no load compiles (a fresh cache costs tens of
    seconds of compiling, a current one ~0.5 s of loading). Raises whatever numba raises."""
    from .kernels import quant

    from .arch.layers import FFN_ACTS

    _load_common_kernels()
    for act in FFN_ACTS:
        _load_ffn_kernels(act)
    _load_matmul_kernels(set(quant.ACT_TYPE) if type_names is None else set(type_names))
    if type_names is None or KQUANTS & set(type_names):
        _load_decode_kernels()


#: the weight types of the compiled one-token llama block (``LlamaModel._decode_one``)
KQUANTS = {"Q4_K", "Q6_K"}


def _load_decode_kernels() -> None:
    """The compiled one-token llama block (``kernels.decode_kernels.llama_block_t1``) and embedding
    row (``kq_row``), which a llama model of Q4_K / Q6_K weights (in their vector forms:
    ``quant.host_has_vnni``) decodes with: one call on zero weights of the production types (a Q4_K + Q6_K ``QConcat`` QKV, as Q4_K_M gives).
    Nothing on a host without the vector forms (the model then decodes by the NumPy path)."""
    from .arch.layers import RopeTable
    from .attention import GGML_DECODE_THREADS, ggml_fa_mode
    from .kernels import decode_kernels, quant

    if not quant.host_has_vnni():
        return

    def w(name: str, rows: int, cols: int = 256) -> quant.QWeight:
        return quant.QWeight.from_raw(name, np.zeros((rows, cols // 256 * (144 if name == "Q4_K" else 210)), np.uint8),
                                      rows, cols)

    E, nh, nkv, hd, n_ff = 256, 16, 8, 16, 256
    mats = [quant.kquant_matvec_parts(m) for m in (quant.fuse([w("Q4_K", 384), w("Q6_K", 128)]), w("Q4_K", E),
                                                   w("Q4_K", 2 * n_ff), w("Q6_K", E))]
    norm = np.ones(E, np.float32)
    norm.flags.writeable = False
    rope = RopeTable(2, hd, 10000.0, libm=True)
    kc, vc = np.zeros((nkv, 2, hd), np.float32), np.zeros((nkv, 2, hd), np.float32)
    mode, n_cells = ggml_fa_mode(1, 1)
    decode_kernels.llama_block_t1(np.zeros((1, E), np.float32), np.zeros(1, np.int64), np.float32(1e-5), norm, norm,
                                  *mats, rope.cos, rope.sin, hd, nh, nkv, hd, kc, vc, np.float32(0.25), mode, n_cells,
                                  GGML_DECODE_THREADS, quant.gemm_rows(1), quant.tiled_rows(1), n_ff)
    decode_kernels.kq_row(mats[0], 0, np.zeros((1, E), np.float32)[0])    # the token's embedding row


def _load_common_kernels() -> None:
    """numba's import and the kernels every model's quantized path runs (32-block activation
    quantization, both flash-attention kernels, RMSNorm, RoPE); raises on failure. The K-quants'
    activation quantization loads with their matmuls (:func:`_load_matmul_kernels`), the FFN's
    activation with :func:`_load_ffn_kernels`: a model loads only what it runs (each signature
    costs ~0.5-2 MiB of LLVM's resident code and tables, and load time)."""
    from . import attention
    from .kernels import quant

    x = np.zeros((2, 256), np.float32)
    for act in ("q8_0", "q8_1"):
        for with_s in (False, True):
            quant.quantize_activations(x, act, with_s)
    for rows, end in ((1, 1), (64, 64)):
        kv = np.zeros((1, end, 8), np.float32)
        attention.ggml_attention(np.zeros((rows, 1, 8), np.float32), kv, kv, end - rows, 0, None, 1.0)
    from .arch.layers import RopeTable, rms_norm

    rms_norm(np.zeros((1, 16), np.float32), np.ones(16, np.float32), 1e-6, kernel=True)  # RMSNorm's kernel
    rope = RopeTable(2, 4, 10000.0, libm=True)                # RoPE's kernel: heads contiguous or strided
    qkv = np.zeros((2, 16), np.float32)
    for heads in (qkv[:, :8].reshape(2, 2, 4), np.zeros((1, 2, 4), np.float32)):
        rope.apply_neox(heads, np.zeros(heads.shape[0], np.int64))
    quant.cos_sin_libm(np.zeros((1, 2), np.float32))         # RoPE's cosf / sinf


def _load_ffn_kernels(act: str) -> None:
    """The fused ``act(gate) * up`` kernel of a gated FFN activation (a key of
    ``model.FFN_ACTS``; GELU also builds ggml's table); raises KeyError for another name, or what
    numba raises."""
    from .arch.layers import FFN_ACTS, glu_ggml

    glu_ggml(np.zeros((1, 32), np.float32), 16, FFN_ACTS[act])


def _load_matmul_kernels(type_names: set[str], whole: bool = True, column_slice: bool = True) -> None:
    """Per weight type in ``type_names`` (those with a kernel), the matmul into a whole output
    (``QWeight.matmul``; when ``whole``) and into column slices of one (``QConcat.matmul`` of two
    parts, of one row and of two: a one-row slice is C-contiguous, a taller one is not, two numba
    signatures of the VNNI kernels; when ``column_slice``); raises on failure. Every entry point is
    called as a request calls it: kernels called only from inside another (``matmul_kq_x``'s
    ``matmul_q4k_vnni``, ...) are in numba's overloads only when that one was compiled, not when
    it came from the cache."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from .kernels import quant

    for name in sorted(type_names):
        if not quant.supports(name):
            continue
        block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        w = quant.QWeight.from_raw(name, np.zeros((8, 256 // block * tsize), np.uint8), 8, 256)
        x = np.zeros((2, 256), np.float32)
        if whole:
            w.matmul(x)                                                  # [2, 8] C-contiguous out
            if w.act == "q8_K":                                          # the float-level q8_K of a fused part
                for with_s in (False, True):
                    quant.quantize_activations(x, "q8_K", with_s)
        if column_slice:
            for rows in (1, 2):
                quant.QConcat([w, w]).matmul(x[:rows])


def _warm_up_common() -> None:
    """numba's import and the file-independent kernels (see :func:`preload_kernels`)."""
    try:
        _load_common_kernels()
    except Exception:  # noqa: BLE001 - only a warm-up
        logging.getLogger(__name__).warning("kernel preload failed (kernels load at first use)", exc_info=True)


def warm_up_kernels(type_names: set[str], preload: threading.Thread | None = None, ffn_act: str | None = None) -> None:
    """Import numba and load (from its on-disk cache) the kernel signatures the quantized path
    calls, on tiny inputs of the production types: first the file-independent ones (activation
    quantization, both flash-attention kernels: :func:`_warm_up_common`, or ``preload``, a
    :func:`preload_kernels` thread, joined instead when given); then per weight type in
    ``type_names`` the matmul into a whole output (``QWeight.matmul``), and the kernel of the
    architecture's FFN activation ``ffn_act`` (``Model.ffn_act``; None: every one). Run on a thread during
    ``Engine.load`` (joined before it returns), so that numba's import (~0.4 s) and the kernels'
    loading (~25 ms each) overlap the GGUF reading, the tokenizer build and the weight unpacking
    instead of delaying the first token. A failure is logged and otherwise ignored: the kernels
    are then loaded at first use. The load then runs :func:`warm_up_slices` (the column-slice
    matmuls its ``QConcat`` parts need, none for most files, and the drop of LLVM's pages from
    the resident set)."""
    if preload is not None:
        preload.join()  # one numba parallel launch at a time
    else:
        _warm_up_common()
    from .arch.layers import FFN_ACTS

    try:
        for act in FFN_ACTS if ffn_act is None else (ffn_act,):
            _load_ffn_kernels(act)
        _load_matmul_kernels(type_names, column_slice=False)
    except Exception:  # noqa: BLE001 - only a warm-up
        logging.getLogger(__name__).warning("kernel warm-up failed (kernels load at first use)", exc_info=True)


def column_slice_types(weights: Iterable[Any]) -> set[str]:
    """The GGUF type names of the quantized parts of the :class:`~.kernels.quant.QConcat` matrices among
    ``weights`` (the model's): the only weights multiplied into a column slice of an output."""
    from .kernels.quant import QConcat, QWeight

    return {t for w in weights if isinstance(w, QConcat) for p in w.parts if isinstance(p, QWeight) for t in p.types}


def warm_up_slices(type_names: set[str], decode: bool = False) -> None:
    """The second part of the warm-up, once the model is built (after :func:`warm_up_kernels`):
    the column-slice matmuls of ``type_names`` (:func:`column_slice_types`; a model with no
    ``QConcat`` needs none), the compiled one-token llama block when ``decode`` (the model decodes
    with it: ``LlamaModel.decode_blocks``), then LLVM's pages off the resident set. Failures are logged."""
    try:
        _load_matmul_kernels(type_names, whole=False)
        if decode:
            _load_decode_kernels()
        # LLVM's code and tables are not run by the loaded kernels: off the resident set (~90 MiB)
        resident.drop_clean_file_pages("libllvmlite")
    except Exception:  # noqa: BLE001 - only a warm-up
        logging.getLogger(__name__).warning("kernel warm-up failed (kernels load at first use)", exc_info=True)
