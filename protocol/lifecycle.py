"""The worker's life frames: it says Hello, loads (LoadProgress, Ready) — a warm spare once
given its model (Assign) —, answers Ping with Pong and exits on Shutdown."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.frame import Message
from protocol.kv_events import DEFAULT_BLOCK_SIZE
from protocol.limits import WEIGHT_MODES


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Sent once right after the worker connects, before it loads its model.

    ``auth`` is the per-spawn secret the router handed this worker privately
    (``protocol.credentials``); the router accepts no peer without it. Empty when
    the worker was started without credentials (the router then ignores it)."""

    TYPE: ClassVar[str] = "hello"
    model: str  # configured model name; "" for a warm spare (it gets one with Assign)
    pid: int
    auth: str = ""


#: LoadProgress stages, in the order a load goes through them.
LOAD_STAGES = ("reading_gguf", "building_tokenizer", "preparing_tensors", "loading_kernels")


@dataclass(frozen=True, kw_only=True)
class LoadProgress(Message):
    """Between Hello and Ready: how far the load is (id: the worker's own id).

    ``stage`` is one of LOAD_STAGES: ``reading_gguf`` (the file's header and metadata;
    done 0 or 1 of total 1), ``building_tokenizer`` (the vocabulary, merges and chat
    template; 0 or 1 of 1), ``preparing_tensors`` (``done`` of ``total`` GGUF tensors
    dequantized into the engine's weights; absent when they come from the weight
    cache), ``loading_kernels`` (a quantized worker waiting for its numba kernels: loaded
    from the disk cache, or compiled when that is empty; 0 or 1 of 1). ``0 <= done <=
    total``, ``total >= 1``. The worker sends a stage's first and last step and at most a
    few in between per second."""

    TYPE: ClassVar[str] = "load_progress"
    stage: str
    done: int
    total: int

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if fields["stage"] not in LOAD_STAGES:
            return f"stage {fields['stage']!r} is not one of {list(LOAD_STAGES)}"
        if not (fields["total"] >= 1 and 0 <= fields["done"] <= fields["total"]):
            return f"done={fields['done']} total={fields['total']}: need 0 <= done <= total and total >= 1"
        return None


@dataclass(frozen=True, kw_only=True)
class Ready(Message):
    """Sent once the model is loaded: the worker's model identity. ``fingerprint`` is "" when
    the worker was still hashing a file it never saw (the first token does not wait for it);
    it then sends Ready again, identical but for the fingerprint, once the hash is done."""

    TYPE: ClassVar[str] = "ready"
    model: str  # configured model name
    architecture: str  # general.architecture, e.g. "llama", "gemma3"
    gguf_path: str
    file_size: int  # bytes
    fingerprint: str  # content fingerprint of the GGUF file (hex SHA-256), "" until computed
    n_ctx: int  # KV cache size, tokens
    n_ctx_train: int
    n_vocab: int
    has_chat_template: bool
    pid: int
    load_ms: float
    max_jobs: int = 1  # generations run at once: the worker's KV slots (config ``parallel``)
    kv_budget_tokens: int = 0  # KV positions the worker's budget holds in all (0: unknown)


