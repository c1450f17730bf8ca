"""The one attention seam every architecture calls: store K/V, gather, mask, attend.

A forward pass runs over one flat batch of ``N`` tokens that belong to several
sequences. :class:`AttnBatch` is the per-step metadata (vLLM's "attention
metadata"): the segments (which rows belong to which sequence's
:class:`~worker.engine.kv.cache.KVEntry`, at which positions), the flat
``positions [N]`` for RoPE, and the masks, built once per step and shared by
every layer. The architectures run their QKV / O / FFN matmuls once over all
``N`` rows and call :func:`attend` per layer; only attention itself loops over
the sequences (each sees its own keys).

Interrupting a step: ``AttnBatch(interrupt=...)`` is polled by :func:`attend` before
and after each layer's attention (every architecture calls it once per layer, so this
is the one place); when it returns True, :class:`StepInterrupted` abandons the
forward pass. That is safe because a pass only *writes* K/V at positions
``pos0 ..`` of its entries and the caller appends the tokens after the pass
returned: an abandoned pass leaves ``entry.tokens`` as they were, and the K/V
it wrote past ``n_past`` are never read before they are written again (a step
reads keys ``< pos0 + n`` only after storing its own ``pos0 .. pos0+n-1``; the
prefix-cache copy, a take-over's truncate and a state save read ``< n_past`` only).

Masks follow llama.cpp: a key at p0 is visible to a query at p1 when ``p0 <=
p1`` and, with a sliding window, ``p1 - p0 < window``
(``LLAMA_SWA_TYPE_STANDARD``, ``llama_hparams::is_masked_swa``).

Two numerics, chosen by the caller (``attend(..., f16=)``):

* ``f16=False`` (the float32 path): plain scaled dot-product attention in NumPy
  (:func:`attention`), the reference.
* ``f16=True`` (the quantized path, which follows ggml): llama.cpp's default CPU setting,
  an f16 KV cache and flash attention. K and V are stored rounded to f16, and attention is
  ggml-cpu's ``flash_attn_ext`` reproduced operation by operation by the numba kernels of
  :mod:`.kernels.attn_kernels`, on the code path llama.cpp would take for this sequence alone
  (:func:`ggml_fa_mode`): a segment of one row (decode) over at least
  ``SPLIT_KV_MIN_CELLS`` cells takes the split-KV path (``GGML_DECODE_THREADS`` chunks), a
  segment of at least ``attn_kernels.TILE_Q`` rows (prefill) the tiled f32 path, any other
  the one-row path with its f16 softmax·V accumulator. llama.cpp's cells of a sequence
  alone in a fresh cache are its positions in order, and its KV view is padded to
  ``KV_PAD`` cells; the engine takes both as such (llama.cpp itself departs from that
  only when cells are reused out of order — several sequences sharing a unified cache,
  or a sliding-window cache that wrapped around after ``window + n_ubatch`` positions).

  Batch invariance: a row's output depends on its query, its sequence's keys and values,
  and its micro-batch's row count and end (``Segment.ubatch``) — never on the other
  sequences of the step, on how a micro-batch is sliced into steps, nor on the thread
  count (every (row, head) is computed by one thread, in a fixed order). Like llama.cpp's,
  it does depend on how the sequence's own tokens were cut into micro-batches: a prefill
  row (tiled, Q in f32) and the same row decoded alone (Q and the softmax·V sum in f16)
  differ at f16 precision; the scheduler cuts every prompt the same way (``n_ubatch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np

from .kv.cache import KVEntry

_KERNELS: Any = None


def kernels() -> Any:
    """The :mod:`.kernels.attn_kernels` module, imported on first use (the float32 path never imports
    numba); a cached reference, since an import statement costs a microsecond per call and the
    decode step makes hundreds of these calls."""
    global _KERNELS
    if _KERNELS is None:
        from .kernels import attn_kernels
        _KERNELS = attn_kernels
    return _KERNELS


__all__ = ["AttnBatch", "Segment", "StepInterrupted", "attend", "attention", "attention_mask", "ggml_attention",
           "ggml_fa_mode", "kernels"]


class StepInterrupted(Exception):
    """A forward pass abandoned between two layers because ``AttnBatch.interrupt()`` said so
    (``layer``: the layer it had reached, 0-based). The entries' tokens are unchanged."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"forward pass interrupted before layer {layer}")
        self.layer = layer


