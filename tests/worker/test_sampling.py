"""Sampling: parameter validation, each sampler's effect, determinism, raw logprobs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from worker.engine.errors import EngineError
from worker.engine.sampling import Sampler, SamplingParams, raw_logprobs

V = 32


def logits_fixture() -> np.ndarray:
    """Logits with a clear order: token i has logit i/4 (token 31 most likely)."""
    return (np.arange(V, dtype=np.float32) / 4).astype(np.float32)


def make(n_vocab: int = V, history: tuple[int, ...] = (), eog: tuple[int, ...] = (), **kw: object) -> Sampler:
    return Sampler(SamplingParams(**kw).validated(n_vocab), n_vocab, eog, history)


def draw(s: Sampler, logits: np.ndarray, n: int) -> list[int]:
    return [s.sample(logits) for _ in range(n)]


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": "hot"},
        {"top_p": -0.1},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 2.0},
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -2},
        {"n_probs": -1},
        {"n_probs": 21},
        {"n_probs": 1.5},
        {"max_tokens": -1},
        {"max_tokens": 2.0},
        {"max_tokens": True},
        {"top_k": 1.5},
        {"seed": "x"},
        {"presence_penalty": float("inf")},
        {"frequency_penalty": None},
        {"logit_bias": {V: 1.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {"abc": 1.0}},
        {"logit_bias": {3: float("nan")}},
        {"logit_bias": {3: float("inf")}},
        {"logit_bias": [1, 2]},
        {"stop": [1]},
        {"stop": 5},
        {"ignore_eos": "yes"},
    ],
)
def test_invalid_params_rejected(kw: dict[str, object]) -> None:
    with pytest.raises(EngineError) as ei:
        SamplingParams(**kw).validated(V)  # type: ignore[arg-type]
    assert ei.value.code == "invalid_params"
    assert ei.value.message


def test_validated_normalises() -> None:
    p = SamplingParams(logit_bias={"3": -1, 4: float("-inf")}, stop="END", top_k=np.int64(5)).validated(V)
    assert p.logit_bias == {3: -1.0, 4: -math.inf}
    assert p.stop == ["END"]
    assert type(p.top_k) is int
    assert SamplingParams(stop=["", "a", "a", "b"]).validated(V).stop == ["a", "b"]
    assert SamplingParams(stop=None).validated(V).stop == []  # type: ignore[arg-type]


def test_bias_banning_everything_rejected() -> None:
    with pytest.raises(EngineError) as ei:
        make(logit_bias={i: -math.inf for i in range(V)})
    assert ei.value.code == "invalid_params"


# --------------------------------------------------------------------- samplers


def test_greedy_is_first_argmax() -> None:
    x = np.zeros(V, np.float32)
    x[[5, 9]] = 3.0
    s = make(temperature=0.0)
    assert s.sample(x) == 5
    assert s.sample(logits_fixture()) == V - 1


def test_logit_bias_changes_and_bans() -> None:
    x = logits_fixture()
    assert make(temperature=0, logit_bias={3: 100.0}).sample(x) == 3
    assert make(temperature=0, logit_bias={V - 1: -math.inf}).sample(x) == V - 2
    s = make(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, logit_bias={V - 1: -math.inf})
    assert V - 1 not in draw(s, x, 300)


def test_ignore_eos_bans_eog_tokens() -> None:
    x = logits_fixture()
    assert make(temperature=0, eog=(V - 1,), ignore_eos=True).sample(x) == V - 2
    assert make(temperature=0, eog=(V - 1,)).sample(x) == V - 1


def test_top_k_limits_candidates() -> None:
    x = np.zeros(V, np.float32)  # flat: without top_k every token is likely
    x[[2, 7, 11]] = 0.5
    s = make(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=0)
    assert set(draw(s, x, 400)) == {2, 7, 11}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    p = np.array([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    x = np.log(np.maximum(p, 1e-30)).astype(np.float32)
    s = make(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=3)
    assert set(draw(s, x, 500)) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    s = make(temperature=1.0, top_k=0, top_p=0.81, min_p=0.0, seed=3)
    assert set(draw(s, x, 500)) == {0, 1, 2}


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    """OpenAI and llama.cpp accept top_p 0: only the top token survives (greedy-like)."""
    p = np.array([0.4, 0.35, 0.25] + [0.0] * (V - 3))
    x = np.log(np.maximum(p, 1e-30)).astype(np.float32)
    s = make(temperature=1.0, top_k=0, top_p=0.0, min_p=0.0, seed=7)
    assert set(draw(s, x, 200)) == {0}


def test_min_p_relative_to_max() -> None:
    p = np.array([0.4, 0.3, 0.2, 0.1] + [0.0] * (V - 4))
    x = np.log(np.maximum(p, 1e-30)).astype(np.float32)
    # keep p >= 0.45 * 0.4 = 0.18 -> tokens 0, 1, 2
    s = make(temperature=1.0, top_k=0, top_p=1.0, min_p=0.45, seed=4)
    assert set(draw(s, x, 500)) == {0, 1, 2}


def test_temperature_reshapes_distribution() -> None:
    x = np.log(np.array([0.6, 0.4] + [1e-9] * (V - 2))).astype(np.float32)
    n = 4000
    lo = Counter(draw(make(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=5), x, n))
    hi = Counter(draw(make(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5), x, n))
    # T=1: p0 = 0.6; T=0.5: p0 = 0.36 / (0.36 + 0.16) = 0.692
    assert abs(hi[0] / n - 0.6) < 0.03
    assert abs(lo[0] / n - 0.6923) < 0.03


def test_chain_order_top_p_before_temperature() -> None:
    """top_p sees the untempered distribution (llama.cpp order: top_p, min_p, then temperature)."""
    x = np.log(np.array([0.7, 0.2, 0.1] + [1e-9] * (V - 3))).astype(np.float32)
    # at T=1 top_p=0.69 keeps only token 0; if temperature were applied first (T=10)
    # the distribution would be flat enough to keep more tokens
    s = make(temperature=10.0, top_k=0, top_p=0.69, min_p=0.0, seed=6)
    assert set(draw(s, x, 300)) == {0}


def test_repeat_penalty_formula() -> None:
    x = np.array([2.0, -2.0, 1.0, 0.0] + [0.0] * (V - 4), np.float32)
    s = make(repeat_penalty=2.0, repeat_last_n=64, history=(0, 1, 1))
    y = s.apply_bias_and_penalties(x)
    assert y[0] == pytest.approx(1.0)  # positive: divided
    assert y[1] == pytest.approx(-4.0)  # negative: multiplied
    assert y[2] == pytest.approx(1.0)  # not seen
    s = make(repeat_penalty=1.0, frequency_penalty=0.5, presence_penalty=0.25, history=(0, 1, 1))
    y = s.apply_bias_and_penalties(x)
    assert y[0] == pytest.approx(2.0 - 0.5 - 0.25)
    assert y[1] == pytest.approx(-2.0 - 1.0 - 0.25)


def test_repeat_last_n_window() -> None:
    x = np.ones(V, np.float32)
    hist = (5, 6, 7, 8)
    y = make(repeat_penalty=2.0, repeat_last_n=2, history=hist).apply_bias_and_penalties(x)
    assert list(np.nonzero(y != 1.0)[0]) == [7, 8]
    y = make(repeat_penalty=2.0, repeat_last_n=0, history=hist).apply_bias_and_penalties(x)
    assert np.all(y == 1.0)
    y = make(repeat_penalty=2.0, repeat_last_n=-1, history=hist).apply_bias_and_penalties(x)
    assert list(np.nonzero(y != 1.0)[0]) == [5, 6, 7, 8]
    s = make(repeat_penalty=2.0, repeat_last_n=2, history=hist)
    s.accept(9)
    assert list(np.nonzero(s.apply_bias_and_penalties(x) != 1.0)[0]) == [8, 9]


def test_penalties_steer_greedy() -> None:
    x = logits_fixture()
    assert make(temperature=0, repeat_penalty=100.0, history=(V - 1,)).sample(x) == V - 2


# --------------------------------------------------------------------- determinism


def test_same_seed_same_tokens_different_seed_differs() -> None:
    x = np.random.default_rng(0).normal(size=V).astype(np.float32)
    kw = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = draw(make(seed=42, **kw), x, 50)
    b = draw(make(seed=42, **kw), x, 50)
    c = draw(make(seed=43, **kw), x, 50)
    assert a == b
    assert a != c


def test_unseeded_samplers_differ() -> None:
    x = np.zeros(V, np.float32)
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert draw(make(**kw), x, 40) != draw(make(**kw), x, 40)


def test_large_vocab_top_k_uses_partition_and_matches_sort() -> None:
    n = 262_144
    x = np.random.default_rng(1).normal(size=n).astype(np.float32)
    top = set(np.argsort(-x)[:40].tolist())
    s = make(n_vocab=n, temperature=3.0, top_k=40, top_p=1.0, min_p=0.0, seed=7)
    got = set(draw(s, x, 300))
    assert got <= top and len(got) > 10


# --------------------------------------------------------------------- raw logprobs


def test_raw_logprobs_matches_log_softmax() -> None:
    x = np.random.default_rng(2).normal(size=1000).astype(np.float32) * 3
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    lp, top = raw_logprobs(x, 17, 5)
    assert lp == pytest.approx(ref[17], abs=1e-5)
    order = np.argsort(-ref)[:5]
    assert [i for i, _ in top] == order.tolist()
    for i, v in top:
        assert v == pytest.approx(ref[i], abs=1e-5)
    assert raw_logprobs(x, 3, 0)[1] == []


def test_raw_logprobs_ties_sorted_by_id() -> None:
    x = np.zeros(8, np.float32)
    lp, top = raw_logprobs(x, 0, 3)
    assert lp == pytest.approx(-math.log(8))
    assert [i for i, _ in top] == [0, 1, 2]


def test_the_sampler_takes_every_field_of_the_protocols_table() -> None:
    """worker.frames.sampling_params copies every field of protocol.sampling's table (logit_bias
    pairs to a map), and SamplingParams' defaults are the table's."""
    import dataclasses

    from protocol import Generate
    from protocol.sampling import SAMPLING_DEFAULTS, SAMPLING_FIELDS
    from worker.frames import sampling_params

    params = SamplingParams()
    for f in SAMPLING_FIELDS:
        want = {} if f.name == "logit_bias" else f.default
        assert getattr(params, f.name) == want, f.name
    values = {"temperature": 0.3, "top_k": 7, "top_p": 0.5, "min_p": 0.2, "repeat_penalty": 1.3, "repeat_last_n": 5,
              "presence_penalty": 0.4, "frequency_penalty": 0.6, "seed": 11, "n_probs": 3, "max_tokens": 9,
              "post_sampling_probs": True, "ignore_eos": True, "add_special": False, "parse_special": False,
              "cache_prompt": False, "grammar": 'start: "a"', "stop": ["z"], "logit_bias": [[4, False], [5, 2]]}
    assert set(values) | {"json_schema"} == set(SAMPLING_DEFAULTS)
    p = sampling_params(Generate(id="r", prompt="hi", **values))
    for name, v in values.items():
        if name != "logit_bias":
            assert getattr(p, name) == v, name
    assert p.logit_bias == {4: float("-inf"), 5: 2.0} and p.json_schema is None
    assert {f.name for f in dataclasses.fields(p)} >= set(SAMPLING_DEFAULTS)


def test_a_generate_is_checked_once_and_the_engine_trusts_the_checked_copy() -> None:
    """worker.frames.check_generate checks a Generate's sampling values on arrival (the model
    loaded); its checked copy carries the vocabulary it was checked for, and validated() — what
    Engine.prepare calls — returns it as it is instead of checking it again. A copy checked for
    another vocabulary, or none, is checked."""
    from unittest import mock

    from protocol import Error, Generate
    from worker.frames import check_generate

    p = check_generate(Generate(id="r", prompt="hi", temperature=0.5, logit_bias=[[3, 1.0]]), n_vocab=100)
    assert isinstance(p, SamplingParams) and p.checked_for == 100 and p.logit_bias == {3: 1.0}
    with mock.patch.object(SamplingParams, "__post_init__", create=True, side_effect=AssertionError("copied")):
        assert p.validated(100) is p
    assert p.validated(50) is not p and p.validated(50).checked_for == 50
    bad = check_generate(Generate(id="r", prompt="hi", logit_bias=[[300, 1.0]]), n_vocab=100)
    assert isinstance(bad, Error) and bad.code == "invalid_params"
    waiting = check_generate(Generate(id="r", prompt="hi", logit_bias=[[300, 1.0]]))  # no model yet: later
    assert isinstance(waiting, SamplingParams) and waiting.checked_for is None
