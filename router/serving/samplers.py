"""llama.cpp's sampling fields that the engine does not implement, and its ``samplers`` order.

The engine's chain is llama.cpp's default order restricted to what it implements
(``worker/engine/sampling.py``): penalties, top_k, top_p, min_p, temperature. llama.cpp
also offers mirostat, typical-p, DRY, XTC, top-n-sigma, dynamic temperature, adaptive-p and
post-sampling probabilities; each is accepted only at its neutral value (the value
at which llama.cpp's own sampler changes nothing), else the request is a 400 naming
the field — never a silently different distribution. ``samplers`` (an array of
names, or llama.cpp's string of sampler characters) is accepted when the samplers
the engine implements appear in it all and in the engine's order (the others may be
listed anywhere: they are neutral).
"""

from __future__ import annotations

from typing import Any

from router.http.errors import BadRequest
from router.http.params import get_bool, get_float

#: The engine's chain, in order (llama.cpp's names, ``common_sampler_type_to_str``).
ENGINE_CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")

#: Samplers llama.cpp knows and the engine does not run (neutral by the fields below).
_OTHER = ("dry", "top_n_sigma", "typ_p", "xtc", "infill", "adaptive_p")

#: llama.cpp's sampler characters (``common_sampler_type_to_chr``).
_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
          "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p"}

#: Names llama.cpp accepts for them (``common_sampler_types_from_names`` with aliases).
_ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "typical-p": "typ_p", "typical": "typ_p",
            "typical_p": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p", "temp": "temperature",
            "top-n-sigma": "top_n_sigma"}

#: field -> (is it neutral?, what the neutral value is), llama.cpp's defaults.
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "mirostat": (lambda v: v == 0, "0"),
    "typical_p": (lambda v: v >= 1.0, "1.0"),
    "dry_multiplier": (lambda v: v == 0.0, "0.0"),
    "xtc_probability": (lambda v: v <= 0.0, "0.0"),
    "top_n_sigma": (lambda v: v <= 0.0, "-1 (off)"),
    "dynatemp_range": (lambda v: v <= 0.0, "0.0"),
    "min_keep": (lambda v: v <= 1, "0"),
    "adaptive_target": (lambda v: v < 0.0, "-1.0 (off)"),  # llama.cpp's adaptive-p sampler
}


def refuse_unimplemented(body: dict[str, Any]) -> None:
    """A 400 naming the first llama.cpp sampling field that would change the answer and
    that the engine does not implement (see the module docstring)."""
    for key, (neutral, value) in _NEUTRAL.items():
        v = get_float(body, key, None)
        if v is not None and not neutral(v):
            raise BadRequest(f"'{key}' is not supported (this server's sampler has no such stage); "
                             f"leave it out or at {value}", param=key)
    if get_bool(body, "post_sampling_probs", False):
        raise BadRequest("'post_sampling_probs' is served on /completion only: here probabilities are "
                         "reported before sampling (log-softmax of the model's logits)", param="post_sampling_probs")
    if body.get("samplers") is not None:
        check_order(body["samplers"])


def check_order(samplers: Any) -> None:
    """Accept ``samplers`` only when it runs the engine's chain in the engine's order."""
    if isinstance(samplers, str):
        names = [_CHARS.get(c) for c in samplers]
        if None in names:
            bad = next(c for c in samplers if c not in _CHARS)
            raise BadRequest(f"'samplers': unknown sampler character {bad!r}", param="samplers")
    elif isinstance(samplers, list) and all(isinstance(s, str) for s in samplers):
        names = [_ALIASES.get(s, s) for s in samplers]
        for s, n in zip(samplers, names, strict=True):
            if n not in ENGINE_CHAIN and n not in _OTHER:
                raise BadRequest(f"'samplers': unknown sampler {s!r}", param="samplers")
    else:
        raise BadRequest("'samplers' must be an array of sampler names or a string of sampler characters",
                         param="samplers")
    ours = tuple(n for n in names if n in ENGINE_CHAIN)
    if ours != ENGINE_CHAIN:
        raise BadRequest(f"'samplers': this server runs {', '.join(ENGINE_CHAIN)} in that order; "
                         f"got {', '.join(ours) or 'none of them'}", param="samplers")
