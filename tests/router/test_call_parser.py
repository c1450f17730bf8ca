"""The tool-call parser (router.dialects.call_parser.CallParser) on text cut at every character: no byte
of a call's markup ever reaches content, fed whole or piece by piece."""

from __future__ import annotations

import pytest

from router.dialects.call_parser import CallParser
from router.dialects.tools import CALL_OPEN, GENERIC, HERMES, LLAMA3, MISTRAL, ToolSyntax, render_call


def _read(text: str, syntax: ToolSyntax, pieces: int = 1) -> tuple[str, bool, int]:
    p = CallParser(True, custom=frozenset({"apply_patch"}), syntax=syntax)
    step = max(1, len(text) // pieces) if pieces > 1 else len(text) or 1
    out = p.read([text[i:i + step] for i in range(0, len(text), step)] if text else [])
    return out.content or "", out.truncated, len(out.calls)


@pytest.mark.parametrize("syntax", [GENERIC, HERMES], ids=lambda s: s.name)
def test_a_call_cut_anywhere_leaks_no_markup(syntax: ToolSyntax) -> None:
    for call in (render_call("get_weather", '{"city": "Paris"}'), render_call("apply_patch", "*** Begin", True)):
        for cut in range(1, len(call)):
            for pieces in (1, 3):
                content, truncated, n = _read(call[:cut], syntax, pieces)
                assert content == "" and truncated and n == 0, (call[:cut], content)
        assert _read(call, syntax) == ("", False, 1)


def test_mistral_prefix_cut_is_a_truncated_call_not_content() -> None:
    for cut in range(1, len(MISTRAL.prefix)):
        assert _read(MISTRAL.prefix[:cut], MISTRAL) == ("", True, 0)


def test_text_that_only_shares_a_first_character_is_content() -> None:
    assert _read("<b>bold</b>", GENERIC) == ("<b>bold</b>", False, 0)
    assert _read("Hello", GENERIC) == ("Hello", False, 0)
    assert _read("{", LLAMA3) == ("{", False, 0)  # Llama 3's prefix is JSON: a cut reply stays text
    assert CALL_OPEN.startswith("<")
