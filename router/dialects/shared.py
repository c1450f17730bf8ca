"""What the three chat dialects (OpenAI chat, OpenAI Responses, Anthropic Messages)
share once each has read its own request: tools and tool choices checked the same
way, text content parts joined the same way, and :func:`prepare` — the one place
that turns dialect-neutral turns + tools + a response format into what the worker
gets (messages, the template's ``tools``, the constraint) and the parser that reads
the answer back, in the tool syntax of the model's template (``router.dialects.tools``).
"""

from __future__ import annotations

import functools
from importlib import metadata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from router.dialects.constraints import tool_constraint
from router.http.errors import BadRequest
from router.gguf_meta import chat_template as model_chat_template
from router.serving.models import ServedModel
from router.dialects.call_parser import CallParser
from router.dialects.tools import (
    ChatTurn,
    Tool,
    ToolChoice,
    ToolSyntax,
    TrailingAssistants,
    detect_syntax,
    render_messages,
    syntax_for,
    template_tools,
)


#: llama.cpp's LLAMA_DEFAULT_SEED: "random" (its generation settings show it for an unseeded request).
RANDOM_SEED = 0xFFFFFFFF


def build_info() -> str:
    """``modelyard <version>`` (llama.cpp puts its build number and commit here)."""
    try:
        return f"modelyard {metadata.version('modelyard')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "modelyard"


@functools.lru_cache(maxsize=32)
def _syntax_of_text(template: str) -> ToolSyntax:
    return detect_syntax(template)


def template_syntax(slot: ServedModel) -> ToolSyntax:
    """The tool syntax of ``slot``'s chat template (the configured one, else the GGUF's)."""
    return _syntax_of_text(model_chat_template(slot.model.chat_template, slot.model.path))


def objects(v: Any, param: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, item)`` for each item of ``v``, a non-empty array of objects at ``param``
    (``messages``, ``input``). Raises BadRequest naming the field."""
    if not isinstance(v, list) or not v:
        raise BadRequest(f"'{param}' must be a non-empty array", param=param)
    for i, item in enumerate(v):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"'{where}' must be an object", param=where)
        yield where, item


def tool_list(body: dict[str, Any], one: Callable[[dict[str, Any], str], Tool | list[Tool]]) -> list[Tool]:
    """``body["tools"]`` (absent: none) read by ``one(tool object, where)``, each checked
    to be an object. ``one`` returns a tool, or a list of them (a Responses ``namespace``
    flattened to its functions; empty for a tool set aside). Names must be unique across
    the result. Raises BadRequest naming the field."""
    raw = body.get("tools")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out: list[Tool] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"'{where}' must be an object", param=where)
        got = one(t, where)
        for tool in [got] if isinstance(got, Tool) else got:
            if any(o.name == tool.name for o in out):  # a call names its tool: two of one name are ambiguous
                raise BadRequest(f"'{where}': tool names must be unique, '{tool.name}' is given twice", param=where)
            out.append(tool)
    return out


def _tool_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or '"' in name or "\n" in name:
        raise BadRequest(f"'{where}.name' must be a non-empty string without quotes or newlines",
                         param=f"{where}.name")
    return name


def function_tool(name: Any, description: Any, parameters: Any, where: str, params_field: str) -> Tool:
    """A function tool from its fields (``params_field``: where its JSON Schema sits, e.g.
    ``parameters`` or ``input_schema``; None means no arguments). Raises BadRequest
    naming the field."""
    name = _tool_name(name, where)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise BadRequest(f"'{where}.{params_field}' must be a JSON Schema object", param=f"{where}.{params_field}")
    return Tool(name, description if isinstance(description, str) else "", parameters)


def custom_tool(name: Any, description: Any, fmt: Any, where: str) -> Tool:
    """A custom (free-text input) tool. ``fmt`` (at ``where.format``): None or ``{"type":
    "text"}`` (any text), or ``{"type": "grammar", "syntax": "lark" | "regex",
    "definition"}`` (Responses; Codex's apply_patch) — chat completions nest the last
    two in ``"grammar": {...}``. Raises BadRequest naming the field."""
    name = _tool_name(name, where)
    fw = f"{where}.format"
    grammar: tuple[str, str] | None = None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
            raise BadRequest(f"'{fw}.type' must be 'text' or 'grammar'", param=f"{fw}.type")
        if fmt["type"] == "grammar":
            g = fmt["grammar"] if isinstance(fmt.get("grammar"), dict) else fmt
            syntax, definition = g.get("syntax"), g.get("definition")
            if syntax not in ("lark", "regex") or not isinstance(definition, str) or not definition.strip():
                raise BadRequest(f"'{fw}' needs 'syntax' ('lark' or 'regex') and a 'definition'", param=fw)
            grammar = (syntax, definition)
    return Tool(name, description if isinstance(description, str) else "", custom=True, grammar=grammar)


def choose(tools: list[Tool], mode: str, name: Any, parallel: bool, param: str) -> ToolChoice:
    """A tool choice (``mode`` none / auto / required / named) checked against ``tools``:
    ``required`` and ``named`` need tools, a named one must be offered. ``param``: the
    request field the choice came from. Without tools, ``auto`` is ``none``."""
    if mode in ("required", "named") and not tools:
        raise BadRequest(f"'{param}' {'required' if mode == 'required' else 'naming a tool'} needs 'tools'",
                         param=param)
    if mode == "named":
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise BadRequest(f"'{param}' must name one of the tools, got {name!r}", param=f"{param}.name")
        return ToolChoice("named", name, parallel)
    return ToolChoice("none" if mode == "none" or not tools else mode, None, parallel)


def content_text(content: Any, where: str, kinds: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    """A message's content: a string, or parts whose ``type`` is one of ``kinds`` (their
    ``text`` joined with newlines; a ``refusal`` part's text too; extra keys such as
    ``cache_control`` ignored). Raises BadRequest naming the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or an array of content parts", param=where)
    texts: list[str] = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise BadRequest(f"'{pw}' must be an object", param=pw)
        kind = part.get("type")
        key = "refusal" if kind == "refusal" else "text"
        if kind in kinds or kind == "refusal":
            if not isinstance(part.get(key), str):
                raise BadRequest(f"'{pw}.{key}' must be a string", param=f"{pw}.{key}")
            texts.append(part[key])
        else:
            raise BadRequest(f"'{pw}': content parts of type {kind!r} are not supported (text only)", param=pw)
    return "\n".join(texts)


