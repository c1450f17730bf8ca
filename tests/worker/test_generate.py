"""The scheduler on a scripted model: stops, hold-back, UTF-8, limits, cancel, cache reuse, batching.

``ScriptModel`` implements the batch model interface (``forward_batch`` over
segments of KV entries); its next-token choice for a sequence is a function of
that sequence's whole context (its entry's verified tokens + the tokens fed),
so any cache mistake (stale, missing or another sequence's tokens) changes the
output.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.worker.test_tokenizer import bpe_metadata
from worker.engine.attention import AttnBatch
from worker.engine.errors import EngineError
from worker.engine.generate import GenerationResult, TokenEvent, check_context
from worker.engine.kv.cache import KVShape
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler, run_one
from worker.engine.seqs import SeqRequest
from worker.engine.text.bpe import BYTE_TO_UNICODE
from worker.engine.text.tokenizer import Tokenizer

TOK = Tokenizer.from_metadata(bpe_metadata())
EOS = TOK.token_id("<|im_end|>")


class ScriptModel:
    """Deterministic stand-in for ``worker.engine.arch.model.Model`` (the batch interface)."""

    dtype = np.dtype(np.float32)
    kv_shape = KVShape(1, 1, 1, 1)

    def __init__(self, script: Callable[[list[int]], int], n_ctx: int = 512, fail_at: int | None = None) -> None:
        self.script = script
        self.n_ctx = n_ctx
        self.n_vocab = TOK.n_vocab
        self.calls: list[int] = []  # tokens per forward call
        self.segments: list[list[tuple[int, int, int, int, int]]] = []  # per call: (entry, pos0, n, ubatch, row)
        self.fail_at = fail_at  # raise when a forward would make a sequence's context this long

    def forward_batch(self, tokens: np.ndarray, batch: AttnBatch, rows: list[int]) -> np.ndarray:
        contexts = []
        fed: dict[int, list[int]] = {}  # entry -> tokens of its earlier segments in this pass
        for seg in batch.segments:
            before = fed.setdefault(id(seg.kv), [])
            assert seg.pos0 == seg.kv.n_past + len(before) and seg.pos0 + seg.n <= min(self.n_ctx, seg.kv.capacity)
            assert 0 <= seg.ubatch_row and seg.ubatch_row + seg.n <= seg.ub_rows
            before += [int(t) for t in tokens[seg.start:seg.start + seg.n]]
            ctx = seg.kv.tokens + before
            if self.fail_at is not None and len(ctx) >= self.fail_at:
                raise RuntimeError("boom")
            contexts.append((seg, ctx))
        self.calls.append(int(tokens.shape[0]))
        self.segments.append([(id(g.kv), g.pos0, g.n, g.ub_rows, g.ubatch_row) for g in batch.segments])
        out = np.zeros((len(rows), self.n_vocab), np.float32)
        for i, r in enumerate(rows):
            seg, ctx = next((s, c) for s, c in contexts if s.start <= r < s.start + s.n)
            out[i, self.script(ctx[:seg.pos0 + r - seg.start + 1])] = 20.0
        return out


def new_sched(model: ScriptModel, **kw: object) -> Scheduler:
    return Scheduler(model, TOK, **kw)  # type: ignore[arg-type]


def held(sched: Scheduler) -> list[int]:
    """Tokens of the most recently used KV entry."""
    return list(max(sched.pool.entries, key=lambda e: e.last_use).tokens) if sched.pool.entries else []


def ids(text: str) -> list[int]:
    return TOK.tokenize(text, add_special=False, parse_special=True)


def chars(text: str) -> list[int]:
    """One token per UTF-8 byte (the vocabulary's byte tokens)."""
    return [TOK.token_id(BYTE_TO_UNICODE[b]) for b in text.encode()]


def say(reply: list[int], n_prompt: int) -> Callable[[list[int]], int]:
    """A script continuing with ``reply`` after an ``n_prompt``-token prompt, then EOS."""

    def script(kv: list[int]) -> int:
        i = len(kv) - n_prompt
        return reply[i] if 0 <= i < len(reply) else EOS

    return script


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw}).validated(TOK.n_vocab)  # type: ignore[arg-type]


def run(model: ScriptModel, prompt: list[int], cache: Scheduler | None = None,
        should_stop: Callable[[], bool] | None = None, on_token: Callable[[TokenEvent], object] | None = None,
        chunk: int = 256, **kw: object) -> tuple[GenerationResult, list[TokenEvent]]:
    events: list[TokenEvent] = []

    def cb(e: TokenEvent) -> object:
        events.append(e)
        return on_token(e) if on_token else True

    p = params(**kw)
    check_context(model.n_ctx, len(prompt), p.max_tokens)
    sched = cache if cache is not None else new_sched(model)
    sched.n_batch = chunk
    res = run_one(sched, SeqRequest("r", prompt, p, cb), should_stop)
    return res, events


