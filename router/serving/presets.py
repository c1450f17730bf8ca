"""Presets served: several names over one loaded copy of a model (issue 27; llama.cpp #23704).
``[presets.NAME]`` is parsed by ``router.config_presets`` into the ModelConfig its requests see.

A request for a preset runs on its model's one worker (a preset never loads the model
again: the pool's slot is the model's, :class:`PresetSlot` only shows the preset's defaults
as ``.model``). A request's own value wins over the preset's, the preset's over the model's.
A preset's ``chat_template`` and template variables travel with each of its chat requests
(``Generate.chat_template``, ``Generate.template_kwargs``; the worker compiles a template once
and keeps the last few): ``reasoning`` (``"auto"``, ``"on"``, ``"off"`` as on a model, or true /
false) sets the template's ``enable_thinking``, ``chat_template_kwargs = {...}`` any other
variable; a request's own ``chat_template_kwargs`` win.
"""

from __future__ import annotations

from typing import Any

from router.config import ModelConfig


def preset_template(slot: Any) -> str | None:
    """The chat template a preset's requests render with when it is not its model's own (the
    worker renders the model's by default), else None."""
    if isinstance(slot, PresetSlot) and slot.model.chat_template is not None \
            and slot.model.chat_template != slot.base.model.chat_template:
        return slot.model.chat_template
    return None


class PresetSlot:
    """A model's slot as a preset's requests see it: ``model`` is the preset's ModelConfig
    (same name, path and worker settings as the model's; its own defaults); everything else —
    admission, the worker, state — is the model's one slot."""

    def __init__(self, slot: Any, model: ModelConfig) -> None:
        self._slot = slot
        self.model = model

    @property
    def base(self) -> Any:
        """The model's own slot."""
        return self._slot

    def __getattr__(self, name: str) -> Any:
        return getattr(self._slot, name)

    def describe(self) -> dict[str, Any]:
        return dict(self._slot.describe())
