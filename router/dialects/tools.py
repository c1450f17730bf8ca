"""The generic tool format: tools, tool calls and tool results written into a chat
whose template has no tool syntax, and tool calls read back from the model's text.

Every dialect (OpenAI chat, OpenAI Responses, Anthropic Messages) turns its own
request into :class:`ChatTurn` records and its tools into :class:`Tool`; this
module is the one place that knows how they look in the prompt and in the
output. Both shipped models (SmolLM2's ChatML, Gemma 3) have no tool syntax, so
the format is always this one (as llama.cpp's "generic" chat format):

* **tools** go into the system message (appended to the first one, or a new
  leading one): a short instruction, the tools as JSON
  (``{"name", "description", "parameters"}``), and the call syntax;
* **a call** the model makes, and an assistant turn of the history that carried
  calls, is one block per call (blocks follow each other directly; text of the
  same turn comes first, on its own line)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* **a custom tool's call** (free-text input, the Responses API's ``custom`` tools)
  names the tool in the tag and carries the input as it is::

      <tool_call name="apply_patch">
      *** Begin Patch ...
      </tool_call>

* **a tool result** becomes a user turn (consecutive results share one, closed by
  one instruction line)::

      The tool get_weather returned:
      18 C, sunny
      Answer the question with it.

  Plain words, no tags: a small model given tagged results tends to echo the
  tags back instead of answering.

Consecutive turns of one role are merged (blank line between), so templates that
demand user/assistant alternation (Gemma) accept any history.

**Templates with their own tool syntax** (:class:`ToolSyntax`, found in the template
text as llama.cpp's ``common/chat.cpp`` does) get the tools as HF templates expect
them (``tools`` in the Jinja context, ``[{"type": "function", "function": {...}}]``),
assistant ``tool_calls`` (``function.arguments`` an object) and ``tool`` messages
(``tool_call_id``, ``name``) as they are, and the model's calls are written and read
in that syntax: Hermes 2 Pro / Qwen 2.5 (``<tool_call>\n{"name", "arguments"}\n</tool_call>``,
one block per call, newline between), Llama 3.1+ (the reply is one JSON object
``{"name", "parameters"}``), Mistral (``[TOOL_CALLS]`` then a JSON array of
``{"name", "arguments"}``; call ids given to the template as 9 alphanumerics, as its
template demands). Custom (free-text) tools always use the generic format. The constraint
(``router.dialects.constraints``) makes the model's calls well-formed;
``router.dialects.call_parser.CallParser`` reads them back, streaming or not, with the same result either way.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
#: What every call block starts with (a custom tool's block names the tool in the tag).
CALL_PREFIX = "<tool_call"
RESULT_HEAD = "The tool {name} returned:"
RESULTS_CLOSE = "Answer the question with it."


@dataclass(frozen=True)
class ToolSyntax:
    """How a chat template writes tool calls.

    ``name``: generic | hermes | llama3 | mistral. ``native``: the template renders
    tools, calls and results itself (they are passed to it structured; the generic
    format writes them as text instead). ``prefix``: what a reply that calls tools
    starts with (after whitespace). ``block``: (open, close) around each call's JSON
    (None: the calls are bare JSON after ``prefix``). ``sep``: between two calls.
    ``args_key``: the key of the arguments in a call's JSON. ``array``: the calls are
    one JSON array. ``parallel``: the syntax can carry more than one call."""

    name: str
    native: bool
    prefix: str
    block: tuple[str, str] | None
    sep: str = ""
    args_key: str = "arguments"
    array: bool = False
    parallel: bool = True


GENERIC = ToolSyntax("generic", False, CALL_PREFIX, (CALL_OPEN + "\n", "\n" + CALL_CLOSE))
HERMES = ToolSyntax("hermes", True, CALL_PREFIX, (CALL_OPEN + "\n", "\n" + CALL_CLOSE), sep="\n")
LLAMA3 = ToolSyntax("llama3", True, '{"', None, args_key="parameters", parallel=False)
MISTRAL = ToolSyntax("mistral", True, "[TOOL_CALLS]", None, array=True)


def detect_syntax(template: str) -> ToolSyntax:
    """The tool syntax of a chat template text (as llama.cpp's ``common/chat.cpp`` tells
    them apart); GENERIC when the template does not render ``tools`` itself."""
    if "tools" not in template:
        return GENERIC
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>" in template and ("ipython" in template or "<|python_tag|>" in template):
        return LLAMA3
    return GENERIC


def new_call_id(prefix: str = "call") -> str:
    """A unique tool-call id (``call_<24 hex>``; Anthropic uses ``toolu_``)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Tool:
    """One tool. A function tool (``custom`` False) takes JSON arguments, ``parameters``
    its JSON Schema. A custom tool (the Responses API's ``custom`` tools, Codex's
    ``apply_patch``) takes free text, ``grammar`` = (``"lark"`` | ``"regex"``,
    definition) when its format constrains it, else None (any text)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    custom: bool = False
    grammar: tuple[str, str] | None = None
    namespace: str | None = None  # a Responses namespace's function: ``name`` is its flat name
    local_name: str | None = None  # ... and this its name inside the namespace

    def client_name(self) -> tuple[str | None, str]:
        """(namespace, name) as the client named it: (None, ``name``) for a plain tool."""
        return (self.namespace, self.local_name or self.name) if self.namespace else (None, self.name)

    def as_json(self) -> dict[str, Any]:
        if not self.custom:
            return {"name": self.name, "description": self.description, "parameters": self.parameters}
        shape = "free text" if self.grammar is None else f"text matching this {self.grammar[0]} grammar: " \
            + self.grammar[1]
        return {"name": self.name, "description": self.description, "input": shape}


#: Joins a namespace and a function's name into the one flat name the model sees.
NAMESPACE_SEP = "__"


def namespaced_name(namespace: str, name: str) -> str:
    """The flat name of function ``name`` of Responses namespace ``namespace`` (e.g. Codex's
    ``multi_agent_v1`` + ``spawn_agent`` -> ``multi_agent_v1__spawn_agent``): the form Codex
    itself uses where a boundary cannot keep the split (``ToolName::canonical_flat_name``,
    underscores around the separator trimmed). The model sees and calls this name; the
    dialect hands the call back split (``name`` + ``namespace``)."""
    return f"{namespace.rstrip('_')}{NAMESPACE_SEP}{name.lstrip('_')}"


@dataclass(frozen=True)
class ToolCall:
    """A call: ``arguments`` is the JSON text of the arguments object (OpenAI's wire form),
    or for a custom tool (``custom`` True) its raw input text."""

    id: str
    name: str
    arguments: str
    custom: bool = False


@dataclass
class ChatTurn:
    """One turn of a conversation, dialect-neutral.

    ``role``: system | user | assistant | tool. ``content``: its text.
    ``tool_calls``: the calls an assistant turn made. ``tool_call_id`` / ``name``:
    which call a tool turn answers (``name`` found from the id when not given).
    ``reasoning``: an assistant turn's reasoning (OpenAI's ``reasoning_content``, Anthropic's
    ``thinking`` blocks), given to the template as the message's ``reasoning_content`` as
    llama.cpp does (a reasoning template renders it or leaves it out; others ignore it)."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


