"""Which architectures can be loaded, and :func:`load_model`, the one door to build one.

``general.architecture`` -> :class:`~.model.Model` subclass, filled by :func:`register` (each
architecture module decorates its class). The weight modes and the default context size are the
protocol's facts (``protocol.limits``), re-exported here for the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.limits import DEFAULT_MAX_CTX, DEFAULT_WEIGHTS, WEIGHT_MODES

from ..errors import EngineError
from ..loading.gguf_loader import GGUFFile
from .weights import LoadProgressFn

if TYPE_CHECKING:
    from .model import Model

#: ``general.architecture`` -> Model subclass (filled by :func:`register`).
ARCHITECTURES: dict[str, type[Model]] = {}


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


__all__ = ["ARCHITECTURES", "DEFAULT_MAX_CTX", "DEFAULT_WEIGHTS", "WEIGHT_MODES", "load_model", "register"]
