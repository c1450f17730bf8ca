"""The network's weights: read from the GGUF as each architecture asks for them, prepared (fused,
quantized or dequantized), and cached.

Weights are dequantized once to float32 (``GGUFFile.tensor``) or kept in the GGUF's quantized
blocks (:class:`~worker.engine.kernels.quant.QWeight`), fused (Q/K/V into one matrix, gate/up into
one) and kept as ``[out_features, in_features]`` C-contiguous arrays used as ``x @ W.T`` (measured
on this machine: the same speed as a transposed copy used as ``x @ Wt``, within noise, so no
transpose is paid at load). The prepared arrays are cached in one packed file under
``$XDG_CACHE_HOME/modelyard/npy/<sha256 of the GGUF>/<layout>/`` and memory-mapped read-only on
the next load (several worker processes on one file then share the pages); see
:class:`WeightCache`. :class:`ModelWeights` is the part of :class:`~.model.Model` that reads them.
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
from ..kernels.quant import QConcat, QWeight, format_tag as quant_format, supports as quant_supports
from ..loading.gguf_loader import GGUFFile, atomic_write_bytes, cache_root
from .layers import Matrix, Weights, fuse_rows

#: ``progress(stage, done, total)``: hears the load's steps (see :class:`~.model.Model`); must not raise.
LoadProgressFn = Callable[[str, int, int], None]

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


class ModelWeights:
    """How a :class:`~.model.Model` gets its prepared weights (``self.w``): from the weight cache, or
    built by the architecture's ``_build_weights`` out of :meth:`matrix` / :meth:`tensor` and the
    shared builders below (the cache is then written, in the background unless ``cache_write`` is
    ``"sync"``). ``progress("preparing_tensors", done, total)`` hears every GGUF tensor prepared.

    Expects of the model: ``arch``, ``layout_version``, ``gguf``, ``weights`` (mode), ``dtype``,
    the shape hyperparameters (``n_embd``, ``n_head``, ...), ``load_timings``, and
    :meth:`_init_weights` called before :meth:`_load_weights`.
    """

    arch: ClassVar[str]
    layout_version: ClassVar[int]
    gguf: GGUFFile
    weights: str
    dtype: np.dtype[Any]
    load_timings: dict[str, float]
    w: Weights
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int

    def _init_weights(self, progress: LoadProgressFn | None, cache_write: str) -> None:
        self._progress = progress
        self._tensors_done = 0
        self._cache_write = cache_write
        self._cache_thread: threading.Thread | None = None

    def _build_weights(self) -> Weights:
        """Prepared arrays by name (matrices from :meth:`matrix`, vectors from :meth:`tensor`;
        fused, validated)."""
        raise NotImplementedError

    # -- shared by the architectures' _build_weights ----------------------

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


__all__ = ["CACHE_ENV", "LoadProgressFn", "ModelWeights", "WEIGHT_CACHE_MIN_BYTES", "WeightCache"]
