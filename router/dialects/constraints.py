"""Tools and response formats as constraints: the text the worker compiles into a
per-sequence token mask (``worker/engine/constraints.py``, llguidance).

The dialect layer turns ``tools`` + ``tool_choice`` into a Lark grammar over the
generic tool format (``router.dialects.tools``) and ``response_format`` / ``text.format`` /
``output_config.format`` into a JSON Schema text; the worker compiles either and an
invalid one is a 400 before any token (``invalid_grammar``, naming the field).

Tool grammars (``%json`` embeds a JSON Schema in llguidance's Lark dialect)::

    start: calls                      # required / named (named: exactly one call)
    start: calls | TEXT               # auto: text, or calls - never both
    calls: call+                      # parallel_tool_calls (else: one call)
    call: json_call | custom_call_0 ...
    json_call: "<tool_call>\\n" %json {...} "\\n</tool_call>"
    custom_call_0: "<tool_call name=\\"NAME\\">\\n" @custom_0 "\\n</tool_call>"   # a custom tool
    TEXT: /(.|\\n)*/ & ~/(.|\\n)*<\\/?tool(.|\\n)*/   # no tool markup ("<tool", "</tool") in text

where the schema of a call is ``{"name": {"const": NAME}, "arguments": PARAMETERS}``
(one per tool, ``anyOf`` when several; object schemas in PARAMETERS closed with
``additionalProperties: false`` unless they say otherwise), written with the
separators models use. Calls follow each other with nothing between them: after a
``</tool_call>`` the model may end (EOS) or open the next call at once.
"""

from __future__ import annotations

import json
from typing import Any

from router.http.errors import BadRequest
from router.http.params import get_str
from router.dialects.tools import CALL_CLOSE, GENERIC, Tool, ToolChoice, ToolSyntax

#: How the JSON of a call is written (the worker's default for json_schema too). ``lenient``: a
#: schema keyword the grammar cannot enforce (``propertyNames``, ``not``, ...) is left out — the
#: worker reports it and the response names it (``router.http.set_aside``) — never a failed request.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                              "lenient": True}


#: Schema keywords whose values are schemas / maps of schemas / lists of schemas.
_SUB_SCHEMA = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SUB_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists
    ``properties`` and does not say otherwise. Tool arguments then hold only the
    declared keys: still valid under the client's schema (a subset of what it allows),
    and a small greedy model does not pad its calls with invented keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for k in _SUB_SCHEMA:
        if k in out:
            out[k] = closed(out[k])
    for k in _SUB_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(v) for name, v in out[k].items()}
    for k in _SUB_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(v) for v in out[k]]
    return out


def _call_schema(t: Tool, args_key: str = "arguments") -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": t.name}, args_key: closed(t.parameters)},
            "required": ["name", args_key], "additionalProperties": False}


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lark string literal


#: Free text of a custom tool without a grammar (it may not close its block).
_FREE_INPUT = "start: FREE\nFREE: /(.|\\n)*/ & ~/(.|\\n)*<\\/tool_call>(.|\\n)*/\n"  # `&` joins terminals only


def _custom_grammar(t: Tool) -> str:
    """A custom tool's input grammar (Lark) from its format."""
    if t.grammar is None:
        return _FREE_INPUT
    syntax, definition = t.grammar
    if syntax == "regex":
        return "start: /" + definition.replace("/", "\\/") + "/\n"
    return definition


#: Plain text of an ``auto`` choice, per syntax: anything that does not open a call.
_TEXT = {
    "generic": "/(.|\\n)*/ & ~/(.|\\n)*<\\/?tool(.|\\n)*/",  # no tool markup ("<tool", "</tool")
    "hermes": "/(.|\\n)*/ & ~/(.|\\n)*<\\/?tool(.|\\n)*/",
    "llama3": "/(\\s*[^\\s{](.|\\n)*)?/",  # a call is a reply that is a JSON object
    "mistral": "/(.|\\n)*/ & ~/(.|\\n)*\\[TOOL_CALLS\\](.|\\n)*/",
}


