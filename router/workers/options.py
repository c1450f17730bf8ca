"""A model's worker options, in one place: the ``python -m worker`` flags of a worker started for
the model, and the Assign that gives the same model to a warm spare (``protocol.Assign``, whose
fields are those flags). ``router.workers.launchers.local`` builds its command line from
:func:`option_args`; ``router.workers.process`` sends :func:`assign_for`.
"""

from __future__ import annotations

from protocol import Assign
from protocol.lifecycle import model_options
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
    """``model``'s worker options as ``python -m worker`` flags: each field of
    ``protocol.ModelOptions`` of :func:`assign_for` as ``--the-field-name VALUE`` (a true bool as
    the bare flag; None, false, ``kv_cache_mib`` without a cache directory and the events' block
    size without events left out), and ``--threads`` when set."""
    a = assign_for(model, "options")
    events = a.kv_events_endpoint is not None or a.kv_events_to_router
    args: list[str] = []
    for name, v in model_options(a).items():
        if v is None or v is False or (name == "kv_cache_mib" and a.kv_cache_dir is None) \
                or (name == "kv_events_block_size" and not events):
            continue
        flag = "--" + name.replace("_", "-")
        args += [flag] if v is True else [flag, repr(v) if isinstance(v, float) else str(v)]
    return args + (["--threads", str(a.threads)] if a.threads else [])
