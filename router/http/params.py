"""Reading request bodies: JSON parsing and typed field readers.

Every reader raises :class:`~router.http.errors.BadRequest` naming the field
(``param``) — never a bare 500 or 422 for bad input. Unknown fields are
ignored: readers only look at what they are asked for.

Integers are bounded here, at the boundary, so every value handed to the
worker fits the wire format (msgpack carries integers in [-2**63, 2**64-1]):
:func:`get_int` without explicit bounds accepts only a signed 64-bit value;
token ids are in [0, 2**31); counts such as ``max_tokens``, ``n_predict``,
``top_k`` and ``repeat_last_n`` are at most ``INT32_MAX``; ``seed`` is any
integer in [-2**63, 2**64-1] (a negative seed means "random", as in llama.cpp;
anything outside is a 400, never silently reduced). A huge integer in a
number field (``temperature`` = 10**400) is a 400 too, not an OverflowError.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from protocol.limits import Bound
from router.http.errors import BadRequest, PayloadTooLarge, RequestTimeout
from router.http.security import check_json_content_type
from router.http.sse import ClientDisconnected

log = logging.getLogger("modelyard.params")

_MISSING: Any = object()

#: Largest request body accepted, bytes.
#: 8 MiB: far above any prompt a model here can take, and well under the protocol's
#: 16 MiB frame limit, so an accepted prompt fits one Generate frame.
MAX_BODY_BYTES = 8 * 1024 * 1024

#: Bounds of integer request fields (see the module docstring).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: ``n_predict`` (and its aliases on /completion) in [N_PREDICT_MIN, INT32_MAX]: -1 is "until n_ctx";
#: llama.cpp's own hard limit (tools/server/server-schema.cpp), so -5 is a 400 there and here.
N_PREDICT_MIN = -1
#: Token ids are in [0, MAX_TOKEN_ID]; the worker checks them against its vocabulary.
MAX_TOKEN_ID = INT32_MAX
#: ``seed``: what the protocol can carry (a negative seed means random).
SEED_MIN, SEED_MAX = INT64_MIN, UINT64_MAX


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises UnsupportedMediaType (415: not a JSON Content-Type, checked before any
    byte is read), RequestTimeout (408: the whole body did not arrive within
    ``server.body_timeout_s``), ClientDisconnected (the client left before sending
    it all: one INFO line, no traceback), BadRequest (empty, not JSON, not an
    object), PayloadTooLarge (over MAX_BODY_BYTES)."""
    check_json_content_type(request.headers)
    timeout_s = request.app.state.config.server.body_timeout_s
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise PayloadTooLarge(f"request body exceeds {MAX_BODY_BYTES} bytes")
    except TimeoutError:
        log.info("%s %s: body not received within body_timeout_s=%g s (%d bytes so far); closing",
                 request.method, request.url.path, timeout_s, len(body))
        raise RequestTimeout(f"the request body did not arrive within body_timeout_s={timeout_s:g} s") from None
    except ClientDisconnect:
        log.info("%s %s: client disconnected before sending its whole body (%d bytes received)",
                 request.method, request.url.path, len(body))
        raise ClientDisconnected("client disconnected before sending its body") from None
    if not body.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        data = json.loads(bytes(body), parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_type(data)}")
    if re.search(rb"\\u[dD][89a-fA-F]", body):  # a UTF-16 surrogate escape: paired ones are fine
        where = _lone_surrogate(data, "")
        if where is not None:
            raise BadRequest(f"'{where or 'body'}' holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                             "without its pair): not valid Unicode text", param=where or None)
    request.state.json_body = data  # the shared generation path reads keep_alive / ttl from it
    return data


def _lone_surrogate(v: Any, where: str) -> str | None:
    """The path of the first string (or key) in ``v`` with an unpaired surrogate, or None."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            sub = f"{where}.{k}" if where else str(k)
            found = _lone_surrogate(k, sub) if isinstance(k, str) else None
            found = found if found is not None else _lone_surrogate(x, sub)
            if found is not None:
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _lone_surrogate(x, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def json_type(v: Any) -> str:
    """The JSON name of ``v``'s type, for error messages ("null", "object", "array", ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    return type(v).__name__


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
        raise BadRequest(f"'{key}' must be a string, got {json_type(v)}", param=key)
    return v


def model_of(body: dict[str, Any], default: str | None, ids: list[str]) -> str:
    """``body["model"]``; when it is absent, null or "", ``default`` (``Config.default_name``:
    ``[server] default_model`` or the only configured model), as llama-server serves its model
    to a request that names none. Raises BadRequest (param "model") when there is no default."""
    name = get_str(body, "model", None)
    if name:
        return str(name)
    if default is None:
        raise BadRequest(f"'model' is required (no [server] default_model is set and several models are "
                         f"configured); available models: {', '.join(ids)}", param="model")
    return default


