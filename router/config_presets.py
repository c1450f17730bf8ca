"""Presets: several names over one loaded copy of a model (issue 27; llama.cpp #23704).

``[presets.NAME]`` in ``config.toml``::

    [presets.smol-greedy]
    model = "SmolLM2-135M-Instruct"   # a configured model (its name or an alias)
    aliases = ["greedy"]
    temperature = 0.0                 # any sampling key of [models.NAME]: its defaults
    n_predict = 64                    # the answer's length when a request names none (and its cap)
    system_prompt = "Answer briefly." # the system message when a request sends none
    chat_template = "chatml"          # render its chats with this template (text or a known name)
    reasoning = "off"                 # the template's enable_thinking (thinking models)

Parsed here, with config's readers (``router.config_readers``), into the ModelConfig each
preset's requests see; ``router.serving.presets`` serves them (a preset's view of its model's
slot). A preset's ``chat_template`` and template variables travel with each of its chat
requests: ``reasoning`` (``"auto"``, ``"on"``, ``"off"`` as on a model, or true / false) sets
the template's ``enable_thinking``, ``chat_template_kwargs = {...}`` any other variable.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from router.config_readers import (
    REASONING_MODES, SAMPLING_KEYS, ConfigError, check_id, no_unknown, read_aliases, read_n_predict, read_opt_str,
    read_sampling,
)

if TYPE_CHECKING:
    from router.config import ModelConfig  # router.config imports this module: the type only

PRESET_KEYS = {"model", "aliases", "n_predict", "system_prompt", "chat_template", "chat_template_kwargs",
               "reasoning", *SAMPLING_KEYS}
#: Keys a preset cannot have, and why (named in the config error).
UNSUPPORTED = {
    "enable_thinking": 'write reasoning = "on" / "off" (the template\'s enable_thinking)',
}


def parse_presets(raw: dict[str, Any], models: dict[str, ModelConfig],
                  seen_ids: dict[str, str]) -> dict[str, ModelConfig]:
    """Each preset as the ModelConfig its requests see: the model's, with the preset's
    sampling, ``n_predict`` and ``system_prompt`` over it and ``preset`` set to its name.
    ``seen_ids`` (name -> owner) is extended with the presets' names and aliases.
    Raises ConfigError naming the key."""
    out: dict[str, ModelConfig] = {}
    for name, table in raw.items():
        where = f"presets.{name}"
        if not isinstance(table, dict):
            raise ConfigError(where, f"expected a table, got {type(table).__name__}")
        for key, why in UNSUPPORTED.items():
            if key in table:
                raise ConfigError(f"{where}.{key}", f"not supported in a preset: {why}")
        no_unknown(table, PRESET_KEYS, where)
        check_id(name, where)
        target = table.get("model")
        if not isinstance(target, str):
            raise ConfigError(f"{where}.model", "required: the name of a configured model")
        base = models.get(target) or next((m for m in models.values() if target in m.aliases), None)
        if base is None:
            raise ConfigError(f"{where}.model", f"{target!r} is not a configured model "
                              f"(models: {', '.join(models) or 'none'})")
        aliases = read_aliases(table, name, where, seen_ids, "")
        sampling = {**base.sampling, **read_sampling(table, lambda _key: where)}
        out[name] = dataclasses.replace(
            base, sampling=sampling, preset=name, aliases=tuple(aliases),
            n_predict=read_n_predict(table, where) if "n_predict" in table else base.n_predict,
            system_prompt=read_opt_str(table, "system_prompt", where) if "system_prompt" in table else base.system_prompt,
            chat_template=read_opt_str(table, "chat_template", where) if "chat_template" in table else base.chat_template,
            reasoning=_reasoning(table, where, base.reasoning),
            template_kwargs=_template_kwargs(table, where))
    return out


def _reasoning(table: dict[str, Any], where: str, default: str) -> str:
    """``reasoning``: as ``[models.NAME]``'s (``"auto"``, ``"on"``, ``"off"``: the template's
    ``enable_thinking``), or true / false. Raises ConfigError naming the key."""
    v = table.get("reasoning", default)
    if isinstance(v, bool):
        return "on" if v else "off"
    if v not in REASONING_MODES:
        raise ConfigError(f"{where}.reasoning", f"expected one of {', '.join(REASONING_MODES)} or true / false, got {v!r}")
    return str(v)


def _template_kwargs(table: dict[str, Any], where: str) -> dict[str, Any]:
    """``chat_template_kwargs``: a table of template variables (``enable_thinking`` is
    ``reasoning``'s). Raises ConfigError naming the key."""
    kw = table.get("chat_template_kwargs", {})
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise ConfigError(f"{where}.chat_template_kwargs", "expected a table of template variable names")
    reserved = sorted({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(kw))
    if reserved:
        raise ConfigError(f"{where}.chat_template_kwargs", f"cannot set {', '.join(reserved)}")
    return dict(kw)