@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """Health answer; sent even mid-generation.

    ``slots`` has one map per KV slot (``max_jobs`` of them), llama.cpp's
    ``/slots`` names: ``{"id": int, "id_task": str | None (the request id
    running in it), "is_processing": bool, "n_past": int (tokens its KV
    holds)}``.

    ``n_decode_total`` / ``n_busy_slots_total``: since the worker started, its batched forward
    passes (llama.cpp's ``llama_decode`` calls) and the sum over them of the slots busy at each
    (``server_metrics::on_decoded`` in llama.cpp's tools/server: a slot running a request,
    prefilling or decoding, counts whether or not that pass carried it).
    """

    TYPE: ClassVar[str] = "pong"
    busy: bool
    queue_len: int  # Generate requests waiting for a slot
    running_ids: list[str] = field(default_factory=list)  # every running request id
    slots: list[dict[str, Any]] = field(default_factory=list)
    kv_tokens: int = 0  # KV positions held (running sequences and idle prefix-cache entries)
    kv_budget_tokens: int = 0  # KV positions the budget allows in all
    n_decode_total: int = 0  # batched forward passes run since the worker started
    n_busy_slots_total: int = 0  # over those passes, the slots busy at each
    pid: int


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The options a worker serves its model with, in one place: ``python -m worker``'s flags of
    the same names, an :class:`Assign`'s fields, the worker's ``WorkerConfig``
    (:func:`model_options` copies them from any of those). Units: n_ctx, n_ubatch,
    kv_events_block_size tokens; kv_budget_mib, kv_cache_mib MiB. ``kv_events_*``: the worker's KV
    events (``protocol.kv_events``): the PUB socket it binds (None: none), its block size, and
    whether it also sends them to the router as KvEvents frames."""

    model: str  # configured model name (echoed in Hello / Ready)
    gguf: str  # path of the GGUF file on the worker's host
    n_ctx: int | None = None
    chat_template: str | None = None
    max_queue: int = 8
    parallel: int = 1
    kv_budget_mib: float | None = None
    weights: str | None = None  # one of protocol.limits.WEIGHT_MODES; None: the worker's default
    n_ubatch: int | None = None
    slot_save_path: str | None = None
    kv_cache_dir: str | None = None
    kv_cache_mib: float = 1024.0
    kv_events_endpoint: str | None = None
    kv_events_block_size: int = DEFAULT_BLOCK_SIZE
    kv_events_to_router: bool = False


def option_defaults() -> dict[str, Any]:
    """Each :class:`ModelOptions` default (every field but ``model`` and ``gguf``), by name: what a
    worker does when it is not told (``python -m worker`` without the flag). The one table of them:
    the worker's flags and ``router.config.ModelConfig`` (config.toml's defaults) take theirs from it."""
    return {f.name: f.default for f in dataclasses.fields(ModelOptions) if f.default is not dataclasses.MISSING}


def model_options(source: Any) -> dict[str, Any]:
    """The :class:`ModelOptions` fields of ``source`` (an Assign, a WorkerConfig, the worker's
    parsed arguments: anything with those attributes), by name."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(ModelOptions)}


@dataclass(frozen=True, kw_only=True)
class Assign(Message, ModelOptions):
    """Give a warm spare its model (id: the router's call id; the worker's frames keep their own).

    A spare is a worker started without a model (``python -m worker --spare``): it has
    done its interpreter start, imports and kernel loading, sent Hello with ``model`` "",
    and waits. On Assign it loads the model exactly as a worker started for it would
    (the fields are the ``python -m worker`` options of the same names), then sends
    LoadProgress and Ready, or Error "load_failed" and exits 1. Sent at most once; a
    worker that has a model answers another Assign with Error "protocol_error".

    ``threads`` > 0: the worker's BLAS threads (its NumPy is already loaded, so they are
    set as a Ping's ``threads`` are, not through the environment); 0: as the spare started.
    Its model options are :class:`ModelOptions`'.
    """

    TYPE: ClassVar[str] = "assign"
    threads: int = 0

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if not fields["model"] or not fields["gguf"]:
            return "model and gguf must be non-empty"
        for key in ("n_ctx", "n_ubatch"):
            if fields.get(key) is not None and fields[key] <= 0:
                return f"{key} must be a positive number of tokens, got {fields[key]}"
        if fields.get("max_queue", 0) < 0:
            return f"max_queue must be >= 0, got {fields['max_queue']}"
        if fields.get("parallel", 1) < 1:
            return f"parallel must be >= 1, got {fields['parallel']}"
        if fields.get("threads", 0) < 0:
            return f"threads must be >= 0, got {fields['threads']}"
        if fields.get("kv_budget_mib") is not None and not fields["kv_budget_mib"] > 0:
            return f"kv_budget_mib must be > 0, got {fields['kv_budget_mib']}"
        if not fields.get("kv_cache_mib", 1.0) > 0:
            return f"kv_cache_mib must be > 0, got {fields['kv_cache_mib']}"
        if fields.get("weights") is not None and fields["weights"] not in WEIGHT_MODES:
            return f"weights {fields['weights']!r} is not one of {list(WEIGHT_MODES)}"
        if fields.get("kv_events_block_size", 1) < 1:
            return f"kv_events_block_size must be >= 1, got {fields['kv_events_block_size']}"
        endpoint = fields.get("kv_events_endpoint")
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            return f"kv_events_endpoint must be tcp://... or ipc://..., got {endpoint!r}"
        return None


@dataclass(frozen=True, kw_only=True)
class Ping(Message):
    """Liveness (answered by a Pong). ``threads`` > 0: use that many BLAS threads from now
    on (the router's share of the cores, sent only to workers without ``--threads``)."""

    TYPE: ClassVar[str] = "ping"
    threads: int = 0


@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    """Ask the worker to cancel its work and exit."""

    TYPE: ClassVar[str] = "shutdown"
