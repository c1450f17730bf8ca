"""Key/value cache of one sequence, preallocated to ``n_ctx`` positions.

Layout: ``k``, ``v`` are ``[n_layer, n_kv_head, n_ctx, head_dim]`` (float32 by
default). Position ``p`` of layer ``l`` lives at ``k[l, :, p, :]``, so the keys
of positions ``a..b-1`` for one layer are the contiguous-per-head block
``k[l, :, a:b]``. The arrays live in anonymous ``mmap`` memory (zero pages,
allocated 4 KiB at a time on first write): positions the sequence never
reaches cost address space, not RSS. (``np.zeros`` would get transparent huge
pages from numpy's allocator: measured on SmolLM2 with n_ctx 8192, writing
640 positions made 178 MiB resident instead of 14 MiB.)

Keys are stored after RoPE (as llama.cpp's cache does); llama.cpp keeps them in
f16 by default, this cache keeps the model's compute dtype.

The cache knows only how many positions are valid (``n_past``); the caller
(``Model.forward``) writes positions ``n_past .. n_past+T-1`` and then calls
:meth:`advance`. An exception between the write and ``advance`` leaves
``n_past`` unchanged, so half-written positions are never trusted.
"""

from __future__ import annotations

import mmap

import numpy as np

from .errors import EngineError


class KVCache:
    """Per-layer keys and values for positions ``0 .. n_past-1``.

    Args:
        n_layer: number of transformer blocks.
        n_kv_head: key/value heads per layer.
        head_dim_k: key head size (``{arch}.attention.key_length``).
        head_dim_v: value head size (``{arch}.attention.value_length``).
        n_ctx: capacity in positions.
        dtype: element type (float32, or float64 for reference runs).

    Raises:
        EngineError("invalid_params"): a non-positive size.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim_k: int, head_dim_v: int, n_ctx: int,
                 dtype: np.dtype | type = np.float32) -> None:
        for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim_k", head_dim_k),
                          ("head_dim_v", head_dim_v), ("n_ctx", n_ctx)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
                raise EngineError("invalid_params", f"KV cache {name} must be a positive integer, got {val!r}")
        self.n_layer = int(n_layer)
        self.n_kv_head = int(n_kv_head)
        self.n_ctx = int(n_ctx)
        self.dtype = np.dtype(dtype)
        self.k = _lazy_zeros((n_layer, n_kv_head, n_ctx, head_dim_k), self.dtype)  # [L, n_kv, n_ctx, hd_k]
        self.v = _lazy_zeros((n_layer, n_kv_head, n_ctx, head_dim_v), self.dtype)  # [L, n_kv, n_ctx, hd_v]
        self.n_past = 0

    @property
    def nbytes(self) -> int:
        """Bytes reserved (address space) by the two arrays."""
        return int(self.k.nbytes + self.v.nbytes)

    def store(self, layer: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write keys/values of ``T`` new positions ``pos0 .. pos0+T-1`` for one layer.

        Args:
            k: ``[T, n_kv_head, head_dim_k]`` (after RoPE).
            v: ``[T, n_kv_head, head_dim_v]``.
        Does not change ``n_past`` (see :meth:`advance`).
        """
        t = k.shape[0]
        self.k[layer, :, pos0:pos0 + t] = k.transpose(1, 0, 2)  # [n_kv, T, hd_k]
        self.v[layer, :, pos0:pos0 + t] = v.transpose(1, 0, 2)  # [n_kv, T, hd_v]

    def keys(self, layer: int, start: int, end: int) -> np.ndarray:
        """View ``[n_kv_head, end-start, head_dim_k]`` of positions ``start .. end-1``."""
        return self.k[layer, :, start:end]

    def values(self, layer: int, start: int, end: int) -> np.ndarray:
        """View ``[n_kv_head, end-start, head_dim_v]`` of positions ``start .. end-1``."""
        return self.v[layer, :, start:end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions valid (after every layer stored them)."""
        if self.n_past + n > self.n_ctx:
            raise EngineError("context_length_exceeded",
                              f"KV cache holds {self.n_ctx} positions; cannot advance {self.n_past} by {n}")
        self.n_past += n

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (0 <= n <= n_past).

        Raises: EngineError("invalid_params") for n outside ``[0, n_past]``.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.n_past:
            raise EngineError("invalid_params", f"truncate({n!r}) needs an integer in [0, n_past={self.n_past}]")
        self.n_past = int(n)

    def reset(self) -> None:
        """Forget every position (no memory is touched)."""
        self.n_past = 0


def _lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zero-filled writable array backed by an anonymous mmap (pages allocated on first touch)."""
    n = int(np.prod(shape)) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
