"""What the dialects and the operator's routes see of the models, as serving-layer types, so that
they never import ``router.workers``.

* :class:`ServedModel` — one model as a dialect sees it: its configuration, its state and
  what its worker said when ready (facts), its KV slots, and the few actions a dialect's route
  takes on it (a ``/slots`` probe). A generation goes through
  ``router.serving.generation.begin`` (the serving layer's door: submit, iterate events,
  cancel), one-shot worker calls through ``router.serving.calls``; neither needs more of the
  model than this. ``router.workers.slot.ModelSlot`` satisfies it (and so does a preset's view,
  ``router.serving.presets.PresetSlot``); only the serving layer turns it back into the slot
  (:func:`slot_of`).
* The model as a whole when it has replicas (``router.workers.replicas``): :func:`model_state`,
  :func:`serves_now`, :func:`replica_rows`, :func:`begin_load`, :func:`begin_unload`, :func:`load`,
  :func:`unload`, :func:`set_keep_alive` — one replica-aware answer for llama.cpp's and Ollama's
  routes, a generation's keep-alive and the operator's routes.
* :class:`ModelPool` — the configured models (``request.app.state.pool``: a model by name,
  every model); :class:`OperatorPool` — the pool as the operator's routes drive it (also its
  events, its launcher, a config reload, the concrete slots). ``router.workers.pool.Pool``
  satisfies both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from protocol import Ready
from router.config import Config, ModelConfig
from router.workers.events import EventHub
from router.workers.launchers import Launcher
from router.workers.lifecycle import LOADED as LOADED  # re-exported: the states a dialect reads
from router.workers.lifecycle import WorkerState as WorkerState  # re-exported
from router.workers.slot import ModelSlot


class ServedModel(Protocol):
    """One configured model as a dialect sees it (a preset's: its model's, with the preset's
    ``model``). Read-only facts, plus the actions named; nothing of its pool, worker or process.

    Its facts (properties; times are unix seconds):

    * ``model``: its configuration (a preset's: the preset's defaults over its model's);
    * ``state``: its worker's state (this slot's; the model as a whole with replicas: :func:`model_state`);
    * ``ready_info``: what the current worker said when ready (n_ctx, slots, template, ...); None while none is;
    * ``last_ready``: the last worker's Ready, kept while the model sleeps (unloaded for idleness);
    * ``sleeping``: unloaded for idleness and not woken since (llama-server's ``is_sleeping``);
    * ``total_slots``: the ready worker's KV slots; 0 when no worker is ready;
    * ``worker_command``: the current worker's command line (the arguments it was started with, as a
      worker started for this model); [] when no worker runs;
    * ``last_error``: why the last load failed or the worker stopped, when it did;
    * ``last_exit_code``: the last worker's exit code (None: none exited);
    * ``last_used``: when a request last finished; ``loaded_at``: when the last worker was ready.
    """

    @property
    def model(self) -> ModelConfig: ...
    @property
    def state(self) -> WorkerState: ...
    @property
    def ready_info(self) -> Ready | None: ...
    @property
    def last_ready(self) -> Ready | None: ...
    @property
    def sleeping(self) -> bool: ...
    @property
    def total_slots(self) -> int: ...
    @property
    def worker_command(self) -> list[str]: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def last_exit_code(self) -> int | None: ...
    @property
    def last_used(self) -> float | None: ...
    @property
    def loaded_at(self) -> float | None: ...

    def expires_at(self) -> float | None:
        """Unix time (s) the idle unload is due; None: not idle, or no time-to-live."""
        ...

    def idle_ttl(self) -> float | None:
        """The idle time-to-live in force, s (``idle_ttl_s``, or the last request's keep_alive)."""
        ...

    def resident_bytes(self) -> int:
        """Its memory: the worker's RSS when one runs, else placement's estimate once loaded, bytes."""
        ...

    def kv_slots(self) -> list[dict[str, Any]]:
        """One entry per KV slot of the ready worker (``id``, ``id_task``, ``is_processing``,
        ``n_past``; with replicas every replica's, also ``replica`` and ``node``)."""
        ...

    async def probe(self, timeout_s: float = 2.0) -> object:
        """Ask the ready worker for a fresh view of its slots now (at most ``timeout_s`` s)."""
        ...


def slot_of(model: ServedModel) -> ModelSlot:
    """The slot behind ``model`` — the serving layer's own step from the dialects' view to the
    workers' (a preset's view passes as its model's slot, showing the preset's ``model``)."""
    return cast(ModelSlot, model)


def model_state(model: ServedModel) -> WorkerState:
    """The model's state as a whole: with replicas, theirs together (``ReplicaSet.state``)."""
    replicas = slot_of(model).replica_set()
    return replicas.state() if replicas is not None else model.state


def serves_now(model: ServedModel) -> bool:
    """Whether the model is ready now (with replicas: any of them)."""
    replicas = slot_of(model).replica_set()
    return model.state is WorkerState.READY or (replicas is not None and bool(replicas.ready()))


def replica_rows(model: ServedModel) -> list[dict[str, Any]] | None:
    """Each replica's row (node, state, slots, load: ``ReplicaSet.replica_row``); None without replicas."""
    replicas = slot_of(model).replica_set()
    return [replicas.replica_row(r) for r in replicas.slots] if replicas is not None else None


def begin_load(model: ServedModel, *, operator: bool = True) -> bool:
    """Start loading without waiting (with replicas: each one); False when already loading or
    loaded. Raises as ``ModelSlot.begin_load`` (Conflict, ServerShuttingDown, crash backoff)."""
    slot = slot_of(model)
    replicas = slot.replica_set()
    return replicas.begin_load(operator=operator) if replicas is not None else slot.begin_load(operator=operator)


def begin_unload(model: ServedModel, *, drain: bool = True, reason: str = "unloaded by request") -> asyncio.Task[None]:
    """Start stopping the model's worker (with replicas: each one's; ``drain``: running requests
    finish first, as ``ModelSlot.unload``); the task that finishes it, which runs whether or not
    anyone awaits it."""
    slot = slot_of(model)
    replicas = slot.replica_set()
    return (replicas.begin_unload(drain=drain, reason=reason) if replicas is not None
            else slot.begin_unload(drain=drain, reason=reason))


def set_keep_alive(model: ServedModel, seconds: float | None) -> None:
    """A request's keep_alive for the model as a whole (with replicas: each one's idle timer): s;
    inf: until unloaded; None: the config's ``idle_ttl_s``; 0: unload once nothing runs or waits."""
    replicas = slot_of(model).replica_set()
    for s in replicas.slots if replicas is not None else [slot_of(model)]:
        s.set_keep_alive(seconds)


async def load(model: ServedModel) -> float:
    """Load the model and wait until it is ready (with replicas: each one); its load time, ms (with
    replicas: the longest). Raises as ``ModelSlot.load`` (ModelLoadFailed, Conflict while draining)."""
    slot = slot_of(model)
    replicas = slot.replica_set()
    return await (replicas.load() if replicas is not None else slot.load())


async def unload(model: ServedModel, *, drain: bool = True, reason: str = "unloaded by request") -> None:
    """:func:`begin_unload` and wait until it has ended (every replica unloaded); the unload runs
    on if the caller is cancelled."""
    await asyncio.shield(begin_unload(model, drain=drain, reason=reason))


class ModelPool(Protocol):
    """The configured models, as the dialects read them (``request.app.state.pool``)."""

    @property
    def config(self) -> Config:
        """The configuration in force (replaced by a reload)."""
        ...

    @property
    def slots(self) -> Mapping[str, ServedModel]:
        """Every configured model, by model name (presets have none of their own)."""
        ...

    def get(self, name: str) -> ServedModel:
        """The model of a name or alias (a preset's: its model's slot showing the preset's
        defaults). Raises NotFound listing the ids."""
        ...


class OperatorPool(ModelPool, Protocol):
    """The pool as the operator's routes drive it (``router.operator``): the concrete slots too."""

    @property
    def slots(self) -> Mapping[str, ModelSlot]:
        """Every configured model's slot, by model name."""
        ...

    def get(self, name: str) -> ModelSlot:
        """The slot of a model name or alias. Raises NotFound listing the ids."""
        ...

    @property
    def events(self) -> EventHub:
        """The model events (``GET /admin/events``)."""
        ...

    @property
    def launcher(self) -> Launcher:
        """Where workers run (its warm spare is shown by ``/admin/models``)."""
        ...

    def reload(self, new: Config) -> dict[str, list[str]]:
        """Apply a re-read config in one step; what was added, removed, changed."""
        ...


if TYPE_CHECKING:  # mypy holds the workers' types to what the dialects and the operator are given
    from router.workers.pool import Pool

    def _conforms(slot: ModelSlot, pool: Pool) -> tuple[ServedModel, ModelPool, OperatorPool]:
        return slot, pool, pool
