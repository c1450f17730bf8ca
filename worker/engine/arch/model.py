"""The network: :class:`Model`, the base every architecture's forward pass builds on.

An architecture is one small file (``llama.py``, ``gemma3.py``) defining a
:class:`Model` subclass with three methods: ``_read_hparams`` (from the
``{arch}.*`` keys), ``_build_weights`` (dequantize, fuse, validate shapes) and
``_forward_hidden`` (one forward pass over a chunk of tokens), registered in
:data:`~.registry.ARCHITECTURES` by ``general.architecture``. The parts they share live on
:class:`Model`: ``_read_attention_hparams`` (the common keys and their checks), the weight
builders of :class:`~.weights.ModelWeights` (``_embedding_weights``, ``_qkv_weights``,
``_gated_ffn_weights``, ``_layer_weights``) and a default ``_make_cache``; the NumPy layers
are in :mod:`.layers`.

Shapes: ``forward_batch`` takes a flat batch ``tokens [N]`` of several sequences and returns
float32 logits ``[R, n_vocab]`` for the ``R`` rows asked for.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from protocol.limits import DEFAULT_MAX_CTX, DEFAULT_WEIGHTS

from ..attention import AttnBatch, Segment, attend
from ..errors import EngineError
from ..kernels.quant import _SEQ_ROWS, row_groups, thread_ceiling, use_threads
from ..kernels.threadctl import ThreadGovernor
from ..kv.cache import KVEntry, KVShape
from ..loading.gguf_loader import GGUFFile
from .layers import FFN_ACTS, embed, gated_ffn, hp_float, hp_int, linear, rms_norm, rope_freq_scale, silu
from .weights import LoadProgressFn, ModelWeights


class Model(ModelWeights):
    """One loaded model and its KV cache (one sequence).

    Subclasses set ``arch`` and ``layout_version`` and implement
    ``_read_hparams``, ``_build_weights`` (see :class:`~.weights.ModelWeights`) and
    ``_forward_hidden``.

    Attributes:
        n_ctx: KV cache capacity in tokens.
        n_ctx_train: ``{arch}.context_length``.
        n_vocab: vocabulary size (rows of the output projection).
        n_past: tokens currently in the KV cache.
        dtype: compute dtype (float32, or float64 for reference runs).
        load_timings: seconds spent per load phase (``weights``, ``cache_write``, ...).
        weights_from_cache: True when the prepared weights came from the weight cache (:class:`~.weights.WeightCache`).

    ``progress`` (optional) is called as ``progress("preparing_tensors", done, total)``
    once per GGUF tensor dequantized while the weights are built (``total``: the file's
    tensor count; a weight-cache hit builds none, so it is not called).
    """

    arch: ClassVar[str] = ""
    layout_version: ClassVar[int] = 1
    #: The gated FFN's activation on the quantized path, a key of :data:`~.layers.FFN_ACTS`: the kernel
    #: the load warms up (``warmup._load_ffn_kernels``).
    ffn_act: ClassVar[str] = "silu"
    #: The attention's score scale (``1/sqrt(head_dim)``), set by the architectures whose blocks end
    #: in :meth:`_pre_norm_rest`.
    scale: float

    def __init__(self, gguf: GGUFFile, n_ctx: int | None = None, *, dtype: Any = np.float32,
                 weight_cache: bool | None = None, cache_write: str = "background",
                 weights: str = DEFAULT_WEIGHTS, progress: LoadProgressFn | None = None) -> None:
        self._init_weights(progress, cache_write)
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

    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        """The embeddings of ``tokens`` (int ``[T]``): ``[T, n_embd]`` in the model's dtype."""
        return embed(self.w["tok_embd"], tokens).astype(self.dtype)

    def _pre_norm_rest(self, batch: AttnBatch, rows: np.ndarray, il: int, x: np.ndarray, q: np.ndarray,
                       k: np.ndarray, v: np.ndarray, wo: Any, ffn_norm: np.ndarray, wgu: Any,
                       wdown: Any) -> np.ndarray:
        """The rest of pre-norm block ``il`` (llama, qwen2/3) once ``q`` ``[T, nh, hd]``, ``k``,
        ``v`` ``[T, nkv, hd]`` are ready: attention, the output projection and its residual (in
        the last block, of the output ``rows`` alone), the FFN's RMSNorm, the gated FFN (:attr:`ffn_act`
        on the quantized path, SiLU on the f32 one) and its residual. Returns ``x`` ``[T, n_embd]`` (``[R, n_embd]`` after the last block)."""
        a = attend(batch, il, q, k, v, self.scale, f16=self.ggml_numerics)  # [T, nh*hd]
        o = linear(a, wo)                                         # [T, n_embd]
        if il == self.n_layer - 1:
            x, o = self._keep_output_rows(batch, rows, x, o)      # [R, n_embd]
        x = x + o                                                 # [T, n_embd]
        h = rms_norm(x, ffn_norm, self.eps, self.ggml_numerics)  # [T, n_embd]
        act = FFN_ACTS[self.ffn_act] if self.ggml_numerics else silu
        return x + gated_ffn(h, wgu, wdown, self.n_ff, act)      # [T, n_embd]

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


__all__ = ["Model"]
