"""Templates with their own tool syntax (Hermes / Qwen 2.5 ``<tool_call>``, Llama 3.1 JSON
calls, Mistral ``[TOOL_CALLS]``): the tools and the tool history reach the template as HF
templates expect them, the template's own rendering of a call parses back to that call,
and on tiny random-weight GGUFs carrying those templates the constraint forces a
well-formed call in that syntax (a random model cannot choose well, but what it writes
parses, validates against the parameters, and is the same streamed or not).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from router.dialects.call_parser import parse_output
from router.dialects.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    ChatTurn,
    Tool,
    ToolCall,
    detect_syntax,
    render_messages,
    syntax_for,
    template_tools,
)
from tests.router.conftest import LiveRouter
from tests.router.tool_templates import TEMPLATES
from tests.worker.tiny_gguf import CHATML_TEMPLATE, write_tiny_llama
from worker.engine.text.builtin_templates import resolve_template
from worker.engine.text.chat_template import ChatTemplate

SYNTAX = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"]}
TOOL = Tool("get_weather", "Weather of a city", PARAMS)
HISTORY = [ChatTurn("user", "Weather in Paris?"),
           ChatTurn("assistant", "", [ToolCall("call_abc", "get_weather", '{"city": "Paris", "days": 2}')]),
           ChatTurn("tool", "18 C", tool_call_id="call_abc"),
           ChatTurn("user", "And Rome?")]
#: How each template writes the history's call (what the model is taught to write).
CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "',
}


def test_syntax_is_detected_from_the_template() -> None:
    for name, src in TEMPLATES.items():
        assert detect_syntax(src) is SYNTAX[name]
    for src in (CHATML_TEMPLATE, resolve_template("chatml"), resolve_template("gemma")):
        assert detect_syntax(src) is GENERIC


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tools_and_history_reach_the_template_and_its_calls_parse_back(name: str) -> None:
    syntax = SYNTAX[name]
    t = ChatTemplate(TEMPLATES[name], bos_token="<s>", eos_token="</s>")
    prompt = t.render(render_messages(HISTORY, [TOOL], syntax), tools=template_tools([TOOL], syntax))
    listed = json.dumps({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                          "parameters": PARAMS}})
    assert listed in prompt  # tools= in the Jinja context, as HF templates read it
    assert CALL_TEXT[name] in prompt and "18 C" in prompt  # the call and its result: never dropped
    assert "The tool get_weather returned" not in prompt  # not the generic format
    call_text = CALL_TEXT[name] if name != "mistral" else prompt[prompt.index("[TOOL_CALLS]"):prompt.index("]</s>") + 1]
    out = parse_output(call_text, True, syntax=syntax)
    assert out.content is None and [(c.name, json.loads(c.arguments)) for c in out.calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    if name == "mistral":  # its template demands 9-alphanumeric ids: the result points at the same one
        ident = call_text.split('"id": "')[1][:9]
        assert len(ident) == 9 and ident.isalnum() and f'"call_id": "{ident}"' in prompt


def test_custom_tools_use_the_generic_format() -> None:
    """Native syntaxes carry JSON arguments only: a custom (free-text) tool offered, or called
    in the history, puts the request in the generic format."""
    shout = Tool("shout", custom=True)
    assert syntax_for(HERMES, [TOOL, shout], []) is GENERIC
    assert syntax_for(MISTRAL, [TOOL], [ChatTurn("assistant", "", [ToolCall("c", "shout", "HI", custom=True)])]) \
        is GENERIC
    assert syntax_for(LLAMA3, [TOOL], HISTORY) is LLAMA3


# ----------------------------------------------------------------------------- live, tiny GGUFs


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    models = ""
    for name, src in TEMPLATES.items():
        write_tiny_llama(module_tmp / f"{name}.gguf", chat_template=src, n_ctx_train=2048, seed=3)
        models += f'[models.tiny-{name}]\npath = "{name}.gguf"\n'
    config = f'[server]\nmodels_dir = "{module_tmp}"\n[defaults]\nn_ctx = 2048\ntemperature = 0\n' + models
    r = LiveRouter(module_tmp, config, real=True)
    yield r
    r.stop(timeout=60)
    r.kill()


CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _streamed_calls(c: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for ch in c.chat.completions.create(**kw, stream=True):
        if not ch.choices:
            continue
        assert not ch.choices[0].delta.content  # no raw markup leaks into content
        for d in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or "" if d.function else ""
            entry[1] += d.function.arguments or "" if d.function else ""
        finish = ch.choices[0].finish_reason or finish
    return [(n, a) for _, (n, a) in sorted(calls.items())], finish


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_forced_call_in_the_templates_syntax_parses_and_streams_the_same(router: LiveRouter, name: str) -> None:
    c = router.client(timeout=300)
    kw: dict[str, Any] = dict(model=f"tiny-{name}", messages=ASK, tools=CHAT_TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_tokens=120)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]  # type: ignore[union-attr]
    assert [n for n, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), PARAMS)
    assert _streamed_calls(c, **kw) == (calls, "tool_calls")
    # the call goes back as history (the template renders it natively, Mistral's 9-character id
    # check included) and the next turn runs
    follow = c.chat.completions.create(model=f"tiny-{name}", max_tokens=4, tools=CHAT_TOOLS, tool_choice="none",
                                       messages=ASK + [ch.message.model_dump(exclude_none=True),  # type: ignore[list-item]
                                                       {"role": "tool", "tool_call_id": ch.message.tool_calls[0].id,
                                                        "content": "18 C"}])
    base = c.chat.completions.create(model=f"tiny-{name}", max_tokens=1, messages=ASK)  # type: ignore[arg-type]
    assert follow.usage.prompt_tokens > base.usage.prompt_tokens + 20  # type: ignore[union-attr]


@pytest.mark.slow
def test_anthropic_tool_use_in_a_native_syntax(router: LiveRouter) -> None:
    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=300)
    kw: dict[str, Any] = dict(model="tiny-hermes", max_tokens=120, messages=ASK,
                              tools=[{"name": "get_weather", "description": "Weather of a city", "input_schema": PARAMS}],
                              tool_choice={"type": "tool", "name": "get_weather"})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    jsonschema.validate(m.content[0].input, PARAMS)  # type: ignore[union-attr]
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].input == m.content[0].input  # type: ignore[union-attr]


def test_generic_rendering_merges_a_run_once_as_pairwise() -> None:
    """Consecutive turns of one role merge as before — texts joined by a blank line, empty ones
    adding none; reasoning the same way — in one join per message (pairwise merging was
    quadratic on the router's event loop: 4,000 user turns of 2 KB took 8 s, 5 ms now)."""
    turns = [ChatTurn("user", ""), ChatTurn("user", "a"), ChatTurn("user", ""), ChatTurn("user", "b"),
             ChatTurn("assistant", "x", reasoning="r1"), ChatTurn("assistant", "", reasoning=""),
             ChatTurn("assistant", "y", reasoning="r2"), ChatTurn("system", "s"), ChatTurn("system", "t")]
    assert render_messages(turns) == [
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "x\n\ny", "reasoning_content": "r1\n\n\n\nr2"},
        {"role": "system", "content": "s"}, {"role": "system", "content": "t"}]
    many = render_messages([ChatTurn("user", str(i)) for i in range(5000)])
    assert many == [{"role": "user", "content": "\n\n".join(str(i) for i in range(5000))}]
