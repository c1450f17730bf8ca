"""JSON bodies that always encode.

Starlette's ``JSONResponse`` renders with ``ensure_ascii=False`` and fails with
``UnicodeEncodeError`` (a bare 500) when a string holds a lone surrogate — which
happens when an error message echoes a client's value such as ``"model": "\\ud800"``.
Here such a body falls back to ASCII JSON, where the surrogate is a ``\\ud800``
escape: still valid JSON, and the client gets its precise 4xx.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse as _StarletteJSONResponse


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON of ``obj``, encoded once; ASCII escapes only when a lone
    surrogate makes UTF-8 impossible (see the module docstring)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class JSONResponse(_StarletteJSONResponse):
    """``application/json`` response whose body is :func:`dumps` of the content."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
