"""A GBNF grammar that does not resolve is the client's error (400 invalid_grammar), not a 500:
llguidance's GBNF converter raises a bare Exception for an undefined rule or a missing root."""

from __future__ import annotations

import pytest

from worker.engine import EngineError
from worker.engine.constraints import grammar_text


@pytest.mark.parametrize(("grammar", "needle"), [
    ("root ::= foo", "Rule 'foo' not found"),
    ('x ::= "a"', "No 'root' rule found"),
    ('root ::= "\\q"', "Invalid escape"),
])
def test_unresolvable_gbnf_is_invalid_grammar(grammar: str, needle: str) -> None:
    with pytest.raises(EngineError) as e:
        grammar_text(None, grammar)
    assert e.value.code == "invalid_grammar"
    assert e.value.message.startswith("invalid GBNF grammar: ") and needle in e.value.message


def test_a_resolvable_gbnf_still_converts() -> None:
    assert "start" in (grammar_text(None, 'root ::= "a" | b\nb ::= "b"') or "")
