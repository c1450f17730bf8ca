"""What :meth:`~.engine.Engine.load` does: the arguments checked, the GGUF read, the kernel
warm-up started beside the build, the tokenizer and chat template, the model, the scheduler, and
:class:`EngineInfo`, the identity and sizes of what was loaded."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .errors import EngineError
from .loading import resident
from .scheduler import Scheduler
from .text.builtin_templates import resolve_template
from .text.chat_template import ChatTemplate
from .text.tokenizer import Tokenizer
from .warmup import column_slice_types, take_preload, warm_up_kernels, warm_up_slices

__all__ = ["EngineInfo", "Loaded", "load_parts"]

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class EngineInfo:
    """Identity and sizes of a loaded model."""

    architecture: str  # general.architecture, e.g. "llama", "gemma3"
    name: str  # general.name or the file stem
    n_ctx: int  # KV cache size in tokens
    n_ctx_train: int
    n_vocab: int
    file_size: int  # bytes
    fingerprint: str  # hex SHA-256 of the file (gguf_loader's identity rule); "" until computed (Engine.fingerprint)
    has_chat_template: bool
    bos_token: str | None
    eos_token: str | None
    n_parallel: int = 1  # KV slots: sequences decoded at once
    kv_budget_tokens: int = 0  # KV positions the budget holds in all
    kv_token_bytes: int = 0  # bytes of K and V per position
    weights: str = "quantized"  # how weight matrices are held: "quantized" | "f32"
    weight_bytes: int = 0  # bytes of the prepared weights in memory


class Loaded(NamedTuple):
    """What a load gives the :class:`~.engine.Engine` (its constructor's arguments, in order)."""

    gguf: Any  # the GGUFFile
    model: Any  # the architecture's Model
    tokenizer: Tokenizer
    template: ChatTemplate | None
    info: EngineInfo
    scheduler: Scheduler


def load_parts(gguf_path: str, n_ctx: int | None = None, chat_template: str | None = None, *,
               parallel: int = 1, kv_budget_mib: float | None = None, n_batch: int | None = None,
               weights: str | None = None, n_ubatch: int | None = None,
               progress: Progress | None = None) -> Loaded:
    """:meth:`~.engine.Engine.load` (its arguments, its progress stages, its errors)."""
    from .arch.registry import DEFAULT_WEIGHTS, load_model  # n_ctx None -> min(n_ctx_train, 8192) there
    from .loading.gguf_loader import read_gguf
    from .scheduler import DEFAULT_N_BATCH, DEFAULT_N_UBATCH

    path = Path(gguf_path)
    weights = DEFAULT_WEIGHTS if weights is None else weights
    _check_args(gguf_path, n_ctx, chat_template, parallel, kv_budget_mib, n_batch, n_ubatch, weights)
    report = progress if progress is not None else _no_progress
    report("reading_gguf", 0, 1)
    gguf = _wrap(read_gguf, str(path))
    gguf.start_fingerprint()  # hashed on a background thread while the model is built
    warm = _start_warm_up(gguf) if weights == "quantized" else None
    report("reading_gguf", 1, 1)
    md = gguf.metadata
    arch = gguf.architecture
    n_ctx_train = md.get(f"{arch}.context_length")
    if isinstance(n_ctx_train, bool) or not isinstance(n_ctx_train, int) or n_ctx_train <= 0:
        raise EngineError("invalid_gguf", f"GGUF has no valid {arch}.context_length")
    report("building_tokenizer", 0, 1)
    tokenizer = _wrap(Tokenizer.from_metadata, md)
    source = resolve_template(chat_template) if chat_template is not None else md.get("tokenizer.chat_template")
    template = None
    if isinstance(source, str) and source.strip():
        template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token,
                                strip_bos=tokenizer.add_bos, strip_eos=tokenizer.add_eos)
    report("building_tokenizer", 1, 1)
    model = _wrap(load_model, gguf, n_ctx, weights=weights, progress=progress)
    if warm is not None:  # kernels from numba's cache (~0.3 s), or compiled into an empty one (tens of s)
        report("loading_kernels", 0, 1)
        warm.join()  # before any kernel runs on this thread (one numba parallel launch at a time)
        warm_up_slices(column_slice_types(model.w.values()), getattr(model, "decode_blocks", None) is not None)
        report("loading_kernels", 1, 1)
    resident.trim_heap()  # the load's freed temporaries (dequantization, metadata parsing) back to the OS
    token_bytes = model.kv_shape.token_bytes
    budget_tokens = (parallel * int(model.n_ctx) if kv_budget_mib is None
                     else max(1, int(kv_budget_mib * 2**20) // token_bytes))
    sched = Scheduler(model, tokenizer, n_parallel=parallel, kv_budget_tokens=budget_tokens,
                      n_batch=DEFAULT_N_BATCH if n_batch is None else n_batch,
                      n_ubatch=DEFAULT_N_UBATCH if n_ubatch is None else n_ubatch)
    name = md.get("general.name")
    info = EngineInfo(
        architecture=arch,
        name=name if isinstance(name, str) and name else path.stem,
        n_ctx=int(model.n_ctx),
        n_ctx_train=n_ctx_train,
        n_vocab=int(model.n_vocab),
        file_size=int(gguf.file_size),
        fingerprint=gguf.fingerprint_nowait() or "",
        has_chat_template=template is not None,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        n_parallel=parallel,
        kv_budget_tokens=budget_tokens,
        kv_token_bytes=token_bytes,
        weights=model.weights,
        weight_bytes=int(model.weight_bytes),
    )
    return Loaded(gguf, model, tokenizer, template, info, sched)


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def _check_args(gguf_path: str, n_ctx: int | None, chat_template: str | None, parallel: int,
                kv_budget_mib: float | None, n_batch: int | None, n_ubatch: int | None, weights: str) -> None:
    """Raises: EngineError("file_not_found" | "invalid_params"), as :meth:`~.engine.Engine.load` says."""
    from .arch.registry import WEIGHT_MODES

    if not Path(gguf_path).is_file():
        raise EngineError("file_not_found", f"GGUF file not found: {gguf_path}")
    if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0):
        raise EngineError("invalid_params", f"n_ctx must be a positive integer, got {n_ctx!r}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise EngineError("invalid_params", "chat_template must be a string")
    for name, v in (("parallel", parallel), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
        if (v is not None or name == "parallel") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise EngineError("invalid_params", f"{name} must be an integer >= 1, got {v!r}")
    if kv_budget_mib is not None and (isinstance(kv_budget_mib, bool) or not isinstance(kv_budget_mib, (int, float))
                                      or not kv_budget_mib > 0):
        raise EngineError("invalid_params", f"kv_budget_mib must be a positive number, got {kv_budget_mib!r}")
    if weights not in WEIGHT_MODES:
        raise EngineError("invalid_params", f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")


def _start_warm_up(gguf: Any) -> threading.Thread:
    """numba's import and the cached kernels of ``gguf``'s tensor types, loading on a thread
    while the model is built (``load_parts`` joins it before any kernel runs)."""
    from .arch.registry import ARCHITECTURES, _register_builtin

    types = {t.type.name for t in gguf.tensors.values()}
    _register_builtin()
    arch_cls = ARCHITECTURES.get(gguf.architecture)
    warm = threading.Thread(target=warm_up_kernels, daemon=True, name="modelyard-warm-up",
                            args=(types, take_preload(), getattr(arch_cls, "ffn_act", None)))
    warm.start()
    return warm


def _wrap(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a loader; any failure that is not an EngineError becomes ``invalid_gguf``."""
    try:
        return fn(*args, **kwargs)
    except EngineError:
        raise
    except MemoryError:
        raise
    except Exception as e:
        raise EngineError("invalid_gguf", f"cannot load GGUF: {type(e).__name__}: {e}") from e
