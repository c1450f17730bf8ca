"""A cancel does not wait for the forward pass running now: ``should_stop`` is polled
between layers, the pass is abandoned, the cancelled sequence leaves, its batch mates run
again at the next step with unchanged outputs, and the K/V written past ``n_past`` by the
abandoned pass never leak into a later request (take-over and copy of a cached prefix,
sliding window). Counted by the engine's step counters, never timed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.worker.tiny_gguf import write_tiny_gemma3, write_tiny_llama
from worker.engine import Engine, SamplingParams

N_LAYER = {"llama": 4, "gemma3": 6}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    d = tmp_path_factory.mktemp("interrupt")
    if request.param == "llama":
        path = write_tiny_llama(d / "tiny-llama.gguf", n_layer=N_LAYER["llama"], n_ctx_train=512)
    else:
        path = write_tiny_gemma3(d / "tiny-gemma3.gguf", n_layer=N_LAYER["gemma3"])  # window 8
    eng = Engine.load(str(path), n_ctx=512, parallel=4, n_batch=32)
    eng.arch = request.param  # type: ignore[attr-defined]
    return eng


def greedy(n: int, cache_prompt: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n_probs=1, cache_prompt=cache_prompt)


def prompt_of(engine: Engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, engine.info.n_vocab - 10, n)]


def alone(engine: Engine, ids: list[int], n: int) -> list[int]:
    engine.reset_cache()
    return engine.generate(ids, greedy(n)).tokens


class StopAfter:
    """A should_stop that turns true on its ``k``-th call once armed (calls: one before each
    step, then one before and one after each layer's attention)."""

    def __init__(self, k: int) -> None:
        self.k, self.calls, self.armed = k, 0, False

    def __call__(self) -> bool:
        if not self.armed:
            return False
        self.calls += 1
        return self.calls >= self.k


def test_cancel_during_a_long_prefill_ends_it_mid_pass(engine: Engine) -> None:
    """One 256-token prefill chunk; the cancel arrives while its pass is at layer 1: the pass
    stops there (fewer layers started than the model has) and the sequence ends cancelled."""
    ids = prompt_of(engine, 250, seed=1)
    engine.reset_cache()
    engine._sched.n_batch = 256  # the whole prompt in one pass  # noqa: SLF001
    try:
        stop = StopAfter(4)  # step start, before / after layer 0's attention, then true before layer 1
        stop.armed = True
        engine.add("long", ids, greedy(4), should_stop=stop)
        before = engine.step_stats
        finished = engine.step()
        after = engine.step_stats
    finally:
        engine._sched.n_batch = 32  # noqa: SLF001
    assert [f.id for f in finished] == ["long"]
    res = finished[0].result
    assert res is not None and res.finish_reason == "cancelled" and res.tokens == []
    assert res.prompt_n == 0  # none of the chunk counts as evaluated
    assert after["passes"] == before["passes"] + 1 and after["interrupted"] == before["interrupted"] + 1
    assert after["last_layers"] == 1 < N_LAYER[engine.arch]  # type: ignore[attr-defined]
    assert not engine.has_work
    assert all(not s.is_processing and s.n_past == 0 for s in engine.slots())  # nothing half-held


def test_batch_mates_unchanged_and_no_stale_kv_after_an_abandoned_pass(engine: Engine) -> None:
    a_ids = prompt_of(engine, 30, seed=2)
    b_ids = prompt_of(engine, 200, seed=3)  # several 32-token chunks, beyond the sliding window
    c_ids = b_ids[:100] + prompt_of(engine, 20, seed=4)  # shares a prefix with b
    ref_a, ref_b, ref_c = alone(engine, a_ids, 12), alone(engine, b_ids, 6), alone(engine, c_ids, 6)

    engine.reset_cache()
    got_a: list[int] = []
    stop = StopAfter(3)

    def on_a(ev: object) -> bool:
        got_a.append(ev.id)  # type: ignore[attr-defined]
        stop.armed = len(got_a) >= 3  # a few steps in: b is mid-prefill, a decoding
        return True

    engine.add("a", a_ids, greedy(12), on_a)
    engine.add("b", b_ids, greedy(6, cache_prompt=True), should_stop=stop)
    before = engine.step_stats
    results = {}
    for _ in range(100):
        if not engine.has_work:
            break
        for f in engine.step():
            assert f.error is None
            results[f.id] = f.result
    after = engine.step_stats
    assert after["interrupted"] == before["interrupted"] + 1
    b = results["b"]
    assert b.finish_reason == "cancelled" and b.tokens == [] and 0 < b.prompt_n < len(b_ids)
    assert results["a"].tokens == ref_a == got_a[:len(ref_a)] + results["a"].tokens[len(got_a):]

    # b's entry keeps exactly the chunks that finished; what the abandoned pass wrote beyond is
    # overwritten before it is read: taking the entry over (b again) and copying its prefix (c)
    # give the fresh answers
    held = b.prompt_n
    again = engine.generate(b_ids, greedy(6, cache_prompt=True))
    assert again.cache_n == held and again.tokens == ref_b
    c = engine.generate(c_ids, greedy(6, cache_prompt=True))
    assert c.cache_n == 100 and c.tokens == ref_c


def test_busy_slots_are_summed_over_passes(engine: Engine) -> None:
    """``busy_slots`` (Pong.n_busy_slots_total, llama.cpp's ``n_busy_slots_total``) adds, at
    every forward pass, the slots holding a sequence: two sequences run together count 2 a pass
    until the shorter one ends, then 1."""
    engine.reset_cache()
    engine.add("one", prompt_of(engine, 5, 1), greedy(2))
    engine.add("two", prompt_of(engine, 5, 2), greedy(6))
    before = engine.step_stats
    busy_per_pass: list[int] = []
    live = {"one", "two"}  # 4 slots: both are admitted at the first step and hold a slot until they end
    while engine.has_work:
        busy = len(live)
        n = engine.step_stats["passes"]
        live -= {f.id for f in engine.step()}
        if engine.step_stats["passes"] > n:
            busy_per_pass.append(busy)
    after = engine.step_stats
    assert after["passes"] - before["passes"] == len(busy_per_pass) >= 6
    assert after["busy_slots"] - before["busy_slots"] == sum(busy_per_pass)
    assert busy_per_pass[0] == 2 and busy_per_pass[-1] == 1