@dataclass
class Prepared:
    """A chat request ready for the worker: ``messages`` (template-ready), ``tools`` (the
    template's ``tools``, for templates with their own tool syntax; else None),
    at most one of ``grammar`` / ``json_schema``, the request field an invalid
    constraint is blamed on (``constraint_param``), and how to read the answer back."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    offered: list[Tool]
    choice: ToolChoice
    syntax: ToolSyntax
    grammar: str | None
    json_schema: str | None
    constraint_param: str | None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more template variables (enable_thinking)

    def parser(self, id_prefix: str = "call") -> CallParser:
        """A fresh parser of one answer (one per choice)."""
        return CallParser(self.choice.mode != "none", id_prefix,
                          frozenset(t.name for t in self.offered if t.custom), self.syntax)

    def generate_fields(self) -> dict[str, Any]:
        """The protocol ``Generate`` fields this sets."""
        return {"messages": self.messages, "tools": self.tools, "grammar": self.grammar,
                "json_schema": self.json_schema, "template_kwargs": self.template_kwargs}


def prepare(slot: ServedModel, turns: list[ChatTurn], tools: list[Tool], choice: ToolChoice,
            text_schema: str | None, format_param: str | None, tools_param: str = "tools",
            messages_param: str = "messages", allow_empty: bool = False,
            chat_template_kwargs: dict[str, Any] | None = None) -> Prepared:
    """Turns + tools + a response format (``text_schema``, the JSON Schema text from
    ``format_param``) as a :class:`Prepared`, in ``slot``'s template tool syntax.
    ``choice`` none: the tools are neither described nor parsed. Turns that all fell
    away in the dialect's reading (only ``reasoning`` items, a user message with no
    content blocks) are a 400 naming ``messages_param``, never an empty prompt sent on —
    unless the client sent no turn at all and the dialect renders that (``allow_empty``:
    llama-server answers an empty Anthropic conversation from its template alone)."""
    if not turns and not allow_empty:
        raise BadRequest(f"'{messages_param}' holds no message to answer (items that carry nothing for "
                         "these models, such as reasoning items or empty content, are dropped)",
                         param=messages_param)
    offered = tools if choice.mode != "none" else []
    syntax = syntax_for(template_syntax(slot), offered, turns)
    grammar = tool_constraint(offered, choice, text_schema, syntax)
    json_schema = text_schema if grammar is None else None
    param = tools_param if grammar is not None else (format_param if json_schema is not None else None)
    try:
        messages = render_messages(turns, offered, syntax)
    except TrailingAssistants as e:
        raise BadRequest(str(e), param=messages_param) from None
    return Prepared(messages, template_tools(offered, syntax), offered, choice, syntax, grammar, json_schema, param,
                    template_kwargs(slot, chat_template_kwargs))


#: Template variables a request cannot set: the renderer passes them itself.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def read_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """llama.cpp's ``chat_template_kwargs`` (an object of template variables, e.g.
    ``{"enable_thinking": false}``), or None when absent. Raises BadRequest naming it: not an
    object, a variable the renderer sets itself, or a non-boolean ``enable_thinking``."""
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_VARS & raw.keys())
    if reserved:
        raise BadRequest(f"'chat_template_kwargs' cannot set {', '.join(reserved)} (the request's own fields "
                         "set them)", param="chat_template_kwargs")
    if "enable_thinking" in raw and not isinstance(raw["enable_thinking"], bool):
        raise BadRequest("'chat_template_kwargs.enable_thinking' must be a boolean",
                         param="chat_template_kwargs.enable_thinking")
    return dict(raw)


def template_kwargs(slot: ServedModel, requested: dict[str, Any] | None) -> dict[str, Any]:
    """The template variables of a chat request on ``slot``: ``enable_thinking`` from the model's
    ``reasoning`` (true unless "off", as llama.cpp's default), then the request's
    ``chat_template_kwargs`` over it (a preset's ``chat_template_kwargs`` in between, router.serving.presets)."""
    return {"enable_thinking": slot.model.reasoning != "off", **slot.model.template_kwargs, **(requested or {})}