def delivered(res: GenerationResult, events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events) + res.tail


PROMPT = ids("<|im_start|>hello")


# ------------------------------------------------------------------ basic decode


def test_greedy_until_eos_not_in_text() -> None:
    reply = ids("hello world")
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, n_probs=2)
    assert res.text == "hello world"
    assert (res.finish_reason, res.stop_type) == ("stop", "eos")
    assert res.tokens == reply + [EOS] and res.predicted_n == len(reply) + 1
    assert [e.id for e in events] == reply  # no event for the end-of-generation token
    assert delivered(res, events) == res.text
    assert res.prompt_tokens == res.prompt_n == len(PROMPT) and res.cache_n == 0
    assert res.prompt_ms >= 0 and res.predicted_ms >= 0
    assert all(e.logprob is not None and len(e.top_logprobs) == 2 and e.top_logprobs[0][0] == e.id for e in events)
    # the end-of-generation token is reported on the result, with its probabilities (llama.cpp lists it)
    eog_id, eog_lp, eog_top = res.eog
    assert eog_id == EOS and eog_lp is not None and eog_lp <= 0.0 and eog_top[0][0] == EOS and len(eog_top) == 2
    res, _ = run(ScriptModel(say(reply, len(PROMPT))), PROMPT)
    assert res.eog == (EOS, None, [])  # without n_probs: the id only


def test_ignore_eos_runs_to_max_tokens() -> None:
    res, events = run(ScriptModel(say([], len(PROMPT))), PROMPT, ignore_eos=True, max_tokens=5)
    assert (res.finish_reason, res.stop_type) == ("length", "limit")
    assert len(res.tokens) == 5 and EOS not in res.tokens


def test_max_tokens_limit_and_zero() -> None:
    reply = ids("hello world hello world")
    model = ScriptModel(say(reply, len(PROMPT)))
    res, events = run(model, PROMPT, max_tokens=3)
    assert (res.finish_reason, res.stop_type) == ("length", "limit") and len(res.tokens) == 3
    assert model.calls == [len(PROMPT), 1, 1]  # the last token is not fed back
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, max_tokens=0)
    assert res.tokens == [] and res.text == "" and res.finish_reason == "length"


def test_generation_stops_when_context_is_full() -> None:
    model = ScriptModel(say([], len(PROMPT)), n_ctx=len(PROMPT) + 4)
    res, _ = run(model, PROMPT, ignore_eos=True)
    assert res.finish_reason == "length" and len(res.tokens) == 4


def test_control_token_generated_mid_text_emits_nothing() -> None:
    reply = ids("he") + [TOK.token_id("<|im_start|>")] + ids("llo")
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT)
    assert res.text == "hello"
    assert events[1].text == "" and events[1].piece == b""


# ------------------------------------------------------------------ UTF-8 and stop strings


def test_split_utf8_character_never_emitted_half_way() -> None:
    # each byte of "é" and "😀" is its own token in this vocabulary
    reply = ids("aé😀b")
    assert len(reply) == 8
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT)
    texts = [e.text for e in events]
    assert texts == ["a", "", "é", "", "", "", "😀", "b"]
    assert not any("\ufffd" in t for t in texts)
    assert res.text == "aé😀b"


def test_incomplete_utf8_at_the_end_is_flushed_as_replacement() -> None:
    reply = ids("a😀")[:3]  # "a" + two of four bytes
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT)
    assert "".join(e.text for e in events) == "a"
    assert res.text == "a\ufffd" and res.tail == "\ufffd"


@pytest.mark.parametrize("stop", ["wor", "o w", "hello world"])
def test_stop_string_split_across_tokens(stop: str) -> None:
    reply = chars("hello world!")  # one token per character
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, stop=["zzz", stop])
    expected = "hello world!"[: "hello world!".index(stop)]
    assert res.text == expected
    assert (res.finish_reason, res.stop_type, res.stopping_word) == ("stop", "word", stop)
    assert delivered(res, events) == expected
    sent = ""
    for e in events:  # never emitted then retracted: every prefix stays a prefix of the result
        sent += e.text
        assert expected.startswith(sent)
    # the token that completes the stop string is part of the tokens
    assert len(res.tokens) == len(expected) + len(stop)


def test_partial_stop_prefix_is_held_then_released() -> None:
    reply = chars("ab wox")
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, stop=["world"])
    assert [e.text for e in events] == ["a", "b", " ", "", "", "wox"]
    assert res.text == "ab wox" and res.stop_type == "eos"


