"""Chat templates rendered the way Hugging Face ``transformers`` renders them.

``transformers`` (``utils/chat_template_utils.py``) compiles
``tokenizer.chat_template`` in a Jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks=True, lstrip_blocks=True`` and the ``loopcontrols`` extension, a
``tojson`` filter that does not HTML-escape, and the globals
``raise_exception`` and ``strftime_now``; it renders with ``messages``,
``tools``, ``add_generation_prompt``, ``bos_token`` and ``eos_token`` — and, as llama.cpp
does, ``date_string``, ``datetime`` and the request's ``chat_template_kwargs`` (such as
``enable_thinking``; :func:`template_context`). With
these settings SmolLM2's template renders byte-for-byte what llama.cpp's
``/apply-template`` renders.

Like llama.cpp (``common/chat.cpp``), a rendered prompt that starts with the
BOS text has it removed when the tokenizer adds BOS itself (and a trailing EOS
text when it adds EOS), so a template writing ``{{ bos_token }}`` still gives
exactly one BOS.

:meth:`ChatTemplate.render_segments` tells template markup from message
content, so that ``Engine.tokenize_chat`` can parse special-token texts in the
markup only: a user who types ``<|im_end|>`` cannot close a turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import EngineError

__all__ = ["KNOWN_TEMPLATES", "ChatTemplate", "RoleCaps", "fit_roles", "normalize_messages", "resolve_template",
           "template_context"]

# ChatML as llama.cpp's built-in "chatml" template writes it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is string else '')"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma 3 instruction-tuned format: BOS, an optional system message folded into
# the first user turn, roles user/model alternating, turns closed by
# <end_of_turn>, message text trimmed (as Google's published template does).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# llama.cpp's built-in "llama3" format (src/llama-chat.cpp, LLM_CHAT_TEMPLATE_LLAMA_3): every message
# as a header with its role and its trimmed text closed by <|eot_id|>; BOS comes from the tokenizer.
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + ((message['content'] if message['content'] is string else '') | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# llama.cpp's built-in "command-r" format (LLM_CHAT_TEMPLATE_COMMAND_R, CohereForAI/c4ai-command-r-plus):
# system / user / assistant turns with their role tokens and trimmed text; other roles are not written.
COMMAND_R_TEMPLATE = (
    "{%- set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} %}"
    "{%- for message in messages %}{%- if message['role'] in tokens %}"
    "{{- '<|START_OF_TURN_TOKEN|>' + tokens[message['role']]"
    " + ((message['content'] if message['content'] is string else '') | trim) + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}"
)

KNOWN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
    "gemma3": GEMMA_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "command-r": COMMAND_R_TEMPLATE,
}

_ROLES = ("system", "developer", "user", "assistant", "tool")


def resolve_template(name_or_text: str) -> str:
    """A known template name (``"chatml"``, ``"gemma"``, ``"gemma3"``, ``"llama3"``, ``"command-r"``: llama.cpp's
    built-in formats of those names) -> its text; any other string is a template text."""
    return KNOWN_TEMPLATES.get(name_or_text.strip().lower(), name_or_text)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: json.dumps without Jinja's HTML escaping
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def template_context(template_kwargs: Mapping[str, Any] | None = None,
                     now: datetime | None = None) -> dict[str, Any]:
    """The variables a template gets besides ``messages``, ``tools``, ``add_generation_prompt``,
    ``bos_token`` and ``eos_token`` (which nothing here overrides), as llama.cpp's
    ``common/chat.cpp`` passes them: ``date_string`` (``"%d %b %Y"``, e.g. ``"07 Dec 2026"``, the
    Llama 3.x templates' date line) and ``datetime`` (``"%b %d %Y %H:%M:%S GMT"``, firefunction
    v2's; written in UTC, which the "GMT" says) of ``now`` (local time; default: the clock), then
    ``template_kwargs`` (llama.cpp's ``chat_template_kwargs``: ``enable_thinking``, ...) over them."""
    now = now if now is not None else datetime.now().astimezone()
    utc = now.astimezone(timezone.utc) if now.tzinfo is not None else now
    return {"date_string": now.strftime("%d %b %Y"), "datetime": utc.strftime("%b %d %Y %H:%M:%S GMT"),
            **(template_kwargs or {})}


def normalize_messages(messages: Any, developer_known: bool) -> list[dict[str, Any]]:
    """Validate OpenAI-style chat messages and bring them to the form templates expect.

    Each message is a mapping with ``role`` (system, developer, user,
    assistant, tool) and ``content``: a string, None, or a list of content
    parts ``{"type": "text", "text": ...}`` which are joined with ``"\\n"``
    (as llama.cpp's server does for templates without typed content). Role
    ``developer`` becomes ``system`` when the template does not mention
    ``developer``. Other keys (``name``, ``tool_calls``, ``tool_call_id``)
    are passed through.

    Raises:
        EngineError("invalid_params"): not a list of such messages (an empty one renders the
            template with no turns, as llama-server does for an empty Anthropic conversation),
            or a content part that is not text.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise EngineError("invalid_params", "messages must be a list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise EngineError("invalid_params", f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise EngineError("invalid_params", f"messages[{i}].role must be one of {', '.join(_ROLES)}")
        content = m.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise EngineError("invalid_params", f"messages[{i}].content[{j}]: only text content parts "
                                      f"are supported, got {kind!r}")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise EngineError("invalid_params", f"messages[{i}].content must be a string, a list of text "
                              "parts or null")
        msg = dict(m)
        msg["content"] = content
        if role == "developer" and not developer_known:
            msg["role"] = "system"
        out.append(msg)
    return out


@dataclass(frozen=True)
class RoleCaps:
    """What a template can express about roles, found by rendering probe conversations once
    (as llama.cpp's ``common/chat`` probes a template's capabilities).

    ``system_role``: a leading system message's text reaches the prompt.
    ``system_anywhere``: a system message after other turns renders, its text in the prompt.
    ``alternation``: two consecutive user turns are refused (roles must alternate).
    ``system_alone``: a conversation of system turns only renders their text (Gemma's folds the
    system text into the first user turn: with none, the text was lost)."""

    system_role: bool = True
    system_anywhere: bool = True
    alternation: bool = False
    system_alone: bool = True


def _text_of(m: dict[str, Any]) -> str | None:
    """A message's content when it is plain text (None: tool calls, null content)."""
    c = m.get("content")
    return c if isinstance(c, str) and not m.get("tool_calls") else None


def fit_roles(msgs: list[dict[str, Any]], caps: RoleCaps) -> list[dict[str, Any]]:
    """``msgs`` (normalized) in the roles the template can express, losing no text.

    Where the template cannot render a system turn after other turns, the leading system
    turns become one and a later one becomes a user turn in its place; where it renders
    no system turn at all, the system text opens the first user turn; where roles must
    alternate, consecutive plain-text turns of one role are merged (``"\n\n"`` between
    them); where a conversation of system turns only would render none of their text, they
    become one user turn. A conversation the template already expresses is returned unchanged."""
    out = [dict(m) for m in msgs]
    if not caps.system_alone and out and all(m["role"] == "system" for m in out):
        texts = [t for t in (_text_of(m) for m in out) if t]
        if texts:
            return [{"role": "user", "content": "\n\n".join(texts)}]
    if not caps.system_anywhere or not caps.system_role:
        n_lead = 0
        while n_lead < len(out) and out[n_lead]["role"] == "system":
            n_lead += 1
        lead = [t for t in (_text_of(m) for m in out[:n_lead]) if t]
        rest = [{**m, "role": "user"} if m["role"] == "system" else m for m in out[n_lead:]]
        if not caps.system_role:
            if lead:
                rest.insert(0, {"role": "user", "content": "\n\n".join(lead)})
            out = rest
        else:
            out = ([{"role": "system", "content": "\n\n".join(lead)}] if n_lead else []) + rest
    if caps.alternation:
        # each run's texts are joined once at the end: merging pairwise copied the run's text so far
        # at every turn (quadratic: 2,000 user turns of 2 KB took 2.8 s of the worker's CPU)
        merged: list[dict[str, Any]] = []
        runs: list[list[str]] = []  # the texts of each merged turn
        for m in out:
            prev = merged[-1] if merged else None
            text = _text_of(m)
            if (prev is not None and prev["role"] == m["role"] and m["role"] in ("user", "assistant", "system")
                    and _text_of(prev) is not None and text is not None):
                runs[-1].append(text)
            else:
                merged.append(m)
                runs.append([text or ""])
        out = [m if len(texts) == 1 else {**m, "content": "\n\n".join(t for t in texts if t)}
               for m, texts in zip(merged, runs)]
    return out


def _prefill(msgs: list[dict[str, Any]]) -> str | None:
    """The content of a last assistant message to continue (None: no prefill)."""
    if not msgs:
        return None
    last = msgs[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return None
    if len(msgs) > 1 and msgs[-2]["role"] == "assistant":
        raise EngineError("invalid_params", "Cannot have 2 or more assistant messages at the end of the list.")
    return last["content"] if isinstance(last["content"], str) else ""


_MARK_RE = re.compile("\U000F0000(\\d+)\U000F0001")


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: Jinja2 template text (see :func:`resolve_template` for names).
        bos_token / eos_token: token texts passed to the template.
        strip_bos / strip_eos: remove a leading BOS / trailing EOS text from the
            rendering (set when the tokenizer adds them itself).

    Raises:
        EngineError("template_error"): the template does not compile.
    """

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 strip_bos: bool = False, strip_eos: bool = False) -> None:
        if not isinstance(source, str) or not source.strip():
            raise EngineError("template_error", "chat template is empty")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.strip_bos = strip_bos and bool(self.bos_token)
        self.strip_eos = strip_eos and bool(self.eos_token)
        self.developer_known = "developer" in source
        self._caps: RoleCaps | None = None
        self._requires_content: bool | None = None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise EngineError("template_error", f"chat template does not compile: {e}") from e

    def _render_raw(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[Any] | None, context: Mapping[str, Any] | None = None) -> str:
        try:
            return self._template.render({**(context if context is not None else template_context()),
                                          "messages": messages, "tools": tools,
                                          "add_generation_prompt": add_generation_prompt,
                                          "bos_token": self.bos_token, "eos_token": self.eos_token})
        except jinja2.TemplateError as e:
            raise EngineError("template_error", f"chat template error: {e}") from e
        except Exception as e:  # a template can fail in many ways (TypeError, ...)
            raise EngineError("template_error", f"chat template error: {type(e).__name__}: {e}") from e

    def render(self, messages: Any, add_generation_prompt: bool = True, tools: list[Any] | None = None,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (BOS/EOS text stripped as configured).

        Assistant prefill, as llama.cpp's server does it: with ``add_generation_prompt``, a
        last ``assistant`` message (without ``tool_calls``) is not closed but continued —
        the messages before it are rendered with the generation prompt and its content is
        appended as it is, so the model's answer goes on from that text.

        Raises:
            EngineError("invalid_params"): malformed messages, or two assistant messages at
                the end (a prefill follows a non-assistant turn).
            EngineError("template_error"): the template raised while rendering.

        ``template_kwargs``: more variables for the template (llama.cpp's ``chat_template_kwargs``,
        e.g. ``enable_thinking``), over :func:`template_context`'s date variables.
        """
        context = template_context(template_kwargs)
        msgs, prefill = self._split_prefill(messages, add_generation_prompt)
        real = self._render_raw(msgs, add_generation_prompt, tools, context)
        if (self.strip_bos and real.startswith(self.bos_token)) or (self.strip_eos and real.endswith(self.eos_token)):
            real = "".join(t for t, _ in self._segments(msgs, real, add_generation_prompt, tools, context))
        return real + (prefill or "")

    def render_segments(self, messages: Any, add_generation_prompt: bool = True,
                        tools: list[Any] | None = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> list[tuple[str, bool]]:
        """The prompt as ``(text, is_markup)`` pieces whose concatenation is :meth:`render`'s text.

        Message contents are located by rendering once more with each content
        string replaced by a unique marker; the marker rendering is aligned
        with the real one (accepting a content that the template trimmed).
        When a template transforms content beyond that, contents are searched
        for in the real rendering in order; a content not found verbatim stays
        markup (and so can't be protected) -- the rendering itself is always
        the real one. A prefill (see :meth:`render`) is the last piece, content.
        """
        context = template_context(template_kwargs)  # one clock reading for both renderings
        msgs, prefill = self._split_prefill(messages, add_generation_prompt)
        segs = self._segments(msgs, self._render_raw(msgs, add_generation_prompt, tools, context),
                              add_generation_prompt, tools, context)
        return segs + [(prefill, False)] if prefill else segs

    @property
    def role_caps(self) -> RoleCaps:
        """What this template can express about roles (probed once, on first use)."""
        if self._caps is None:
            self._caps = self._probe_roles()
        return self._caps

    def _renders(self, messages: list[dict[str, Any]], *needles: str) -> bool:
        try:
            text = self._render_raw(messages, True, None)
        except EngineError:
            return False
        return all(n in text for n in needles)

    def _probe_roles(self) -> RoleCaps:
        s1, s2, u1, u2, a1 = (f"modelyard-probe-{k}" for k in ("s1", "s2", "u1", "u2", "a1"))
        system_role = self._renders([{"role": "system", "content": s1}, {"role": "user", "content": u1}], s1, u1)
        anywhere = system_role and self._renders(
            [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
             {"role": "system", "content": s2}, {"role": "user", "content": u2}], s2, u2)
        try:  # refused, not merely dropped: a template that reads only some messages is left alone
            self._render_raw([{"role": "user", "content": u1}, {"role": "user", "content": u2}], True, None)
            alternation = False
        except EngineError:
            alternation = self._renders([{"role": "user", "content": u1}], u1)
        alone = not system_role or self._renders([{"role": "system", "content": s1}], s1)
        return RoleCaps(system_role=system_role, system_anywhere=anywhere, alternation=alternation,
                        system_alone=alone)

    @property
    def requires_content(self) -> bool:
        """The template fails on a message whose ``content`` is null (an assistant turn that only
        calls tools) but renders it with ``""`` — as a Qwen3 template testing ``'</think>' in
        message.content`` does. Probed once, as llama.cpp's minja probes its
        ``requires_non_null_content``; such messages then get ``""``."""
        if self._requires_content is None:
            call = [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {}}}]
            probe: list[dict[str, Any]] = [{"role": "user", "content": "modelyard-probe-u1"},
                     {"role": "assistant", "content": None, "tool_calls": call},
                     {"role": "tool", "content": "modelyard-probe-t1", "tool_call_id": "call_0", "name": "f"}]
            try:
                self._render_raw(probe, True, None)
                self._requires_content = False
            except EngineError:
                try:
                    self._render_raw([{**m, "content": m["content"] or ""} for m in probe], True, None)
                    self._requires_content = True
                except EngineError:
                    self._requires_content = False  # it fails either way: leave the messages as they are
        return self._requires_content

    def _split_prefill(self, messages: Any, add_generation_prompt: bool) -> tuple[list[dict[str, Any]], str | None]:
        msgs = fit_roles(normalize_messages(messages, self.developer_known), self.role_caps)
        if any(m.get("content") is None for m in msgs) and self.requires_content:
            msgs = [{**m, "content": ""} if m.get("content") is None else m for m in msgs]
        prefill = _prefill(msgs) if add_generation_prompt else None
        return (msgs[:-1], prefill) if prefill is not None else (msgs, None)

    def _segments(self, msgs: list[dict[str, Any]], real: str, add_generation_prompt: bool,
                  tools: list[Any] | None, context: Mapping[str, Any]) -> list[tuple[str, bool]]:
        contents = [m["content"] if isinstance(m["content"], str) else None for m in msgs]
        segments = self._align(msgs, contents, real, add_generation_prompt, tools, context)
        return self._strip_special(segments)

    def _align(self, msgs: list[dict[str, Any]], contents: list[str | None], real: str,
               add_generation_prompt: bool, tools: list[Any] | None,
               context: Mapping[str, Any]) -> list[tuple[str, bool]]:
        if not any(contents):
            return [(real, True)]
        marked = [dict(m) for m in msgs]
        for i, c in enumerate(contents):
            if c:
                marked[i]["content"] = f"\U000F0000{i}\U000F0001"
        try:
            skeleton = self._render_raw(marked, add_generation_prompt, tools, context)
        except EngineError:
            skeleton = None
        if skeleton is not None:
            parts = _MARK_RE.split(skeleton)  # markup, index, markup, index, ..., markup
            segs: list[tuple[str, bool]] = []
            pos = 0
            ok = True
            for k, part in enumerate(parts):
                if k % 2 == 0:
                    if not real.startswith(part, pos):
                        ok = False
                        break
                    segs.append((part, True))
                    pos += len(part)
                    continue
                c = contents[int(part)] or ""
                following = parts[k + 1]
                for cand in dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip())):
                    if real.startswith(cand, pos) and real.startswith(following, pos + len(cand)):
                        segs.append((cand, False))
                        pos += len(cand)
                        break
                else:
                    ok = False
                    break
            if ok and pos == len(real):
                return [s for s in segs if s[0]]
        # fallback: find each content (as is, else trimmed) in order
        segs = []
        pos = 0
        for c in contents:
            if not c:
                continue
            for cand in dict.fromkeys((c, c.strip())):
                if not cand:
                    continue
                at = real.find(cand, pos)
                if at >= 0:
                    segs.append((real[pos:at], True))
                    segs.append((cand, False))
                    pos = at + len(cand)
                    break
        segs.append((real[pos:], True))
        return [s for s in segs if s[0]]

    def _strip_special(self, segs: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        if self.strip_bos and segs and segs[0][1] and segs[0][0].startswith(self.bos_token):
            segs[0] = (segs[0][0][len(self.bos_token):], True)
        if self.strip_eos and segs and segs[-1][1] and segs[-1][0].endswith(self.eos_token):
            segs[-1] = (segs[-1][0][: len(segs[-1][0]) - len(self.eos_token)], True)
        return [s for s in segs if s[0]]
