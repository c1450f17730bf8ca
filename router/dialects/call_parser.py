"""Tool calls read back from the model's text (router.dialects.tools describes how they are
written, in the generic format or the template's own syntax): :class:`CallParser`, streaming or
not, with the same result either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from router.dialects.tools import CALL_PREFIX, GENERIC, ToolCall, ToolSyntax, new_call_id

#: One block of the generic / Hermes syntax: ``<tool_call>`` (or ``<tool_call name="...">`` for a
#: custom tool's free-text input), its body, ``</tool_call>``.
_BLOCK = re.compile(r'<tool_call(?: name="([^"\n]*)")?>\n(.*?)\n</tool_call>', re.S)


@dataclass
class ParsedOutput:
    """What the model wrote: plain ``content`` or ``calls`` (never both: a reply is
    text or calls), and whether a started call was cut off (``truncated``)."""

    content: str | None
    calls: list[ToolCall]
    truncated: bool = False


class CallParser:
    """Splits the model's text into content deltas and complete tool calls, incrementally.

    ``feed(delta)`` returns ``(content_delta, new_calls)``; ``finish()`` returns the
    last of them. Text that may still be the start of a call (``syntax.prefix``, after
    leading whitespace) is held back; once the text cannot be a call it is content
    from then on, and once it is a call no byte of it reaches ``content``. Fed all
    at once or token by token, the same calls (same ids order, same arguments) come
    out. ``id_prefix``: ``call`` (OpenAI) or ``toolu`` (Anthropic). ``syntax``: the
    template's tool syntax (:class:`ToolSyntax`).
    """

    def __init__(self, enabled: bool, id_prefix: str = "call", custom: frozenset[str] = frozenset(),
                 syntax: ToolSyntax = GENERIC) -> None:
        self.mode = "undecided" if enabled else "text"
        self.custom = custom  # names of custom tools (their blocks carry raw input text)
        self.syntax = syntax
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.id_prefix = id_prefix
        self.content_parts: list[str] = []
        self.cut_open = False  # the text ended inside a call's opening markup

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.mode == "text":
            self.content_parts.append(delta)
            return delta, []
        self.buf += delta
        if self.mode == "undecided":
            head = self.buf.lstrip()
            prefix = self.syntax.prefix
            if not head:
                return "", []
            if head.startswith(prefix):
                self.mode = "calls"
                self.buf = head
            elif prefix.startswith(head):
                return "", []
            else:
                return self._as_text(), []
        calls = self._take_calls()
        if self.mode == "text":  # what looked like a call is JSON content (see _take_calls)
            return "".join(self.content_parts), []
        return "", calls

    def _as_text(self) -> str:
        self.mode = "text"
        text, self.buf = self.buf, ""
        self.content_parts.append(text)
        return text

    def _take_calls(self) -> list[ToolCall]:
        new: list[ToolCall] = []
        if self.syntax.block is not None:
            while True:
                m = _BLOCK.search(self.buf)
                if m is None:
                    break
                self.buf = self.buf[m.end():]
                name, body = m.group(1), m.group(2)
                if name is not None:
                    if name in self.custom:
                        new.append(ToolCall(new_call_id(self.id_prefix), name, body, custom=True))
                    continue
                call = self._call(_json_or_none(body))
                if call is not None:
                    new.append(call)
        elif not self.calls:  # bare JSON after the prefix: one object (Llama 3) or one array (Mistral)
            body = self.buf[len(self.syntax.prefix):] if self.syntax.array else self.buf
            try:
                obj, _ = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                return []
            items = obj if self.syntax.array and isinstance(obj, list) else [obj]
            new = [c for c in (self._call(o) for o in items) if c is not None]
            self.buf = ""
            if not new:  # JSON that is no call (a JSON reply of an auto choice): it is content
                self.buf = body
                self._as_text()
                return []
        self.calls.extend(new)
        return new

    def _call(self, obj: Any) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.syntax.args_key, {})
        return ToolCall(new_call_id(self.id_prefix), obj["name"], json.dumps(args, ensure_ascii=False))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: held-back text that never became a call is content —
        except the start of a call's markup (``<tool_`` of ``<tool_call>``, ``[TOOL_`` of
        ``[TOOL_CALLS]``) cut off by the end of the generation: that is a truncated call,
        and no byte of it reaches content. (Llama 3's prefix is JSON, ``{"``: a reply cut
        there stays content.)"""
        if self.mode == "undecided":
            head = self.buf.lstrip()
            prefix = self.syntax.prefix
            if head and prefix.startswith(head) and not prefix.startswith("{"):
                self.mode, self.buf, self.cut_open = "calls", head, True
                return "", []
            return self._as_text(), []
        return "", []

    @property
    def truncated(self) -> bool:
        """A call was started but not closed (generation stopped inside it)."""
        if self.mode != "calls":
            return False
        if self.cut_open:
            return True
        return CALL_PREFIX in self.buf if self.syntax.block is not None else bool(self.buf.strip())

    def read(self, pieces: Iterable[str]) -> ParsedOutput:
        """The whole answer (the non-streaming path): ``pieces`` fed in order, then finished."""
        for piece in pieces:
            self.feed(piece)
        self.finish()
        return self.result()

    def result(self) -> ParsedOutput:
        if self.mode == "calls":
            return ParsedOutput(None, list(self.calls), self.truncated)
        return ParsedOutput("".join(self.content_parts), [])


def _json_or_none(body: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return None


def parse_output(text: str, enabled: bool, id_prefix: str = "call",
                 custom: frozenset[str] = frozenset(), syntax: ToolSyntax = GENERIC) -> ParsedOutput:
    """The whole text at once (the non-streaming path): same result as streaming it."""
    return CallParser(enabled, id_prefix, custom, syntax).read([text])
