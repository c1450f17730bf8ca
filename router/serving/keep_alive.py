"""A request's own keep-alive for its model: Ollama's ``keep_alive`` or LM Studio's ``ttl``.

* ``keep_alive`` (Ollama): a number of seconds, or a Go duration string (``"5m"``,
  ``"1h30m"``, ``"300ms"``, ``"10s"``; a bare number string is seconds); a negative value
  keeps the model loaded until unloaded by hand; ``0`` unloads it as soon as the request is done.
* ``ttl`` (LM Studio): seconds, >= 0 (used when ``keep_alive`` is absent).

The value replaces the model's idle time-to-live (``idle_ttl_s``) from this request on, as
Ollama's does: the model unloads that long after its last request finished (``ps`` and
``/admin/models``' ``expires_at`` show when). ``[server] max_keep_alive_s`` caps it (a
negative "forever" becomes the cap); a capped value is set aside visibly
(``X-Modelyard-Set-Aside: keep_alive:capped to Ns``). A pinned model is never unloaded for it.
Anything else is a 400 naming the field. ``null`` is absent.
"""

from __future__ import annotations

import math
import re
from typing import Any

from router.http.errors import BadRequest
from router.http.set_aside import set_aside

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
#: Longest keep-alive accepted as a finite value, s (beyond it: as good as forever).
MAX_FINITE_S = 10 * 365 * 86400.0


def parse_duration(text: str) -> float:
    """Seconds of a Go duration string (``time.ParseDuration``: ``"1h30m"``, ``"-1m"``,
    ``"300ms"``) or of a bare number (seconds). Raises ValueError."""
    t = text.strip()
    try:
        return float(t)
    except ValueError:
        pass
    sign = -1.0 if t.startswith("-") else 1.0
    body = t.lstrip("+-")
    if not body:
        raise ValueError(text)
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(body):
        m = _PART.match(body, pos)
        if m is None:
            raise ValueError(text)
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return sign * total


def requested(body: dict[str, Any]) -> tuple[str, float] | None:
    """The request's (field, seconds) — ``math.inf`` for "until unloaded" — or None when it
    sets none. Raises BadRequest naming the field."""
    raw = body.get("keep_alive")
    field = "keep_alive"
    if raw is None:
        raw = body.get("ttl")
        field = "ttl"
        if raw is None:
            return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise BadRequest(f"'{field}' must be a number of seconds" + (" or a duration such as \"5m\""
                         if field == "keep_alive" else ""), param=field)
    if isinstance(raw, str):
        if field == "ttl":
            raise BadRequest("'ttl' must be a number of seconds", param=field)
        try:
            seconds = parse_duration(raw)
        except ValueError:
            raise BadRequest(f"'keep_alive' {raw!r} is not a duration (a number of seconds, or e.g. "
                             "\"30s\", \"5m\", \"1h\"; negative: until unloaded)", param=field) from None
    else:
        seconds = float(raw)
    if not math.isfinite(seconds):
        raise BadRequest(f"'{field}' must be finite", param=field)
    if seconds < 0:
        if field == "ttl":
            raise BadRequest("'ttl' must be >= 0 seconds", param=field)
        return field, math.inf
    return field, (math.inf if seconds > MAX_FINITE_S else seconds)


def apply(state: Any, body: dict[str, Any] | None, cap: float | None) -> float | None:
    """The keep-alive (s; inf: until unloaded) the request sets, capped by ``cap``
    (``max_keep_alive_s``; a cap is set aside visibly on ``state``), or None."""
    if body is None:
        return None
    got = requested(body)
    if got is None:
        return None
    field, seconds = got
    if cap is not None and seconds > cap:
        set_aside(state, field, f"capped to {cap:g}s",
                  f"the server's max_keep_alive_s is {cap:g} s (asked: "
                  f"{'until unloaded' if math.isinf(seconds) else f'{seconds:g} s'})")
        return cap
    return seconds
