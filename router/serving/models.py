"""What the dialects and the operator's routes see of the models, as serving-layer types, so that
they never import ``router.workers.pool``: the pool as a :class:`ModelPool` (its configuration, a
model's slot by name, every slot) or, for the operator, an :class:`OperatorPool` (also its events,
its launcher, a config reload), which ``router.workers.pool.Pool`` satisfies, and a model's slot
as ``ModelSlot``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from router.config import Config
from router.workers.events import EventHub
from router.workers.launchers import Launcher
from router.workers.slot import ModelSlot as ModelSlot  # re-exported: the dialects' type of a model


class ModelPool(Protocol):
    """The configured models, as the dialects read them (``request.app.state.pool``)."""

    @property
    def config(self) -> Config:
        """The configuration in force (replaced by a reload)."""
        ...

    @property
    def slots(self) -> Mapping[str, ModelSlot]:
        """Every configured model's slot, by model name (presets have none of their own)."""
        ...

    def get(self, name: str) -> ModelSlot:
        """The slot of a model name or alias (a preset's: its model's slot showing the preset's
        defaults). Raises NotFound listing the ids."""
        ...


class OperatorPool(ModelPool, Protocol):
    """The pool as the operator's routes drive it (``router.operator``)."""

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