#: llama.cpp pads its KV view to a multiple of this many cells (``llama_kv_cache::get_n_kv``)
KV_PAD = 256
#: ggml-cpu takes its split-KV path for one query row over at least this many cells (ops.cpp)
SPLIT_KV_MIN_CELLS = 512
#: llama.cpp's decode thread count that the split-KV path cuts the cells by: the reference
#: fixtures' setting (llama-server ``-t 2``, tests/fixtures/README.md) and this machine kind's cores
GGML_DECODE_THREADS = 2


@dataclass
class Segment:
    """One sequence's rows in a step: rows ``start .. start+n-1`` of the flat batch are
    its tokens at positions ``pos0 .. pos0+n-1`` (``pos0 == kv.n_past`` when the step starts,
    or the end of the same entry's previous segment in this step).

    ``ubatch`` / ``ubatch_row``: the micro-batch of llama.cpp (``n_ubatch``) these rows belong
    to, as a sequence alone would run it: its row count and the index in it of this segment's
    first row (``ubatch_row + n <= ubatch``). Every kernel choice that depends on a row count
    (the matmul kernels, :func:`ggml_fa_mode`) is made from ``ubatch``, so a micro-batch run in
    several slices over several steps gives the same bits as run whole. 0: the segment is its
    own micro-batch (``ubatch = n``, ``ubatch_row = 0``)."""

    kv: KVEntry
    start: int
    n: int
    pos0: int
    ubatch: int = 0
    ubatch_row: int = 0

    @property
    def ub_rows(self) -> int:
        """Rows of the micro-batch the kernels are chosen for (``ubatch``, or ``n``)."""
        return self.ubatch or self.n


class AttnBatch:
    """Per-step attention metadata over segments laid out back to back.

    Args:
        segments: in row order, covering rows ``0 .. N-1`` without gaps.
        dtype: compute dtype (for the additive masks).
        interrupt: polled before each layer's attention (see the module docstring); True
            abandons the pass with :class:`StepInterrupted`. None: never.
    Attributes:
        positions: ``[N]`` int64, the position of every row.
        layers_run: layers whose attention this pass has started (the checkpoint counter).
    """

    def __init__(self, segments: Seq[Segment], dtype: Any, interrupt: Callable[[], Any] | None = None) -> None:
        self.segments = list(segments)
        self.interrupt = interrupt
        self.layers_run = 0
        self.dtype = np.dtype(dtype)
        self.n_tokens = sum(s.n for s in self.segments)
        self.positions = (np.concatenate([np.arange(s.pos0, s.pos0 + s.n) for s in self.segments])
                          if self.segments else np.zeros(0, np.int64))  # [N]
        self._masks: dict[tuple[int, int | None], tuple[int, np.ndarray | None, int]] = {}

    def mask(self, i: int, window: int | None) -> tuple[int, np.ndarray | None, int]:
        """``(k_start, mask, col0)`` for segment ``i``: the oldest key any of its queries may see,
        and the additive mask of the key columns ``col0 ..`` of ``[n, pos0+n-k_start]`` (the
        columns before ``col0`` are visible to every query: a chunk at the end of a long
        context masks only its own causal triangle). mask None: nothing is masked. Cached per step."""
        key = (i, window)
        got = self._masks.get(key)
        if got is None:
            s = self.segments[i]
            k0 = max(0, s.pos0 - window + 1) if window else 0
            full = attention_mask(s.pos0, s.n, k0, window, self.dtype)  # [n, S] or None
            col0 = 0
            if full is not None:
                col0 = int(np.argmax(np.isinf(full).any(axis=0)))
                full = np.ascontiguousarray(full[:, col0:])              # [n, S - col0]
            got = (k0, full, col0)
            self._masks[key] = got
        return got

    def checkpoint(self, layer: int, count: bool = True) -> None:
        """Called before layer ``layer``'s attention (``count``: the layer is counted) and after
        it: raise :class:`StepInterrupted` when ``interrupt()`` is true."""
        if self.interrupt is not None and self.interrupt():
            raise StepInterrupted(layer)
        if count:
            self.layers_run += 1


