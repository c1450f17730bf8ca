"""The sampling fields of a generation: declared once (:class:`SamplingFields`), read as one table
(:data:`SAMPLING_FIELDS`: name, type, default, bound) by everyone who needs the list.

A Generate carries them (it is a :class:`SamplingFields`); the worker hands them to its sampler
field by field from this table (``worker.frames.sampling_params``) and the engine's
``SamplingParams`` takes its defaults from :data:`SAMPLING_DEFAULTS`; the router's readers (request
fields, config defaults, ``/props``) can read the same table. Names and defaults are llama.cpp's
(llama-server's ``/completion``); the bounds are ``protocol.limits.GENERATE_LIMITS``'s.

Imports neither the router nor the worker; both import it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from protocol.limits import GENERATE_LIMITS, Bound

__all__ = ["SAMPLING_DEFAULTS", "SAMPLING_FIELDS", "SamplingField", "SamplingFields"]


@dataclass(frozen=True, kw_only=True)
class SamplingFields:
    """How one generation samples, stops and tokenizes its prompt (llama.cpp's names and defaults;
    temperature <= 0 is greedy; ``max_tokens`` None: until the context is full; ``logit_bias``: a
    list of [token_id, bias] pairs, a bias of false bans the token)."""

    add_special: bool = True
    parse_special: bool = True
    max_tokens: int | None = None
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: list[list[Any]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n_probs: int = 0  # top-N logprobs per token, 0 = none
    # llama.cpp's post_sampling_probs: the logprobs (the token's and the top n_probs) are of the
    # sampler chain's distribution (after top-k, top-p, min-p, temperature), not the model's
    post_sampling_probs: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True
    # Constraints (at most one; the worker masks every sampled token with it, and an invalid one
    # is an Error "invalid_grammar" before any token): ``json_schema`` — the text of a JSON Schema
    # the output must match; ``grammar`` — a Lark grammar (llguidance's dialect: ``%json {...}``,
    # regexes, ``start``) the output must match. The generation ends ("stop") when the
    # constraint allows nothing more.
    json_schema: str | None = None
    grammar: str | None = None


@dataclass(frozen=True)
class SamplingField:
    """One sampling field: its name, declared type (``int | None``, ``list[str]``, ...), default
    (a fresh copy for a list) and bound (None: any value of its type)."""

    name: str
    type: Any
    default: Any
    bound: Bound | None


def _table() -> tuple[SamplingField, ...]:
    hints = typing.get_type_hints(SamplingFields)
    out = []
    for f in dataclasses.fields(SamplingFields):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.append(SamplingField(f.name, hints[f.name], default, GENERATE_LIMITS.get(f.name)))
    return tuple(out)


#: Every sampling field, in declaration order.
SAMPLING_FIELDS: tuple[SamplingField, ...] = _table()
#: name -> default (read-only; a list default is an empty list: copy it before use).
SAMPLING_DEFAULTS: Mapping[str, Any] = MappingProxyType({f.name: f.default for f in SAMPLING_FIELDS})