def render_call(name: str, arguments: str, custom: bool = False) -> str:
    """One call block (``arguments``: JSON text, re-encoded in the format's style when it
    parses; a custom tool's input text as it is)."""
    if custom:
        return f'<tool_call name="{name}">\n{arguments}\n{CALL_CLOSE}'
    args = _args_object(arguments)
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def tools_system_text(tools: list[Tool]) -> str:
    """The system-prompt text that describes ``tools`` and the call syntax."""
    listing = json.dumps([t.as_json() for t in tools], ensure_ascii=False)
    text = ("You can call these tools (JSON Schema of their arguments):\n" + listing + "\n"
            "To call a tool, reply with one block per call and nothing else:\n"
            f"{CALL_OPEN}\n" + '{"name": "<tool name>", "arguments": {<the arguments>}}' + f"\n{CALL_CLOSE}\n")
    if any(t.custom for t in tools):
        text += ("A tool that takes an input text instead of arguments is called with:\n"
                 '<tool_call name="<tool name>">\n<the input>\n' + f"{CALL_CLOSE}\n")
    return text + "A result comes back as: " + RESULT_HEAD.format(name="<tool name>")


class TrailingAssistants(ValueError):
    """Two assistant messages end the conversation: an assistant prefill continues one
    message after a non-assistant turn (llama.cpp refuses the same); a 400 of the dialect."""


