"""Prefix reuse on sliding-window models follows llama-server's checkpoint rule.

llama-server (``tools/server/server-context.cpp``) evaluates the last 4 tokens of a prompt of a
sliding-window model (and the ``n_ubatch`` before them) as batches of their own, keeps a context
checkpoint before each, and on a later prompt sharing a prefix restores the newest usable
checkpoint and re-evaluates from one token before it — or the whole prompt when none is usable
(``worker.engine.prefix``: ``prompt_cuts`` / ``PrefixCache.swa_reuse``). These tests check the cutting, the reuse
points and, on Gemma 3 270M with quantized weights, the tokens and logprobs against what
llama-server answered to the same requests in the same order
(``tests/fixtures/gemma3-swa-reuse.llamacpp.json``, ``scripts/record_swa_reuse_llamacpp.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.paths import FIXTURES_DIR
from worker.engine import Engine, SamplingParams
from worker.engine.prefix import prompt_cuts
from worker.engine.scheduler import ubatch_bounds

SWA_FIXTURE = FIXTURES_DIR / "gemma3-swa-reuse.llamacpp.json"


def greedy(n: int, cache: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n_probs=1, cache_prompt=cache)


def test_prompt_cuts_end_batches_4_and_4_plus_n_ubatch_before_the_end() -> None:
    assert prompt_cuts(0, 10, 512, 0) == ()                  # no sliding window: no cuts
    assert prompt_cuts(0, 10, 512, 512) == (6,)
    assert prompt_cuts(0, 600, 512, 512) == (84, 596)
    assert prompt_cuts(84, 600, 512, 512) == (596,)          # a cut must lie past the kept prefix
    assert prompt_cuts(596, 600, 512, 512) == ()
    assert prompt_cuts(0, 4, 512, 512) == ()
    cuts = prompt_cuts(0, 23, 8, 64)                          # (11, 19)
    assert [ubatch_bounds(0, 23, at, 8, cuts) for at in (0, 7, 8, 10, 11, 18, 19, 22)] == \
        [(0, 8), (0, 8), (8, 3), (8, 3), (11, 8), (11, 8), (19, 4), (19, 4)]
    cuts = prompt_cuts(18, 23, 8, 64)                         # a repeat from 18: (19,)
    assert [ubatch_bounds(18, 23, at, 8, cuts) for at in (18, 19, 22)] == [(18, 1), (19, 4), (19, 4)]


def _spy(eng: Engine) -> list[list[tuple[int, int]]]:
    """Record every forward pass's prompt micro-batches as ``(first position, rows)``."""
    model = eng._sched.model
    passes: list[list[tuple[int, int]]] = []
    inner = model.forward_batch

    def forward_batch(tokens: Any, batch: Any, rows: Any) -> Any:
        passes.append([(s.pos0 - s.ubatch_row, s.ub_rows) for s in batch.segments])
        return inner(tokens, batch, rows)

    model.forward_batch = forward_batch  # type: ignore[method-assign]
    return passes


def _prompt_ubatches(passes: list[list[tuple[int, int]]], n_prompt: int) -> list[tuple[int, int]]:
    """The prompt's micro-batches, in order (decode rows sit at positions >= n_prompt)."""
    return list(dict.fromkeys(u for p in passes for u in p if u[0] < n_prompt))


@pytest.fixture(scope="module")
def tiny_swa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.worker.tiny_gguf import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("swa") / "g.gguf", qtype="Q8_0", n_ctx_train=1024,
                             sliding_window=64)