def get_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    if not _present(body, key):
        return default
    v = body[key]
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {json_type(v)}", param=key)
    return v


def get_int(body: dict[str, Any], key: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    """An integer field (a float with an integral value is accepted). Bounds not
    given default to the signed 64-bit range: no integer read here is ever too
    big for the wire."""
    if not _present(body, key):
        return default
    v = body[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {_show(v)}", param=key)
    lo = INT64_MIN if lo is None else lo
    hi = INT64_MAX if hi is None else hi
    if v < lo:
        raise BadRequest(f"'{key}' must be >= {lo}, got {_show(v)}", param=key)
    if v > hi:
        raise BadRequest(f"'{key}' must be <= {hi}, got {_show(v)}", param=key)
    return v


def _show(v: Any) -> str:
    """``v`` for an error message, cut short (a rejected value may be huge)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {v.bit_length()} bits"
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_float(v: Any) -> float | None:
    """``v`` as a finite float, or None if it is not a number (bool, str, NaN, inf,
    an integer too big for a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def get_bounded(body: dict[str, Any], key: str, default: Any, bound: Bound, *, integer: bool = False) -> Any:
    """A number field checked against a ``protocol.limits`` bound (the table the worker
    enforces too): a 400 naming ``key`` outside it."""
    v = get_int(body, key, default) if integer else get_float(body, key, default)
    if _present(body, key) and not bound.contains(v):
        raise BadRequest(f"'{key}' must be {bound.describe()}, got {_show(v)}", param=key)
    return v


def get_float(body: dict[str, Any], key: str, default: Any, lo: float | None = None,
              hi: float | None = None) -> Any:
    if not _present(body, key):
        return default
    f = _as_float(body[key])
    if f is None:
        raise BadRequest(f"'{key}' must be a finite number, got {_show(body[key])}", param=key)
    if lo is not None and f < lo:
        raise BadRequest(f"'{key}' must be >= {lo}, got {f}", param=key)
    if hi is not None and f > hi:
        raise BadRequest(f"'{key}' must be <= {hi}, got {f}", param=key)
    return f


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


def get_logit_bias(body: dict[str, Any], key: str = "logit_bias", *, strict: bool = False) -> list[list[Any]]:
    """``logit_bias`` as [[token_id, bias], ...]: OpenAI's {"id": bias} map, or llama.cpp's
    [[id, bias|false], ...] list (false bans the token).

    Token ids must be integers in [0, MAX_TOKEN_ID]. With ``strict`` (OpenAI's rule, for
    /v1/*) a bias outside [-100, 100] is a 400; otherwise (llama.cpp's /completion,
    permissive) it is clamped to that range and +-inf are kept (inf: ban / force)."""
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
        token = _token_id(tid)
        if token is None:
            raise BadRequest(f"'{key}': token id {_show(tid)} is not an integer in [0, {MAX_TOKEN_ID}]",
                             param=key)
        if bias is False:
            out.append([token, -math.inf])
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or (isinstance(bias, float)
                                                                           and math.isnan(bias)):
            raise BadRequest(f"'{key}': bias for token {token} must be a number", param=key)
        if strict:
            f = _as_float(bias)
            if f is None or not -100.0 <= f <= 100.0:
                raise BadRequest(f"'{key}': bias for token {token} must be between -100 and 100, "
                                 f"got {_show(bias)}", param=key)
            out.append([token, f])
            continue
        f = _as_float(bias)
        if f is None:  # +-inf, or an integer too big for a float: keep its sign
            out.append([token, math.inf if bias > 0 else -math.inf])
        else:
            out.append([token, max(-100.0, min(100.0, f))])
    return out


def _token_id(v: Any) -> int | None:
    """``v`` (an int, an integral float, or a decimal string as in OpenAI's map keys) as a
    token id in [0, MAX_TOKEN_ID], else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float):
        if not v.is_integer():
            return None
        v = int(v)
    elif isinstance(v, str):
        s = v.strip()
        if not s.isascii() or not s.isdigit() or len(s) > 12:
            return None
        v = int(s)
    if not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID:
        return None
    return v


def get_token_list(v: Any, key: str) -> list[int] | None:
    """``v`` as a list of token ids if it is one (non-empty, ints), else None.
    Raises BadRequest for an id outside [0, MAX_TOKEN_ID]."""
    if not isinstance(v, list) or not v:
        return None
    # C-level passes first (a 1M-id body: ~30 ms of the event loop instead of ~0.2 s); the
    # item-by-item loops only name the offender
    if set(map(type, v)) != {int} and not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    if not (0 <= min(v) and max(v) <= MAX_TOKEN_ID):
        for t in v:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise BadRequest(f"'{key}': token ids must be integers in [0, {MAX_TOKEN_ID}], got {_show(t)}",
                                 param=key)
    return list(v)


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