def render_messages(turns: list[ChatTurn], tools: list[Tool] | None = None,
                    syntax: ToolSyntax = GENERIC) -> list[dict[str, Any]]:
    """``turns`` as template-ready messages.

    GENERIC: ``[{"role", "content"}]`` (system / user / assistant only); tool calls and
    tool results are written in the generic format, never dropped; ``tools`` (when
    given) are described in the system message; consecutive turns of one role are
    merged. A native syntax: the turns as they are (assistant ``tool_calls`` with
    ``function.arguments`` an object, ``tool`` messages with ``tool_call_id`` and
    ``name``); the template renders them and ``tools`` (see :func:`template_tools`).

    Raises TrailingAssistants when the last two turns are plain assistant messages."""
    if len(turns) > 1 and turns[-1].role == turns[-2].role == "assistant" and not turns[-1].tool_calls:
        raise TrailingAssistants("Cannot have 2 or more assistant messages at the end of the list.")
    if syntax.native:
        return _native_messages(turns, syntax)
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    # each message's texts, joined once at the end: merging pairwise copied the message so far at
    # every turn (quadratic on the event loop: 4,000 user turns of 2 KB took 8 s)
    texts: list[list[str]] = []
    reasonings: list[list[str]] = []

    def push(role: str, text: str, reasoning: str | None = None) -> None:
        if out and out[-1]["role"] == role and role != "system":
            texts[-1].append(text)
        else:
            out.append({"role": role, "content": ""})
            texts.append([text])
            reasonings.append([])
        if reasoning is not None:
            reasonings[-1].append(reasoning)

    for k, t in enumerate(turns):
        if t.role == "assistant":
            for c in t.tool_calls:
                names[c.id] = c.name
            calls = "".join(render_call(c.name, c.arguments, c.custom) for c in t.tool_calls)
            push("assistant", "\n".join(p for p in (t.content, calls) if p), t.reasoning)
        elif t.role == "tool":
            name = t.name or names.get(t.tool_call_id or "", "") or "tool"
            text = f"{RESULT_HEAD.format(name=name)}\n{t.content}"
            if k + 1 == len(turns) or turns[k + 1].role != "tool":
                text += f"\n{RESULTS_CLOSE}"
            push("user", text)
        else:
            push(t.role, t.content)
    for m, parts, reasons in zip(out, texts, reasonings):
        m["content"] = "\n\n".join(p for p in parts if p)
        if reasons:
            m["reasoning_content"] = _fold_reasoning(reasons)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _fold_reasoning(reasons: list[str]) -> str:
    """Reasoning texts of one merged message: each after a blank line when there is text before
    it, else replacing it (the rule of the pairwise merge, applied in one pass)."""
    acc: list[str] = []
    nonempty = False
    for r in reasons:
        if nonempty:
            acc += ["\n\n", r]
        else:
            acc = [r]
            nonempty = bool(r)
    return "".join(acc)


def _args_object(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # history as the client sent it: kept, never dropped


def _template_call_id(ident: str, syntax: ToolSyntax) -> str:
    """A call id as the template needs it (Mistral's: 9 alphanumerics, derived from the id)."""
    if syntax is MISTRAL and not (len(ident) == 9 and ident.isalnum()):
        return hashlib.sha1(ident.encode()).hexdigest()[:9]
    return ident


def _native_messages(turns: list[ChatTurn], syntax: ToolSyntax) -> list[dict[str, Any]]:
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for t in turns:
        if t.role == "assistant" and t.tool_calls:
            for c in t.tool_calls:
                names[c.id] = c.name
            out.append({"role": "assistant", "content": t.content or None, "tool_calls": [
                {"id": _template_call_id(c.id, syntax), "type": "function",
                 "function": {"name": c.name, "arguments": _args_object(c.arguments)}} for c in t.tool_calls]})
            if t.reasoning is not None:
                out[-1]["reasoning_content"] = t.reasoning
        elif t.role == "tool":
            ident = t.tool_call_id or ""
            out.append({"role": "tool", "content": t.content, "tool_call_id": _template_call_id(ident, syntax),
                        "name": t.name or names.get(ident, "") or "tool"})
        else:
            out.append({"role": t.role, "content": t.content})
            if t.role == "assistant" and t.reasoning is not None:
                out[-1]["reasoning_content"] = t.reasoning
    return out


def template_tools(tools: list[Tool], syntax: ToolSyntax) -> list[dict[str, Any]] | None:
    """The ``tools`` a native template gets (OpenAI's shape, as HF templates read it);
    None for GENERIC (the tools are in the system text) or when none are offered."""
    if not syntax.native or not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def syntax_for(template_syntax: ToolSyntax, tools: list[Tool], turns: list[ChatTurn]) -> ToolSyntax:
    """The syntax a request uses: the template's, or GENERIC when a custom (free-text)
    tool is offered or called in the history (native syntaxes carry JSON arguments only)."""
    if template_syntax.native and (any(t.custom for t in tools)
                                   or any(c.custom for t in turns for c in t.tool_calls)):
        return GENERIC
    return template_syntax


@dataclass(frozen=True)
class ToolChoice:
    """Dialect-neutral tool choice. ``mode``: ``none`` (tools not offered: the prompt
    does not describe them and no call is parsed), ``auto`` (text or calls),
    ``required`` (at least one call), ``named`` (exactly a call of ``name``).
    ``parallel``: more than one call allowed."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True