def tool_constraint(tools: list[Tool], choice: ToolChoice, text_schema: str | None = None,
                    syntax: ToolSyntax = GENERIC) -> str | None:
    """The grammar that makes the model's answer follow ``choice`` over ``tools`` (None:
    unconstrained, when no tools are offered), in the template's tool ``syntax``.
    ``text_schema``: the JSON Schema text a plain reply must match (a response format);
    in ``auto`` mode the reply is then that JSON or calls (``start: calls | %json {...}``).

    Lark text, or, when custom tools are offered, llguidance's JSON grammar
    (``{"grammars": [main, one per custom tool]}``): a custom call's input is the
    tool's own grammar, referenced from the main one as ``@custom_<i>``. Custom tools
    come only with the generic (block) syntax (``router.dialects.tools.syntax_for``)."""
    if choice.mode == "none" or not tools:
        return None
    pool = [t for t in tools if t.name == choice.name] if choice.mode == "named" else tools
    functions = [t for t in pool if not t.custom]
    customs = [t for t in pool if t.custom]
    many = choice.parallel and choice.mode != "named" and syntax.parallel
    alts: list[str] = []
    lines: list[str] = []
    calls_rule = "calls: call+" if many else "calls: call"
    if functions:
        schemas = [_call_schema(t, syntax.args_key) for t in functions]
        one: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if syntax.array:  # Mistral: [TOOL_CALLS] and one JSON array of the calls
            arr: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
            if not many:
                arr["maxItems"] = 1
            lines.append(f"json_call: {_lark_str(syntax.prefix)} %json {_guided(arr)}")
            calls_rule = "calls: call"
        elif syntax.block is None:  # Llama 3: the reply is the call's JSON object
            lines.append(f"json_call: %json {_guided(one)}")
        else:
            lines.append(f"json_call: {_lark_str(syntax.block[0])} %json {_guided(one)} {_lark_str(syntax.block[1])}")
            if many and syntax.sep:
                calls_rule = f"calls: call ({_lark_str(syntax.sep)} call)*"
        alts.append("json_call")
    subs: list[dict[str, Any]] = []
    for i, t in enumerate(customs):
        lines.append(f"custom_call_{i}: {_lark_str(f'<tool_call name={json.dumps(t.name)}>' + chr(10))} "
                     f"@custom_{i} {_lark_str(chr(10) + CALL_CLOSE)}")
        alts.append(f"custom_call_{i}")
        subs.append({"name": f"custom_{i}", "lark_grammar": _custom_grammar(t)})
    text_rule = "TEXT" if text_schema is None else "%json " + _guided(json.loads(text_schema))
    head = [
        f"start: calls | {text_rule}" if choice.mode == "auto" else "start: calls",
        calls_rule,
        "call: " + " | ".join(alts),
    ]
    if choice.mode == "auto" and text_schema is None:
        lines.append("TEXT: " + _TEXT[syntax.name])
    main = "\n".join(head + lines) + "\n"
    if not subs:
        return main
    return json.dumps({"grammars": [{"lark_grammar": main}, *subs]}, ensure_ascii=False)


def _guided(schema: dict[str, Any]) -> str:
    """A schema for ``%json``, written in the call style (:data:`JSON_STYLE`)."""
    return json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def schema_text(schema: Any, param: str) -> str:
    """A client's JSON Schema as the text the worker compiles. Raises BadRequest naming ``param``."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise BadRequest(f"'{param}' must be a JSON Schema object", param=param)
    return json.dumps(schema, ensure_ascii=False)


def json_format_constraint(fmt: dict[str, Any], param: str) -> str | None:
    """The JSON Schema text a response format asks for (None: plain text).

    ``{"type": "text"}`` -> None; ``{"type": "json_object"}`` -> any JSON object (with a
    ``schema`` beside it, as llama-server takes it: that schema);
    ``{"type": "json_schema", ...}`` -> its schema, found as ``json_schema.schema``
    (chat completions) or ``schema`` (Responses API, Anthropic's ``output_config``).
    The schema is enforced; a keyword the constraint engine cannot enforce is left out
    (the grammar loosened to the nearest one it can enforce) and named in the response's
    ``X-Modelyard-Set-Aside`` header, never silently. Objects hold only their
    ``properties`` (``additionalProperties: false`` wherever the schema does not say):
    OpenAI's strict-mode rule, applied whether ``strict`` is set or not — an answer is
    still valid under the client's schema, and a small model does not pad its objects
    with invented keys (as for tool arguments). Raises BadRequest naming ``param``."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # llama.cpp's extension: a "schema" beside it is the schema
        if fmt.get("schema") is not None:
            return schema_text(fmt["schema"], f"{param}.schema")
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if isinstance(inner, dict) and "schema" in inner:
            schema, where = inner["schema"], f"{param}.json_schema.schema"
        elif "schema" in fmt:
            schema, where = fmt["schema"], f"{param}.schema"
        else:
            raise BadRequest(f"'{param}' of type json_schema needs a schema", param=param)
        return schema_text(closed(schema), where)
    raise BadRequest(f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                     param=f"{param}.type")


def llamacpp_constraint(body: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """llama.cpp's own constraint fields (``/completion``, and its OpenAI routes too):
    ``json_schema`` (a JSON Schema object) or ``grammar`` (a Lark grammar, llguidance's
    dialect; a leading ``%llguidance {}`` line, as llama.cpp takes it, is accepted) as
    (json_schema text, grammar, the field). An empty grammar is no constraint, as in
    llama.cpp. Both at once is a 400."""
    schema = body.get("json_schema")
    grammar = get_str(body, "grammar", None)
    if grammar is not None and not grammar.strip():
        grammar = None
    if schema is not None and grammar is not None:
        raise BadRequest("give at most one of 'json_schema' and 'grammar'", param="grammar")
    if schema is not None:
        return schema_text(schema, "json_schema"), None, "json_schema"
    if grammar is not None:
        return None, grammar, "grammar"
    return None, None, None
