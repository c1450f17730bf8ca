"""``protocol.limits`` is the one table of Generate bounds: the worker accepts exactly it.

The router enforces the table (a 400 naming the field); here every bound is held to
the worker's own validation (``SamplingParams.validated``) at its edges, so the two
can never drift apart again (the router once accepted n_probs up to 100 while the
worker refused above 20).
"""

from __future__ import annotations

import pytest

from protocol.limits import GENERATE_LIMITS, MAX_N_PROBS, Bound
from worker.engine.errors import EngineError
from worker.engine.sampling import MAX_N_PROBS as ENGINE_MAX_N_PROBS
from worker.engine.sampling import SamplingParams

STEP = {"n_probs": 1, "max_tokens": 1, "repeat_last_n": 1, "n": 1}  # integer fields; the rest are floats
#: Caps only the router needs (counts kept in int32); the engine takes any larger value.
ROUTER_ONLY_CAPS = {"max_tokens", "repeat_last_n"}


def _accepts(name: str, value: float) -> bool:
    if name == "n":  # not a sampling parameter: the worker checks it on a Generate's arrival
        from protocol import Error, Generate
        from worker.frames import check_generate

        return not isinstance(check_generate(Generate(id="x", prompt="hi", n=int(value)), n_vocab=1000), Error)
    try:
        SamplingParams(**{name: value}).validated(n_vocab=1000)
    except EngineError:
        return False
    return True


def test_the_engine_constant_is_the_table() -> None:
    assert ENGINE_MAX_N_PROBS == MAX_N_PROBS == GENERATE_LIMITS["n_probs"].hi


@pytest.mark.parametrize("name", sorted(GENERATE_LIMITS))
def test_the_worker_accepts_exactly_the_table(name: str) -> None:
    b = GENERATE_LIMITS[name]
    step = STEP.get(name, 1e-6)
    cast = int if name in STEP else float
    if b.lo is not None:
        inside = b.lo + step if b.lo_open else b.lo
        assert _accepts(name, cast(inside)) and b.contains(cast(inside))
        outside = b.lo if b.lo_open else b.lo - step
        assert not _accepts(name, cast(outside)) and not b.contains(cast(outside))
    if b.hi is not None:
        assert _accepts(name, cast(b.hi)) and b.contains(cast(b.hi))
        if name not in ROUTER_ONLY_CAPS:
            assert not _accepts(name, cast(b.hi + step))
        assert not b.contains(cast(b.hi + step))


def test_bound_descriptions() -> None:
    assert Bound(0, 20).describe() == "in [0, 20]"
    assert Bound(0.0, lo_open=True).describe() == "> 0"
    assert Bound(-1).describe() == ">= -1"