def attend(batch: AttnBatch, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
           window: int | None = None, f16: bool = False) -> np.ndarray:
    """Store this step's K/V and attend, sequence by sequence, for one layer.

    Args:
        batch: the step's metadata.
        layer: layer index (selects the KV slice).
        q: ``[N, n_head, hd_k]`` queries after RoPE (and any q scaling).
        k: ``[N, n_kv, hd_k]`` keys after RoPE; v: ``[N, n_kv, hd_v]``.
        scale: multiplies ``q.k`` (llama.cpp ``kq_scale``).
        window: sliding-window size for this layer, or None (global attention).
        f16: llama.cpp's f16 KV cache and CPU flash attention (the module docstring): k and v
            are stored rounded to f16 and attention runs in :func:`ggml_attention`. False:
            the float32 reference (:func:`attention`).
    Returns:
        ``[N, n_head * hd_v]``.
    Raises:
        StepInterrupted: ``batch.interrupt()`` was true (checked first, before anything is
            stored, and once more after attending).
    """
    batch.checkpoint(layer)
    if f16:
        k, v = round_f16(k), round_f16(v)
    n, n_head, _ = q.shape
    hd_v = v.shape[2]
    out = np.empty((n, n_head * hd_v), dtype=q.dtype)   # [N, n_head*hd_v]
    for i, s in enumerate(batch.segments):
        rows = slice(s.start, s.start + s.n)
        s.kv.store(layer, s.pos0, k[rows], v[rows])
        end = s.pos0 + s.n
        if f16:  # the whole layer of the entry (C-contiguous, key index = position)
            out[rows] = ggml_attention(q[rows], s.kv.k[layer], s.kv.v[layer], s.pos0, 0, window, scale,
                                       ubatch=(s.ub_rows, s.ubatch_row))
            continue
        k0, mask, col0 = batch.mask(i, window)
        out[rows] = attention(q[rows], s.kv.keys(layer, k0, end), s.kv.values(layer, k0, end), mask, scale,
                              col0)
    batch.checkpoint(layer, count=False)  # again before the layer's output projection and FFN
    return out