def test_held_back_prefix_goes_to_tail_at_limit() -> None:
    reply = chars("abwor")
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, stop=["world"], max_tokens=5)
    assert "".join(e.text for e in events) == "ab" and res.tail == "wor" and res.text == "abwor"


def test_stop_string_inside_one_token_and_earliest_wins() -> None:
    reply = ids("hello world")
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, stop=["orl", "ell"])
    assert res.text == "h" and res.stopping_word == "ell"
    assert delivered(res, events) == "h"


# ------------------------------------------------------------------ cancellation


def test_cancel_via_on_token() -> None:
    reply = ids("hello world hello")
    seen: list[int] = []
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, on_token=lambda e: seen.append(e.id) or len(seen) < 2)
    assert (res.finish_reason, res.stop_type) == ("cancelled", "cancelled")
    assert len(res.tokens) == 2 and delivered(res, events) == res.text


def test_on_token_returning_none_continues() -> None:
    reply = ids("hello")
    res, _ = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, on_token=lambda e: None)
    assert res.finish_reason == "stop"


def test_cancel_via_should_stop_between_tokens() -> None:
    reply = ids("hello world hello")
    polls = iter([False, False, True])
    res, events = run(ScriptModel(say(reply, len(PROMPT))), PROMPT, should_stop=lambda: next(polls, True))
    # polled before each step: the first prefills and samples token 1, the second feeds it and samples token 2
    assert res.finish_reason == "cancelled" and len(res.tokens) == 2


def test_cancel_during_prefill_keeps_only_evaluated_chunks_in_cache() -> None:
    prompt = chars("abcdefghij" * 3)  # 30 tokens, chunks of 8
    model = ScriptModel(say(ids("ok"), len(prompt)))
    cache = new_sched(model)
    polls = iter([False, False, True])
    res, events = run(model, prompt, cache=cache, chunk=8, should_stop=lambda: next(polls, True))
    assert res.finish_reason == "cancelled" and res.tokens == [] and events == []
    assert res.prompt_n == 16 and model.calls == [8, 8]
    assert held(cache) == prompt[:16]
    # the next identical request reuses the 16 evaluated tokens and finishes normally
    res2, _ = run(model, prompt, cache=cache, chunk=8)
    assert res2.cache_n == 16 and res2.prompt_n == 14 and res2.text == "ok"


# ------------------------------------------------------------------ cache reuse


def context_script(kv: list[int]) -> int:
    """Next token depends on the whole context (a cache error changes it)."""
    letters = chars("abcdefghijklmnop ")
    if len(kv) > 60:
        return EOS
    return letters[(sum((i + 1) * t for i, t in enumerate(kv)) * 7919) % len(letters)]


def test_cache_reuse_matches_fresh_and_reevaluates_last_token() -> None:
    prompt_a = ids("hello world") + chars("xyz")
    prompt_b = prompt_a[:-1] + [TOK.token_id("q")]
    fresh = {tuple(p): run(ScriptModel(context_script), p)[0].text for p in (prompt_a, prompt_b)}

    model = ScriptModel(context_script)
    cache = new_sched(model)
    r1, _ = run(model, prompt_a, cache=cache)
    assert r1.text == fresh[tuple(prompt_a)] and r1.cache_n == 0
    # same prompt again: all but the last prompt token reused
    r2, _ = run(model, prompt_a, cache=cache)
    assert r2.text == r1.text and r2.cache_n == len(prompt_a) - 1 and r2.prompt_n == 1
    # prompt diverging at its last token
    r3, _ = run(model, prompt_b, cache=cache)
    assert r3.text == fresh[tuple(prompt_b)] and r3.cache_n == len(prompt_b) - 1
    # continuing the conversation: prompt = previous prompt + reply + more
    prompt_c = prompt_b + r3.tokens[:-1] + [TOK.token_id("z")]
    r4, _ = run(model, prompt_c, cache=cache)
    assert r4.text == run(ScriptModel(context_script), prompt_c)[0].text
    assert r4.cache_n == len(prompt_b) + len(r3.tokens) - 1  # every reply token but EOS was fed
    # cache_prompt=False evaluates everything
    r5, _ = run(model, prompt_a, cache=cache, cache_prompt=False)
    assert r5.cache_n == 0 and r5.prompt_n == len(prompt_a) and r5.text == r1.text


