"""Constrained decoding on the real models: the llguidance tokenizer built from our own
vocabulary (every token's bytes round-trip), masks per sequence (a constrained and an
unconstrained sequence batched together each get what they get alone), schema and
grammar outputs validate, invalid ones are refused before any token."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from worker.engine import Engine, EngineError, SamplingParams
from worker.engine.constraints import Constraint, ll_tokenizer, vocab_bytes
from worker.engine.sampling import Sampler
from worker.engine.text.tokenizer import ATTR_CONTROL

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colours": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "colours"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request: pytest.FixtureRequest, smollm2_path: Path, gemma3_path: Path) -> Engine:
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    return Engine.load(str(path), n_ctx=512, parallel=2)


def test_every_token_round_trips_through_the_llguidance_tokenizer(engine: Engine) -> None:
    tok, n = engine.tokenizer, engine.info.n_vocab
    ll = ll_tokenizer(tok, n)
    assert ll.vocab_size == n and ll_tokenizer(tok, n) is ll  # cached
    ours = vocab_bytes(tok, n)
    bad, byte_ff = [], []
    for i in range(n):
        special = ours[i].startswith(b"\xff")
        raw = tok.token_bytes(i, special=True)
        if raw.startswith(b"\xff") and not tok.attrs[i] & ATTR_CONTROL:
            # Gemma's byte-fallback token <0xFF>: llguidance reads a leading 0xFF as its
            # special-token marker. 0xFF never occurs in UTF-8, so no constraint may
            # produce it anyway: it is special (never allowed), its bytes are not kept.
            byte_ff.append(i)
            assert ll.is_special_token(i)
            continue
        if ll.decode_bytes([i]) != raw or ll.is_special_token(i) != special:
            bad.append(i)
    assert bad == [], f"{len(bad)} tokens do not round-trip, e.g. {bad[:5]}"
    assert len(byte_ff) <= 1
    assert all(ours[i].startswith(b"\xff") for i in range(n) if tok.attrs[i] & ATTR_CONTROL)
    assert set(ll.eos_tokens) == {t for t in tok.eog_ids if t < n}


def _chat(engine: Engine, text: str) -> list[int]:
    if engine.info.has_chat_template:
        return engine.tokenize_chat([{"role": "user", "content": text}])
    return engine.tokenize(text)


def test_json_schema_output_validates_and_ends_by_itself(engine: Engine) -> None:
    ids = _chat(engine, "Ann is 31 and likes red and blue. Describe her as JSON.")
    r = engine.generate(ids, SamplingParams(temperature=0, max_tokens=100, json_schema=json.dumps(SCHEMA)))
    assert r.finish_reason == "stop" and r.stop_type == "eos", r.text
    jsonschema.validate(json.loads(r.text), SCHEMA)
    r = engine.generate(ids, SamplingParams(temperature=0.9, seed=7, max_tokens=100, json_schema=json.dumps(SCHEMA)))
    if r.finish_reason == "stop":  # sampled (not greedy) output obeys the mask too
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("g", ['start: "Answer: " ("yes" | "no") "."\n',
                               '%llguidance {}\nstart: "Answer: " ("yes" | "no") "."\n',
                               'root ::= "Answer: " ("yes" | "no") "."\n'])  # llama.cpp's GBNF
def test_lark_and_gbnf_grammars(engine: Engine, g: str) -> None:
    r = engine.generate(_chat(engine, "Is the sky blue?"), SamplingParams(temperature=0, max_tokens=20, grammar=g))
    assert r.text in ("Answer: yes.", "Answer: no.") and r.finish_reason == "stop"


def test_invalid_constraints_are_refused_before_any_token(engine: Engine) -> None:
    ids = engine.tokenize("hello")
    for params, needle in [
        (SamplingParams(json_schema="{not json"), "not valid JSON"),
        (SamplingParams(json_schema=json.dumps({"type": "strin"})), "strin"),
        (SamplingParams(grammar="start: ("), "grammar"),
        (SamplingParams(grammar="root ::= ("), "GBNF"),
        (SamplingParams(grammar="start: x", json_schema="{}"), "at most one"),
    ]:
        with pytest.raises(EngineError) as e:
            engine.prepare(ids, params)
        assert e.value.code == "invalid_grammar" and needle in e.value.message, e.value.message


def test_unenforceable_keywords_are_set_aside_and_reported(engine: Engine) -> None:
    """A keyword llguidance cannot enforce (Zod's ``propertyNames``, ``not``, an unknown
    format) loosens the grammar instead of failing the request, and is reported."""
    ids = engine.tokenize("hello")
    schema = {"type": "object", "properties": {
        "tags": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "string"}},
        "n": {"not": {"type": "string"}}, "u": {"type": "string", "format": "nonsense"}}}
    _, p = engine.prepare(ids, SamplingParams(json_schema=json.dumps(schema)))
    assert any("propertyNames" in w for w in p.set_aside) and any("not" in w for w in p.set_aside), p.set_aside
    _, p = engine.prepare(ids, SamplingParams(json_schema=json.dumps({"type": "object"})))
    assert p.set_aside == ()


def test_constrained_and_free_sequences_batched_get_what_they_get_alone(engine: Engine) -> None:
    a = _chat(engine, "Describe a cat as JSON.")
    b = _chat(engine, "Name three colours.")
    pa = SamplingParams(temperature=0, max_tokens=40, json_schema=json.dumps(SCHEMA), cache_prompt=False)
    pb = SamplingParams(temperature=0, max_tokens=12, cache_prompt=False)
    engine.reset_cache()
    alone_a, alone_b = engine.generate(a, pa), engine.generate(b, pb)
    engine.reset_cache()
    engine.add("a", *engine.prepare(a, pa))
    engine.add("b", *engine.prepare(b, pb))
    out = {}
    for _ in range(200):
        for f in engine.step():
            assert f.error is None
            out[f.id] = f.result
        if not engine.has_work:
            break
    assert out["a"].tokens == alone_a.tokens and out["b"].tokens == alone_b.tokens


def test_sampler_mask_is_applied_before_the_chain() -> None:
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0], dtype=np.float32)
    allowed = np.array([False, False, True, True, False])
    s = Sampler(SamplingParams(temperature=0).validated(5), 5)
    assert s.sample(logits, allowed) == 2
    s = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=1).validated(5), 5)  # top-k sees only allowed ones
    assert s.sample(logits, allowed) == 2
    s = Sampler(SamplingParams(temperature=0, logit_bias={3: 10.0}).validated(5), 5)
    assert s.sample(logits, allowed) == 3
    assert logits.tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]  # never written


def test_constraint_object(engine: Engine) -> None:
    c = Constraint.create(engine.tokenizer, engine.info.n_vocab, None, 'start: "ab"\n')
    assert c is not None and not c.done
    allowed = c.allowed()
    assert allowed.dtype == np.bool_ and allowed.shape == (engine.info.n_vocab,)
    for t in engine.tokenize("ab", add_special=False):
        assert c.allowed()[t]
        c.advance(t)
    assert c.done and c.n_masks >= 2 and c.mask_ms > 0
    assert Constraint.create(engine.tokenizer, engine.info.n_vocab, None, None) is None


def test_a_constraint_is_compiled_once(engine: Engine) -> None:
    """check() on the prep thread compiles; the sequences' matchers are copies of that one
    (each starts fresh: a copy advanced by one sequence leaves the next one's unchanged)."""
    from worker.engine import constraints

    g = 'start: "compiled once " /[0-9]/\n'
    before = constraints.compilations
    constraints.check(engine.tokenizer, engine.info.n_vocab, None, g)
    a = Constraint.create(engine.tokenizer, engine.info.n_vocab, None, g)
    b = Constraint.create(engine.tokenizer, engine.info.n_vocab, None, g)
    assert constraints.compilations == before + 1
    assert a is not None and b is not None
    for t in engine.tokenize("compiled once 7", add_special=False):
        a.advance(t)
    assert a.done and not b.done and a.error is None
    with pytest.raises(EngineError):  # failures are not cached: each is refused again
        constraints.check(engine.tokenizer, engine.info.n_vocab, None, "start: nope\n")
    with pytest.raises(EngineError):
        constraints.check(engine.tokenizer, engine.info.n_vocab, None, "start: nope\n")


def test_every_tool_constraint_the_router_builds_compiles(engine: Engine) -> None:
    """Each shape of tool grammar (function and custom tools: free text, regex, Lark;
    every choice mode; every tool syntax; with a response format) is accepted by
    llguidance, and a free-text custom tool's call can be generated and parsed back."""
    from router.dialects.constraints import tool_constraint
    from router.dialects.call_parser import parse_output
    from router.dialects.tools import HERMES, LLAMA3, MISTRAL, Tool, ToolChoice

    fn = Tool("get_weather", "weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]})
    free = Tool("apply_patch", "patch", custom=True)
    regex = Tool("code", "two letters", custom=True, grammar=("regex", "[a-z]{2}"))
    lark = Tool("shout", "words", custom=True, grammar=("lark", 'start: "HEY" | "HO"'))
    tok, n = engine.tokenizer, engine.info.n_vocab
    from worker.engine.constraints import check
    choices = [ToolChoice("auto"), ToolChoice("required"), ToolChoice("required", parallel=False)]
    for tools in ([fn], [free], [fn, free, regex, lark]):
        for choice in choices + [ToolChoice("named", tools[-1].name)]:
            for fmt in (None, json.dumps({"type": "object"})):
                g = tool_constraint(tools, choice, fmt)
                assert g is not None
                check(tok, n, None, g)
    for syntax in (HERMES, LLAMA3, MISTRAL):
        for choice in choices:
            check(tok, n, None, tool_constraint([fn], choice, None, syntax))
    g = tool_constraint([free], ToolChoice("required", parallel=False))
    r = engine.generate(_chat(engine, "Write a patch."), SamplingParams(temperature=0, max_tokens=40, grammar=g))
    assert r.text.strip(), r
    if r.finish_reason == "stop":
        out = parse_output(r.text, True, custom=frozenset({"apply_patch"}))
        assert [c.name for c in out.calls] == ["apply_patch"] and out.calls[0].custom, r.text