def test_tiny_swa_model_cuts_checkpoints_and_reuse_points(tiny_swa: Path) -> None:
    eng = Engine.load(str(tiny_swa), n_ctx=512, parallel=1, weights="quantized", n_ubatch=8)
    rng = np.random.default_rng(3)
    a = [1] + rng.integers(4, 440, 22).tolist()                       # 23 tokens
    passes = _spy(eng)
    r = eng.generate(a, greedy(3, cache=False))
    assert _prompt_ubatches(passes, 23) == [(0, 8), (8, 3), (11, 8), (19, 4)]          # cuts at 23 - 12 and 23 - 4
    assert r.cache_n == 0 and r.prompt_n == 23
    # the repeat restores the checkpoint at 19 tokens and re-evaluates from 18 (llama-server: prompt_n 5)
    passes.clear()
    r2 = eng.generate(a, greedy(3))
    assert (r2.cache_n, r2.prompt_n) == (18, 5)
    assert _prompt_ubatches(passes, 23) == [(18, 1), (19, 4)]
    assert r2.tokens == r.tokens
    # a prompt sharing 10 tokens: the checkpoint at 11 (pos_max 10) is the newest usable one
    b = a[:10] + rng.integers(4, 440, 9).tolist()
    rb = eng.generate(b, greedy(2))
    assert (rb.cache_n, rb.prompt_n) == (10, 9)
    # b's evaluation from 10 checkpointed at 10 tokens (pos_max 9): a prompt sharing 9 tokens uses it
    c = a[:9] + [5, 6, 7]
    rc = eng.generate(c, greedy(2))
    assert (rc.cache_n, rc.prompt_n) == (9, 3)
    # (and c's, from 9, at 9 tokens: pos_max 8); sharing 7 tokens: no checkpoint lies within
    # them -> the whole prompt again
    d = a[:7] + [5, 6, 7]
    rd = eng.generate(d, greedy(2))
    assert (rd.cache_n, rd.prompt_n) == (0, 10)
    # longer than the window + 1: the sliding-window cache holds every needed key, so llama-server
    # keeps the whole shared prefix and re-evaluates the last token only
    long = [1] + rng.integers(4, 440, 99).tolist()                   # 100 tokens, cuts at 88 and 96
    passes.clear()
    eng.generate(long, greedy(2, cache=False))
    assert _prompt_ubatches(passes, 100) == [(8 * i, 8) for i in range(11)] + [(88, 8), (96, 4)]
    rl = eng.generate(long, greedy(2))
    assert (rl.cache_n, rl.prompt_n) == (99, 1)
    # ... unless its history outgrew llama.cpp's sliding-window cache (256 cells here): then the
    # oldest keys are gone there, and the checkpoint before the last 4 tokens is restored
    eng.reset_cache()
    eng.generate(long, greedy(200, cache=False))                      # 100 + 199 positions held
    rw = eng.generate(long, greedy(2))
    assert (rw.cache_n, rw.prompt_n) == (95, 5)


def test_tiny_model_without_window_keeps_the_old_rule(tmp_path: Path) -> None:
    from tests.worker.tiny_gguf import write_tiny_gemma3

    path = write_tiny_gemma3(tmp_path / "g0.gguf", qtype="Q8_0", n_ctx_train=1024, sliding_window=0)
    eng = Engine.load(str(path), n_ctx=256, parallel=1, weights="quantized", n_ubatch=8)
    assert eng._sched.n_swa == 0
    a = [1] + np.random.default_rng(4).integers(4, 440, 22).tolist()
    passes = _spy(eng)
    eng.generate(a, greedy(2, cache=False))
    assert _prompt_ubatches(passes, 23) == [(0, 8), (8, 8), (16, 7)]
    r = eng.generate(a, greedy(2))
    assert (r.cache_n, r.prompt_n) == (22, 1)
    b = a[:5] + [7, 8, 9]
    rb = eng.generate(b, greedy(2))
    assert (rb.cache_n, rb.prompt_n) == (5, 3)


@pytest.fixture(scope="module")
def gemma_one_slot(gemma3_path: Path) -> Engine:
    return Engine.load(str(gemma3_path), n_ctx=2048, parallel=1)