def test_cancelled_request_then_greedy_equals_fresh() -> None:
    prompt = ids("hello world")
    model = ScriptModel(context_script)
    cache = new_sched(model)
    run(model, prompt, cache=cache, on_token=lambda e: False)
    other = prompt[:3] + [TOK.token_id("k")]
    res, _ = run(model, other, cache=cache)
    assert res.text == run(ScriptModel(context_script), other)[0].text


def test_model_failure_leaves_only_verified_cache() -> None:
    prompt = chars("abcdefghij" * 2)  # 20 tokens
    model = ScriptModel(context_script, fail_at=19)
    cache = new_sched(model)
    with pytest.raises(RuntimeError):
        run(model, prompt, cache=cache, chunk=8)
    assert held(cache) == prompt[:16]
    model.fail_at = None
    res, _ = run(model, prompt, cache=cache, chunk=8)
    assert res.cache_n == 16 and res.text == run(ScriptModel(context_script), prompt)[0].text


def test_failure_during_decode_and_in_callback() -> None:
    prompt = ids("hello")
    model = ScriptModel(context_script, fail_at=len(prompt) + 3)
    cache = new_sched(model)
    with pytest.raises(RuntimeError):
        run(model, prompt, cache=cache)
    assert len(held(cache)) == len(prompt) + 2 and held(cache)[:len(prompt)] == prompt

    def boom(e: TokenEvent) -> bool:
        raise ValueError("client went away")

    model2 = ScriptModel(context_script)
    cache2 = new_sched(model2)
    with pytest.raises(ValueError):
        run(model2, prompt, cache=cache2, on_token=boom)
    assert held(cache2) == prompt


# ------------------------------------------------------------------ sampling through the loop


def test_seeded_sampling_deterministic_through_loop() -> None:
    def flat(kv: list[int]) -> int:
        return EOS

    class Flat(ScriptModel):
        def forward_batch(self, tokens: np.ndarray, batch: AttnBatch, rows: list[int]) -> np.ndarray:
            super().forward_batch(tokens, batch, rows)
            return np.zeros((len(rows), self.n_vocab), np.float32)

    def sample(seed: int) -> list[int]:
        return run(Flat(flat), PROMPT, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                   max_tokens=12, ignore_eos=True)[0].tokens

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


# ------------------------------------------------------------------ context check


def test_context_length_exceeded_message() -> None:
    with pytest.raises(EngineError) as ei:
        check_context(100, 90, 20)
    assert ei.value.code == "context_length_exceeded"
    assert ei.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 110 tokens "
        "(90 in the prompt, 20 for the completion)."
    )
    check_context(100, 90, 10)
    check_context(100, 99, None)
    with pytest.raises(EngineError):
        check_context(100, 100, None)


# ------------------------------------------------------------------ prompt micro-batches


def test_ubatch_bounds_count_from_the_reused_prefix() -> None:
    from worker.engine.scheduler import ubatch_bounds

    assert [ubatch_bounds(0, 10, at, 4) for at in (0, 3, 4, 7, 8, 9)] == [(0, 4)] * 2 + [(4, 4)] * 2 + [(8, 2)] * 2
    assert [ubatch_bounds(3, 10, at, 4) for at in (3, 6, 7, 9)] == [(3, 4), (3, 4), (7, 3), (7, 3)]
    assert ubatch_bounds(0, 5, 4, 512) == (0, 5)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(EngineError) as ei:
            new_sched(ScriptModel(context_script), n_ubatch=bad)
        assert ei.value.code == "invalid_params" and "n_ubatch" in ei.value.message


def run_joined(model: ScriptModel, sched: Scheduler, joins: dict[int, list[tuple[str, list[int], SamplingParams]]]
               ) -> tuple[dict[str, GenerationResult], list[list[tuple[str, int, int, int, int]]]]:
    """Run ``joins`` (step -> requests added before it) to the end; the results and, per forward
    call, its segments as (request id, pos0, n, micro-batch rows, row in it)."""
    results: dict[str, GenerationResult] = {}
    log: list[list[tuple[str, int, int, int, int]]] = []
    prev: dict[int, str] = {}
    step = 0
    while step <= max(joins) or sched.has_work:
        for rid, prompt, p in joins.get(step, []):
            sched.add(SeqRequest(rid, prompt, p))
        n_calls = len(model.segments)
        for f in sched.step():
            assert f.error is None and f.result is not None, f.error
            results[f.id] = f.result
        now = {id(s.entry): rid for rid, s in sched._by_id.items() if s.entry is not None}  # noqa: SLF001
        owners = {**prev, **now}
        log += [[(owners[e], pos0, n, ub, row) for e, pos0, n, ub, row in call] for call in model.segments[n_calls:]]
        prev = now
        step += 1
        assert step < 500
    return results, log


