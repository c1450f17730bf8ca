"""A model's worker options, in one place: the ``python -m worker`` flags of a worker started for
the model, and the Assign that gives the same model to a warm spare (``protocol.Assign``, whose
fields are those flags). ``router.workers.launchers.local`` builds its command line from
:func:`option_args`; ``router.workers.process`` sends :func:`assign_for`.
"""

from __future__ import annotations

from protocol import Assign
from router.config import ModelConfig


def assign_for(model: ModelConfig, call_id: str) -> Assign:
    """The Assign naming ``model`` and its worker options (``kv_cache_dir``: the model's own
    subdirectory of the configured one; ``threads`` 0: as the worker started)."""
    return Assign(
        id=call_id, model=model.name, gguf=str(model.path), n_ctx=model.n_ctx, chat_template=model.chat_template,
        max_queue=model.max_queue, parallel=model.parallel,
        kv_budget_mib=None if model.kv_budget_mib is None else float(model.kv_budget_mib),
        weights=model.weights, n_ubatch=model.n_ubatch, threads=model.n_threads or 0,
        slot_save_path=None if model.slot_save_path is None else str(model.slot_save_path),
        kv_cache_dir=None if model.kv_cache_dir is None else str(model.kv_cache_dir / model.name),
        kv_cache_mib=float(model.kv_cache_mib), kv_events_endpoint=model.kv_events_endpoint,
        kv_events_block_size=model.kv_events_block_size, kv_events_to_router=model.kv_events_to_router)


def option_args(model: ModelConfig) -> list[str]:
    """``model``'s worker options as ``python -m worker`` flags (the fields of :func:`assign_for`)."""
    a = assign_for(model, "options")
    args = ["--model", a.model, "--gguf", a.gguf]
    if a.n_ctx is not None:
        args += ["--n-ctx", str(a.n_ctx)]
    if a.chat_template is not None:
        args += ["--chat-template", a.chat_template]
    if a.threads:
        args += ["--threads", str(a.threads)]
    args += ["--parallel", str(a.parallel)]
    if a.kv_budget_mib is not None:
        args += ["--kv-budget-mib", repr(a.kv_budget_mib)]
    if a.weights is not None:
        args += ["--weights", a.weights]
    if a.n_ubatch is not None:
        args += ["--n-ubatch", str(a.n_ubatch)]
    if a.slot_save_path is not None:
        args += ["--slot-save-path", a.slot_save_path]
    if a.kv_cache_dir is not None:
        args += ["--kv-cache-dir", a.kv_cache_dir, "--kv-cache-mib", repr(a.kv_cache_mib)]
    if a.kv_events_endpoint is not None:
        args += ["--kv-events-endpoint", a.kv_events_endpoint]
    if a.kv_events_to_router:
        args += ["--kv-events-to-router"]
    if a.kv_events_endpoint is not None or a.kv_events_to_router:
        args += ["--kv-events-block-size", str(a.kv_events_block_size)]
    args += ["--max-queue", str(a.max_queue)]
    return args
