"""Tools and response formats as constraints (the text of a grammar the worker enforces
with a per-sequence token mask).

The dialect layer only turns ``tools`` / ``tool_choice`` / ``response_format`` into a
constraint here, and parses the output (``router.tools``); the worker
(``worker/engine/constraints.py``) compiles and enforces it.
"""

from __future__ import annotations

from typing import Any

from router.errors import BadRequest
from router.tools import Tool, ToolChoice


def tool_constraint(tools: list[Tool], choice: ToolChoice) -> str | None:
    """The Lark grammar that makes the model's answer follow ``choice`` over ``tools``
    (None: unconstrained)."""
    if choice.mode in ("none", "auto"):
        return None
    raise BadRequest("forcing a tool call ('tool_choice') is not supported yet", param="tool_choice")


def json_format_constraint(fmt: dict[str, Any], param: str) -> str | None:
    """The JSON Schema text a response format (``{"type": "text" | "json_object" |
    "json_schema", ...}``) asks for (None: plain text). Raises BadRequest naming ``param``."""
    if fmt.get("type") == "text":
        return None
    raise BadRequest(f"'{param}' {fmt.get('type')!r} is not supported yet", param=param)