def ggml_fa_mode(n_rows: int, end: int) -> tuple[int, int]:
    """``(mode, n_cells)``: the ggml-cpu flash-attention path llama.cpp takes for ``n_rows``
    query rows of one sequence whose keys end at position ``end`` (exclusive), and its KV view
    length (``max(KV_PAD, end rounded up to KV_PAD)``); mode is one of ``attn_kernels.MODE_*``
    (ops.cpp ``ggml_compute_forward_flash_attn_ext_f16``: split-KV for one row over at least
    ``SPLIT_KV_MIN_CELLS`` cells, tiled from ``TILE_Q`` rows, else the one-row kernel)."""
    ak = kernels()

    n_cells = max(KV_PAD, -(-end // KV_PAD) * KV_PAD)
    if n_rows == 1 and n_cells >= SPLIT_KV_MIN_CELLS:
        return ak.MODE_SPLIT, n_cells
    if n_rows >= ak.TILE_Q:
        return ak.MODE_TILED, n_cells
    return ak.MODE_VEC, n_cells


def ggml_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, qpos0: int, kpos0: int,
                   window: int | None, scale: float, softcap: float = 0.0,
                   ubatch: tuple[int, int] | None = None) -> np.ndarray:
    """One sequence's attention for one layer as llama.cpp's CPU flash attention computes it
    over an f16 KV cache (:mod:`.kernels.attn_kernels`, path from :func:`ggml_fa_mode`).

    Args:
        q: ``[T, n_head, hd_k]`` queries at positions ``qpos0 .. qpos0+T-1`` (after RoPE and
            any q scaling; rounded to f16 inside where ggml does).
        keys: ``[n_kv, S, hd_k]`` f16-valued keys at positions ``kpos0 .. kpos0+S-1``, covering
            every key a query may see (``kpos0 + S >= qpos0 + T``; keys beyond are not read);
            values ``[n_kv, S, hd_v]``. Best C-contiguous float32 (else copied).
        window: sliding-window size, or None.
        scale: multiplies ``q.k`` (``kq_scale``); softcap: llama.cpp's ``logit_softcap`` (0: none).
        ubatch: ``(rows, first)``: the queries are rows ``first .. first+T-1`` of a micro-batch of
            ``rows`` rows (:class:`Segment`), whose row count and end choose the path; None:
            the queries are the whole micro-batch.
    Returns:
        float32 ``[T, n_head * hd_v]``.
    """
    ak = kernels()

    t, n_head, _ = q.shape
    hd_v = values.shape[2]
    q = np.ascontiguousarray(q, dtype=np.float32)
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty((t, n_head * hd_v), dtype=np.float32)
    ub_rows, ub_first = ubatch if ubatch is not None else (t, 0)
    mode, n_cells = ggml_fa_mode(ub_rows, qpos0 - ub_first + ub_rows)
    sc = np.float32(scale)
    cap = np.float32(softcap)
    if cap != 0:
        sc = np.float32(sc / cap)   # ggml: scale /= logit_softcap, then softcap * tanh(s)
    w = int(window or 0)
    if mode == ak.MODE_TILED:
        ak.fa_tiled(q, keys, values, qpos0, kpos0, w, sc, cap, out)
    else:
        ak.fa_vec(q, keys, values, qpos0, kpos0, w, sc, cap, mode, n_cells, GGML_DECODE_THREADS, out)
    return out


def round_f16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest float16 (ties to even, as ggml's FP32_TO_FP16), same dtype."""
    return x.astype(np.float16).astype(x.dtype)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None,
              scale: float, mask_col0: int = 0) -> np.ndarray:
    """Grouped-query scaled dot-product attention of one sequence for one layer.

    Args:
        q: ``[T, n_head, hd_k]`` queries (after RoPE).
        keys: ``[n_kv, S, hd_k]`` keys of the visible positions (from the cache).
        values: ``[n_kv, S, hd_v]``.
        mask: additive ``[T, S - mask_col0]`` (0 or -inf) over the key columns
            ``mask_col0 ..``, or None when every query sees every key.
        scale: multiplies ``q.k`` (llama.cpp ``kq_scale``).
        mask_col0: first key column the mask covers (the ones before are visible to all).
    Returns:
        ``[T, n_head * hd_v]``; query head h uses KV head ``h // (n_head / n_kv)``.
    Source: llama-graph.cpp ``build_attn_mha`` (kq = k*q, soft_max_ext(kq, mask,
    kq_scale), kqv = v*kq), without the f16 cache and flash-attention variants.
    """
    t, n_head, hd = q.shape
    n_kv, s, hd_v = values.shape
    g = n_head // n_kv
    if t == 1:
        qg = q.reshape(n_kv, g, hd)                                                 # [n_kv, g, hd]
    else:
        qg = q.reshape(t, n_kv, g, hd).transpose(1, 2, 0, 3).reshape(n_kv, g * t, hd)  # [n_kv, g*T, hd]
    scores = qg @ keys.swapaxes(1, 2)        # [n_kv, g*T, S]
    scores *= scale
    if mask is not None:
        sv = scores.reshape(n_kv, g, t, s)      # [n_kv, g, T, S] view
        sv[..., mask_col0:] += mask             # broadcast [T, S - col0]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)  # [n_kv, g*T, S] probabilities
    out = scores @ values                         # [n_kv, g*T, hd_v]
    if t == 1:
        return out.reshape(1, n_head * hd_v)      # [1, n_head*hd_v]
    return out.reshape(n_kv, g, t, hd_v).transpose(2, 0, 1, 3).reshape(t, n_head * hd_v)  # [T, n_head*hd_v]


def attention_mask(pos0: int, t: int, k_start: int, window: int | None, dtype: Any) -> np.ndarray | None:
    """Additive mask ``[T, S]`` for queries ``pos0..pos0+T-1`` over keys ``k_start..pos0+T-1``.

    Returns None when nothing is masked.
    """
    q_pos = np.arange(pos0, pos0 + t)[:, None]        # [T, 1]
    k_pos = np.arange(k_start, pos0 + t)[None, :]     # [1, S]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= (q_pos - k_pos) >= window
    if not hidden.any():
        return None
    m = np.zeros(hidden.shape, dtype=dtype)
    m[hidden] = -np.inf
    return m
