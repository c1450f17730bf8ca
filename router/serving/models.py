"""What the dialects see of the models, as serving-layer types, so that they never import
``router.workers.pool``: the pool as a :class:`ModelPool` (its configuration, a model's slot by
name, every slot), which ``router.workers.pool.Pool`` satisfies, and a model's slot as
``ModelSlot``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from router.config import Config
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