def _run(eng: Engine, ids: list[int], n: int, cache: bool, n_probs: int = 1) -> tuple[list[int], list[float], Any, list]:
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n_probs=n_probs, cache_prompt=cache)

    def on(e: Any) -> None:
        lps.append(e.logprob)
        tops.append(list(e.top_logprobs))

    res = eng.generate(ids, p, on_token=on)
    return res.tokens, lps, res, tops


def test_gemma_repeat_gives_the_fresh_answer(gemma_one_slot: Engine) -> None:
    eng = gemma_one_slot
    eng.reset_cache()
    ids = eng.tokenize("Item 2: the colour of the sky is")
    fresh = _run(eng, ids, 5, False)
    assert eng.detokenize(fresh[0]) == " blue.\n\nItem "       # llama-server's answer, fresh and repeated
    for _ in range(2):
        again = _run(eng, ids, 5, True)
        assert again[2].cache_n == len(ids) - 5 and again[2].prompt_n == 5
        assert again[0] == fresh[0] and again[1] == fresh[1]   # == : the same bits
    # a prompt extending it reuses up to the checkpoint (4 + 1 tokens before the first one's end);
    # its tokens are its fresh run's, its logprobs not (its tokens 6.. form a micro-batch of their
    # own), in llama-server too: the fixture's short0-extended / short0-extended-fresh
    ext = eng.tokenize("Item 2: the colour of the sky is blue. Item 3: the colour of grass is")
    shared = _run(eng, ext, 5, True)
    assert (shared[2].cache_n, shared[2].prompt_n) == (len(ids) - 5, len(ext) - len(ids) + 5)
    eng.reset_cache()
    alone = _run(eng, ext, 5, False)
    assert shared[0] == alone[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 26 requests, one of them 520 tokens long: ~2-4 minutes on 2 busy cores
def test_gemma_matches_llama_server_request_by_request(gemma_one_slot: Engine) -> None:
    """Each request of the fixture, in order, on one slot: the same reuse (``cache_n``,
    ``prompt_n``), the same tokens, and the same logits: the gap between the top two logprobs of
    every step (a difference of two float32 logits) within 1e-5. llama-server's logprobs
    themselves carry its float32 normalisation over 262,144 tokens (up to ~5e-4 here), so they
    are compared within 2e-3. Requests whose history passed llama.cpp's 1,024-cell
    sliding-window cache are compared on reuse and tokens only: once that cache wraps around,
    llama.cpp's sliding-window layers visit their keys in cell order, not position order, which
    rounds differently (a gap of its own, not of prefix reuse)."""
    data = json.loads(SWA_FIXTURE.read_text())
    eng = gemma_one_slot
    eng.reset_cache()
    worst_gap = worst_lp = 0.0
    compared = 0
    wrapped = False
    for r in data["requests"]:
        toks, lps, res, tops = _run(eng, list(r["prompt_ids"]), int(r["n_predict"]), bool(r["cache_prompt"]), 2)
        name = r["name"]
        assert (res.cache_n, res.prompt_n) == (r["cache_n"], r["prompt_n"]), name
        assert toks == r["tokens"], f"{name}: {eng.detokenize(toks)!r} != llama-server's {r['text']!r}"
        wrapped = wrapped or len(r["prompt_ids"]) + int(r["n_predict"]) > 1024
        if wrapped:
            continue
        for ours, theirs in zip(tops, r["top2"]):
            assert [t for t, _ in ours[:2]] == [t for t, _ in theirs], name
            gap = abs((ours[0][1] - ours[1][1]) - (theirs[0][1] - theirs[1][1]))
            worst_gap = max(worst_gap, gap)
        worst_lp = max(worst_lp, float(np.max(np.abs(np.array(lps) - np.array(r["logprobs"])))))
        compared += 1
    print(f"\n{compared} requests compared: max |d(top1 - top2 logprob)| {worst_gap:.2e}, "
          f"max |dlogprob| {worst_lp:.2e}")
    assert compared >= 22
    assert worst_gap <= 1e-5
    assert worst_lp <= 2e-3
