"""Reading request bodies: JSON parsing and typed field readers.

Every reader raises :class:`~router.errors.BadRequest` naming the field
(``param``) — never a bare 500 or 422 for bad input. Unknown fields are
ignored: readers only look at what they are asked for.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from router.errors import BadRequest

_MISSING: Any = object()

#: Largest request body accepted, bytes.
MAX_BODY_BYTES = 32 * 1024 * 1024


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object. Raises BadRequest (empty, not JSON, not an object, too big)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest(f"request body exceeds {MAX_BODY_BYTES} bytes")
    if not body.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        data = json.loads(bytes(body), parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _present(body: dict[str, Any], key: str) -> bool:
    return key in body and body[key] is not None


def get_str(body: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    if not _present(body, key):
        if default is _MISSING:
            raise BadRequest(f"'{key}' is required", param=key)
        return default
    v = body[key]
    if not isinstance(v, str):
        raise BadRequest(f"'{key}' must be a string, got {type(v).__name__}", param=key)
    return v


def get_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    if not _present(body, key):
        return default
    v = body[key]
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {type(v).__name__}", param=key)
    return v


def get_int(body: dict[str, Any], key: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    """An integer field (a float with an integral value is accepted)."""
    if not _present(body, key):
        return default
    v = body[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {json.dumps(v)[:40]}", param=key)
    if lo is not None and v < lo:
        raise BadRequest(f"'{key}' must be >= {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise BadRequest(f"'{key}' must be <= {hi}, got {v}", param=key)
    return v


def get_float(body: dict[str, Any], key: str, default: Any, lo: float | None = None,
              hi: float | None = None) -> Any:
    if not _present(body, key):
        return default
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{key}' must be a number, got {json.dumps(v)[:40]}", param=key)
    if lo is not None and v < lo:
        raise BadRequest(f"'{key}' must be >= {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise BadRequest(f"'{key}' must be <= {hi}, got {v}", param=key)
    return float(v)


def get_stop(body: dict[str, Any], key: str = "stop") -> list[str]:
    """``stop``: a string or a list of strings (empty strings dropped)."""
    if not _present(body, key):
        return []
    v = body[key]
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > 64:
            raise BadRequest(f"'{key}' may hold at most 64 strings", param=key)
        return [s for s in v if s]
    raise BadRequest(f"'{key}' must be a string or a list of strings", param=key)


def get_logit_bias(body: dict[str, Any], key: str = "logit_bias") -> list[list[Any]]:
    """``logit_bias`` as [[token_id, bias], ...]: OpenAI's {"id": bias} map, or llama.cpp's
    [[id, bias|false], ...] list (false bans the token)."""
    if not _present(body, key):
        return []
    v = body[key]
    pairs: list[tuple[Any, Any]]
    if isinstance(v, dict):
        pairs = list(v.items())
    elif isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        pairs = [(p[0], p[1]) for p in v]
    else:
        raise BadRequest(f"'{key}' must be a map of token id to bias, or a list of [id, bias] pairs", param=key)
    out: list[list[Any]] = []
    for tid, bias in pairs:
        try:
            token = int(tid) if not isinstance(tid, bool) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0 or (isinstance(tid, float) and not tid.is_integer()):
            raise BadRequest(f"'{key}': token id {tid!r} is not a non-negative integer", param=key)
        if bias is False:
            out.append([token, -math.inf])
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise BadRequest(f"'{key}': bias for token {token} must be a number", param=key)
        out.append([token, max(-100.0, min(100.0, float(bias))) if math.isfinite(bias) else float(bias)])
    return out


def get_token_list(v: Any, key: str) -> list[int] | None:
    """``v`` as a list of token ids if it is one (non-empty, ints >= 0), else None."""
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if any(t < 0 for t in v):
            raise BadRequest(f"'{key}': token ids must be >= 0", param=key)
        return list(v)
    return None


def get_prompt(v: Any, key: str) -> str | list[int] | None:
    """``v`` as one prompt: a string, a non-empty list of token ids, or a one-element
    list holding either; None when it is none of these (the caller says why)."""
    if isinstance(v, str):
        return v
    ids = get_token_list(v, key)
    if ids is not None:
        return ids
    if isinstance(v, list) and len(v) == 1:
        if isinstance(v[0], str):
            return v[0]
        return get_token_list(v[0], key)
    return None