def ubatches(log: list[list[tuple[str, int, int, int, int]]], rid: str, n_prompt: int) -> list[tuple[int, int]]:
    """The micro-batches (first position, rows) request ``rid``'s prompt rows were computed as,
    checking that its prompt positions were each fed once, in order."""
    seen: list[tuple[int, int]] = []
    pos = None
    for call in log:
        for r, pos0, n, ub, row in call:
            if r != rid or pos0 >= n_prompt:
                continue
            assert pos is None or pos0 == pos, f"{rid}: prompt rows out of order at {pos0}"
            pos = pos0 + n
            if not seen or seen[-1] != (pos0 - row, ub):
                seen.append((pos0 - row, ub))
    assert pos == n_prompt
    return seen


def test_prompt_micro_batches_do_not_depend_on_the_other_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "DECODE_PREFILL_CHUNK", 3)
    target = chars("the quick brown fox jumps")                     # 25 tokens: micro-batches 4 x 6 + 1
    others = {"a": chars("hello world, again"), "b": chars("abcdefghi"), "c": chars("zyxwvutsrqponmlkjihgfedcba0123")}
    p = params(max_tokens=6, ignore_eos=True)
    expected = [(k, min(4, len(target) - k)) for k in range(0, len(target), 4)]

    def fresh() -> tuple[ScriptModel, Scheduler]:
        model = ScriptModel(context_script)
        return model, new_sched(model, n_parallel=4, n_batch=10, n_ubatch=4)

    model, sched = fresh()
    alone, log = run_joined(model, sched, {0: [("t", target, p)]})
    assert ubatches(log, "t", len(target)) == expected
    assert any(sum(1 for r, *_ in call if r == "t") > 1 for call in log)  # several micro-batches in one pass

    for joins in ({0: [("a", others["a"], p), ("b", others["b"], p)], 2: [("t", target, p)], 3: [("c", others["c"], p)]},
                  {0: [("c", others["c"], p), ("t", target, p)], 1: [("a", others["a"], p)]},
                  {0: [("b", others["b"], p)], 5: [("t", target, p), ("a", others["a"], p)]}):
        model, sched = fresh()
        got, log = run_joined(model, sched, joins)
        assert ubatches(log, "t", len(target)) == expected
        for rid, prompt in [("t", target)] + [(r, others[r]) for r in "abc" if r in got]:
            assert ubatches(log, rid, len(prompt)) == [(k, min(4, len(prompt) - k)) for k in range(0, len(prompt), 4)]
        assert got["t"].text == alone["t"].text and got["t"].tokens == alone["t"].tokens
        n_prompt = {"t": len(target), **{r: len(q) for r, q in others.items()}}
        fills = [[(r, pos0, n) for r, pos0, n, *_ in call if pos0 < n_prompt[r]] for call in log]
        span = {r: [i for i, f in enumerate(fills) if any(q == r for q, *_ in f)] for r in got}
        for i, (call, fill) in enumerate(zip(log, fills)):
            decoding = any(pos0 >= n_prompt[r] for r, pos0, *_ in call)
            assert sum(n for *_, n in fill) <= (3 if decoding else 10)  # the step's budget
            if any(ix[0] <= i <= ix[-1] for ix in span.values()):      # a prompt in progress always advances
                assert fill, f"call {i}: no prompt token while a prompt was half done"
            order = list(dict.fromkeys(r for r, *_ in fill))
            for r in order[:-1]:  # first come first served: only the last one may stop short
                assert max(pos0 + n for q, pos0, n in fill if q == r) == n_prompt[r], f"{r} stopped short"
        shared = [{r for r, *_ in call} for call in log if any(r == "t" for r, *_ in call)]
        assert any(len(rs) >= 2 for rs in shared)  # the target shared passes


def test_micro_batches_start_at_the_reused_prefix() -> None:
    model = ScriptModel(context_script)
    sched = new_sched(model, n_batch=10, n_ubatch=4)
    first = chars("abcdefghijk")                                     # 11 tokens
    run_joined(model, sched, {0: [("x", first, params(max_tokens=3, ignore_eos=True))]})
    longer = first + chars("lmnopqrstu")                             # extends the cached 11 (+ 2 replies fed)
    model.segments.clear()
    res, log = run_joined(model, sched, {0: [("y", longer, params(max_tokens=2, ignore_eos=True))]})
    assert res["y"].cache_n == len(first)
    n_keep = len(first)
    assert ubatches(log, "y", len(longer)) == [(k, min(4, len(longer) - k)) for k in range(n_keep, len(longer), 4)]
    assert res["y"].text == run(ScriptModel(context_script), longer, max_tokens=2, ignore_eos=True)[0].text
