"""The one attention seam every architecture calls: store K/V, gather, mask, attend.

A forward pass runs over one flat batch of ``N`` tokens that belong to several
sequences. :class:`AttnBatch` is the per-step metadata (vLLM's "attention
metadata"): the segments (which rows belong to which sequence's
:class:`~worker.engine.kv_cache.KVEntry`, at which positions), the flat
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np

from .kv_cache import KVEntry

__all__ = ["AttnBatch", "Segment", "StepInterrupted", "attend", "attention", "attention_mask"]


class StepInterrupted(Exception):
    """A forward pass abandoned between two layers because ``AttnBatch.interrupt()`` said so
    (``layer``: the layer it had reached, 0-based). The entries' tokens are unchanged."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"forward pass interrupted before layer {layer}")
        self.layer = layer


@dataclass
class Segment:
    """One sequence's rows in a step: rows ``start .. start+n-1`` of the flat batch are
    its tokens at positions ``pos0 .. pos0+n-1`` (``pos0 == kv.n_past`` when the step starts)."""

    kv: KVEntry
    start: int
    n: int
    pos0: int


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
        f16: round q, k and v to float16 precision first (kept in the compute dtype), as
            llama.cpp's f16 KV cache and its flash attention (q converted to K's f16) do.
    Returns:
        ``[N, n_head * hd_v]``.
    Raises:
        StepInterrupted: ``batch.interrupt()`` was true (checked first, before anything is
            stored, and once more after attending).
    """
    batch.checkpoint(layer)
    if f16:
        q, k, v = (round_f16(a) for a in (q, k, v))
    n, n_head, _ = q.shape
    hd_v = v.shape[2]
    out = np.empty((n, n_head * hd_v), dtype=q.dtype)   # [N, n_head*hd_v]
    for i, s in enumerate(batch.segments):
        rows = slice(s.start, s.start + s.n)
        s.kv.store(layer, s.pos0, k[rows], v[rows])
        end = s.pos0 + s.n
        k0, mask, col0 = batch.mask(i, window)
        out[rows] = attention(q[rows], s.kv.keys(layer, k0, end), s.kv.values(layer, k0, end), mask, scale,
                              col0)
    batch.checkpoint(layer, count=False)  # again before the layer's output projection and FFN
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
