"""Several sequences in one forward pass, on the real models: batched == alone, prefix cache, KV budget.

The reference for every sequence is the same request run alone on a fresh
cache. In a batch the QKV/O/FFN matmuls run over all rows at once (another
BLAS kernel than a single row), so logits agree to float32 rounding, not
bit for bit: per-token logprobs are compared within 1e-4 and greedy token
ids must be identical.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker.engine import Engine, EngineError, SamplingParams

WORDS = ("the river carried small boats past the old mill while children counted clouds and a dog "
         "barked at nothing in particular under the bridge near the market square").split()


def text_of(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n_probs=1, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request: pytest.FixtureRequest, smollm2_path: Path, gemma3_path: Path) -> Engine:
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    return Engine.load(str(path), n_ctx=1024, parallel=8)


def alone(engine: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    engine.reset_cache()
    lps: list[float] = []
    res = engine.generate(ids, greedy(max_tokens, cache_prompt=False), on_token=lambda e: lps.append(e.logprob))
    return res.tokens, lps


def test_batched_equals_alone_with_joins_cancel_and_long_prompts(engine: Engine) -> None:
    # mixed prompt lengths, one over the 512-token sliding window of Gemma and over one prefill chunk
    lengths = [3, 40, 700, 12, 150, 7, 300, 60]
    prompts = [engine.tokenize(text_of(n, seed=i), add_special=True)[: n + 1] for i, n in enumerate(lengths)]
    n_gen = 10
    ref = [alone(engine, p, n_gen) for p in prompts]

    engine.reset_cache()
    got: dict[str, list[tuple[int, float]]] = {f"s{i}": [] for i in range(8)}
    joins = {0: [0, 1, 2], 2: [3, 4], 5: [5, 6], 9: [7]}  # step -> sequences joining there
    cancel_id, cancel_after = "s4", 4
    results = {}
    step = 0
    mixed_steps = 0  # steps that prefilled one sequence while decoding another
    while step < 200 and (step <= max(joins) or engine.has_work):
        for i in joins.get(step, []):
            sid = f"s{i}"
            engine.add(sid, prompts[i], greedy(n_gen, cache_prompt=False),
                       lambda e, sid=sid: got[sid].append((e.id, e.logprob)))
        if len(got[cancel_id]) >= cancel_after:
            engine.abort(cancel_id)
        slots = engine.slots()
        before = {s.id_task: s.n_past for s in slots if s.is_processing}
        for f in engine.step():
            assert f.error is None, f.error
            results[f.id] = f.result
        after = {s.id_task: s.n_past for s in engine.slots() if s.is_processing}
        grown = [after.get(k, 0) - v for k, v in before.items() if k in after]
        if any(g > 1 for g in grown) and any(g == 1 for g in grown):
            mixed_steps += 1
        step += 1
    assert not engine.has_work and len(results) == 8
    assert mixed_steps > 0  # prefill chunks and decode tokens shared forward passes
    for i in range(8):
        sid = f"s{i}"
        ids_ref, lps_ref = ref[i]
        ids_got = [t for t, _ in got[sid]]
        lps_got = [lp for _, lp in got[sid]]
        if sid == cancel_id:
            assert results[sid].finish_reason == "cancelled"
            assert cancel_after <= len(ids_got) < n_gen  # left within a step of the abort
            ids_ref, lps_ref = ids_ref[:len(ids_got)], lps_ref[:len(ids_got)]
        else:
            assert results[sid].finish_reason == "length"
        assert ids_got == ids_ref, f"{sid}: batched tokens differ from the same request alone"
        np.testing.assert_allclose(lps_got, lps_ref, atol=1e-4, err_msg=sid)


def test_prefix_cache_survives_other_conversations(smollm2_path: Path) -> None:
    eng = Engine.load(str(smollm2_path), n_ctx=2048, parallel=2)
    conv = [{"role": "user", "content": text_of(150, seed=99)}]
    turn1 = eng.tokenize_chat(conv)
    r1 = eng.generate(turn1, greedy(16))
    for k in range(3):  # three other conversations use the model in between
        eng.generate(eng.tokenize_chat([{"role": "user", "content": text_of(120, seed=k)}]), greedy(8))
    reply = eng.detokenize(r1.tokens)
    turn2 = eng.tokenize_chat(conv + [{"role": "assistant", "content": reply},
                                      {"role": "user", "content": "and then?"}])
    r2 = eng.generate(turn2, greedy(4))
    assert r2.cache_n >= len(turn1) + len(r1.tokens) - 4
    assert r2.prompt_n == len(turn2) - r2.cache_n


def test_prefix_cache_lru_within_budget(smollm2_path: Path) -> None:
    probe = Engine.load(str(smollm2_path), n_ctx=1024, parallel=1)
    per_token = probe.info.kv_token_bytes
    prompts = [probe.tokenize(text_of(200, seed=50 + k)) for k in range(4)]
    # room for about three finished conversations, not four
    budget_tokens = 3 * (len(prompts[0]) + 40)
    eng = Engine.load(str(smollm2_path), n_ctx=1024, parallel=1, kv_budget_mib=budget_tokens * per_token / 2**20)
    for p in prompts:
        eng.generate(p, greedy(8))
    first = eng.generate(prompts[0] + [13], greedy(1))   # the least recently used: evicted
    assert first.cache_n == 0
    last = eng.generate(prompts[3] + [13], greedy(1))    # the most recent: still cached
    assert last.cache_n >= len(prompts[3])


def test_request_beyond_the_kv_budget_is_refused_and_the_engine_serves_on(smollm2_path: Path) -> None:
    probe = Engine.load(str(smollm2_path), n_ctx=1024, parallel=2)
    eng = Engine.load(str(smollm2_path), n_ctx=1024, parallel=2,
                      kv_budget_mib=160 * probe.info.kv_token_bytes / 2**20)
    assert eng.info.kv_budget_tokens == 160
    ids = eng.tokenize(text_of(40, seed=3))
    with pytest.raises(EngineError) as ei:
        eng.prepare(ids, greedy(200))
    assert ei.value.code == "kv_budget_exceeded" and "160" in ei.value.message
    # without max_tokens the completion is bounded by the budget instead
    res = eng.generate(ids, SamplingParams(temperature=0.0, ignore_eos=True))
    assert res.finish_reason == "length" and len(ids) + len(res.tokens) == 160
    # two that fit alone but not together: the second waits for the first, both finish
    eng.add("a", ids, greedy(60))
    eng.add("b", ids, greedy(60))
    done = {}
    while eng.has_work:
        for f in eng.step():
            done[f.id] = f
    assert {k: v.result.finish_reason for k, v in done.items()} == {"a": "length", "b": "length"}
    assert done["a"].result.tokens == done["b"].result.tokens


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~32k prompt tokens to prefill: about a minute on an idle 2-core machine
def test_rss_stays_within_budget_under_16_parallel_2k_conversations(smollm2_path: Path) -> None:
    """16 conversations of ~2,000 prompt tokens at once on a 16-slot engine whose KV budget holds
    about five of them: every one finishes, and the process grows by at most the budget (plus
    the per-step activations) over its loaded size."""
    import threading

    import psutil

    budget_mib = 512.0
    eng = Engine.load(str(smollm2_path), n_ctx=4096, parallel=16, kv_budget_mib=budget_mib)
    proc = psutil.Process()
    eng.generate([1, 2, 3], greedy(2))  # weights touched once (they are memory-mapped)
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.05)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        for i in range(16):
            ids = eng.tokenize(text_of(1800, seed=200 + i))[:2000]
            eng.add(f"c{i}", ids, greedy(8))
        done = {}
        max_slots_busy = 0
        while eng.has_work:
            for f in eng.step():
                assert f.error is None, f.error
                done[f.id] = f.result
            max_slots_busy = max(max_slots_busy, sum(s.is_processing for s in eng.slots()))
    finally:
        stop.set()
        th.join()
    assert len(done) == 16 and all(r.finish_reason == "length" for r in done.values())
    assert 2 <= max_slots_busy < 16  # the budget, not the slot count, bounded the concurrency
    grown_mib = (peak[0] - base) / 2**20
    activations_mib = 96  # one 256-token prefill chunk's intermediates over 2k keys, with slack
    assert grown_mib <= budget_mib + activations_mib, f"RSS grew {grown_mib:.0f} MiB for a {budget_mib:.0f} MiB budget"
    assert eng.kv_tokens * eng.info.kv_token_bytes <= budget_mib * 2**20


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(smollm2_path: Path) -> None:
    eng = Engine.load(str(smollm2_path), n_ctx=256, parallel=1)
    huge = "word " * 2_000_000  # 10 MB: tokenizing it would take tens of seconds
    with pytest.raises(EngineError) as ei:
        eng.prepare(huge, greedy(4))
    # the message counts characters, not tokens: it was refused before tokenizing
    assert ei.value.code == "context_length_exceeded" and "maximum context length is 256" in ei.value.message
    assert "characters" in ei.value.message
    with pytest.raises(EngineError) as ei:
        eng.tokenize_chat([{"role": "user", "content": huge}])
    assert ei.value.code == "context_length_exceeded" and "characters" in ei.value.message
    assert eng.generate("short prompt", greedy(2)).finish_reason == "length"


def _tiny_quantized(tmp_path: Path, kind: str) -> Path:
    import json

    from tests.paths import FIXTURES_DIR
    from tests.worker.tiny_gguf import write_tiny_gemma3, write_tiny_qwen

    if kind == "qwen3-q4_k_m":  # Q4_K + Q6_K: kernels chosen by row count (gemm/gemv, tiled/vec_dot)
        kw = json.loads((FIXTURES_DIR / "tiny-arch.llamacpp.json").read_text())["files"][kind]["kwargs"]
        return write_tiny_qwen(tmp_path / f"{kind}.gguf", **{**kw, "n_ctx_train": 1024})
    return write_tiny_gemma3(tmp_path / f"{kind}.gguf", qtype="Q8_0", n_ctx_train=1024, sliding_window=40)


@pytest.mark.parametrize("kind", ["qwen3-q4_k_m", "gemma3-q8_0"])
def test_quantized_long_prompt_is_the_same_bits_beside_any_others(tmp_path: Path, kind: str) -> None:
    # llama.cpp's results depend on how a prompt is cut into micro-batches (the kernels and the
    # flash-attention path are chosen by their row counts): the scheduler cuts every prompt into
    # n_ubatch pieces whatever else runs, and a step's slice of a piece (the step budget, 128
    # while others decode) computes as the whole piece. So a long prompt's logprobs are equal,
    # to the bit, alone and beside other long prompts and decoding streams.
    path = str(_tiny_quantized(tmp_path, kind))
    n_ub = 96   # pieces of 96: tiled attention (>= 64 rows), shorter last pieces take the one-row path
    eng = Engine.load(path, n_ctx=640, parallel=5, weights="quantized", n_ubatch=n_ub)
    rng = np.random.default_rng(7)
    target = [1] + rng.integers(4, 440, 270).tolist()                   # 271 tokens: 96 + 96 + 79
    longs = [[1] + rng.integers(4, 440, n).tolist() for n in (230, 185)]
    shorts = [[1] + rng.integers(4, 440, n).tolist() for n in (6, 9)]
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n_probs=5, cache_prompt=False)

    def alone(e: Engine, ids: list[int]) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        out: list[tuple[int, float | None, list[tuple[int, float]]]] = []
        e.reset_cache()
        e.generate(ids, p, on_token=lambda ev: out.append((ev.id, ev.logprob, list(ev.top_logprobs))))
        return out

    ref = alone(eng, target)
    ref_longs = [alone(eng, q) for q in longs]
    eng.reset_cache()
    got: dict[str, list[tuple[int, float | None, list[tuple[int, float]]]]] = {}
    joins = {0: [("d0", shorts[0]), ("d1", shorts[1]), ("l0", longs[0])], 3: [("t", target), ("l1", longs[1])]}
    step, mixed = 0, 0
    while step <= max(joins) or eng.has_work:
        for sid, ids in joins.get(step, []):
            got[sid] = []
            eng.add(sid, ids, SamplingParams(**{**p.__dict__, "max_tokens": 40 if sid[0] == "d" else 8}),
                    lambda ev, sid=sid: got[sid].append((ev.id, ev.logprob, list(ev.top_logprobs))))
        before = {s.id_task: s.n_past for s in eng.slots() if s.is_processing}
        for f in eng.step():
            assert f.error is None, f.error
        after = {s.id_task: s.n_past for s in eng.slots() if s.is_processing}
        grown = {k: after[k] - v for k, v in before.items() if k in after}
        if grown.get("t", 0) > 1 and any(g == 1 for g in grown.values()) and any(
                g > 1 for k, g in grown.items() if k != "t"):
            mixed += 1   # the target prefilled beside another prompt and a decoding stream
        step += 1
        assert step < 400
    assert mixed > 0
    assert got["t"] == ref, "the long prompt's logprobs changed beside the others"
    assert [got["l0"], got["l1"]] == ref_longs
    # and the test can tell: another cut of the same prompt (llama.cpp's other micro-batches) differs
    eng._sched.n_ubatch = 64  # noqa: SLF001
    assert alone(eng, target) != ref
