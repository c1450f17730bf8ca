"""``protocol.sampling``: the one table of sampling fields, and what reads it."""

from __future__ import annotations

import dataclasses

from protocol import Generate, decode, encode
from protocol.limits import GENERATE_LIMITS
from protocol.sampling import SAMPLING_DEFAULTS, SAMPLING_FIELDS, SamplingFields


def test_the_table_is_the_declaration() -> None:
    assert [f.name for f in SAMPLING_FIELDS] == [f.name for f in dataclasses.fields(SamplingFields)]
    assert len({f.name for f in SAMPLING_FIELDS}) == len(SAMPLING_FIELDS) >= 20
    by_name = {f.name: f for f in SAMPLING_FIELDS}
    assert by_name["temperature"].default == 0.8 and by_name["temperature"].type is float
    assert by_name["logit_bias"].default == [] and by_name["stop"].default == []
    assert dict(SAMPLING_DEFAULTS) == {f.name: f.default for f in SAMPLING_FIELDS}


def test_every_bounded_generate_field_but_n_is_a_sampling_field_with_its_bound() -> None:
    by_name = {f.name: f for f in SAMPLING_FIELDS}
    for name, bound in GENERATE_LIMITS.items():
        if name == "n":  # choices: a Generate field, not a sampling one
            assert name not in by_name
            continue
        assert by_name[name].bound is bound
    assert all(f.bound is None for f in SAMPLING_FIELDS if f.name not in GENERATE_LIMITS)


def test_a_generate_carries_the_sampling_fields_over_the_wire() -> None:
    assert issubclass(Generate, SamplingFields)
    g = Generate(id="r", prompt="hi")
    assert {f.name: getattr(g, f.name) for f in SAMPLING_FIELDS} == dict(SAMPLING_DEFAULTS)
    changed = Generate(id="r", prompt="hi", temperature=0.25, top_k=3, stop=["x"], logit_bias=[[7, -1.5]],
                       json_schema='{"type": "object"}')
    assert decode(encode(changed)) == changed
