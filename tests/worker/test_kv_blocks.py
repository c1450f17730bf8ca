"""The engine's KV events (worker.engine.kv.blocks): blocks counted per entry holding them, stored
when first held, removed when no entry holds them, cleared when the pool empties; and an engine
with events on computes exactly what it computes with them off."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes
from worker.engine import Engine
from worker.engine.kv.blocks import KVBlockLog
from worker.engine.kv.cache import KVPool, KVShape
from worker.engine.sampling import SamplingParams
from tests.worker.tiny_gguf import write_tiny_llama

BS = 4


def stored(tokens: list[int], lo: int, hi: int, parent: int | None) -> BlockStored:
    """The BlockStored of blocks ``lo .. hi-1`` of ``tokens``."""
    hs = block_hashes(tokens[:hi * BS], BS)[lo:]
    return BlockStored(hs, parent, tokens[lo * BS:hi * BS], BS)


def test_shared_prefix_is_one_block_held_twice_and_freeing_one_removes_only_its_own() -> None:
    pool = KVPool(KVShape(1, 1, 4, 4), 4096)
    log = KVBlockLog(BS)
    assert log.collect(pool.entries) == [AllBlocksCleared()]  # the first batch after a load
    assert log.collect(pool.entries) == []
    a = pool.new(64)
    ta = list(range(100, 110))  # 2 full blocks and a tail of 2
    a.tokens.extend(ta)
    ha = block_hashes(ta, BS)
    assert log.collect(pool.entries) == [stored(ta, 0, 2, None)]
    a.tokens.extend([110, 111, 112])  # block 2 completes; 13 tokens
    ta = list(a.tokens)
    ha = block_hashes(ta, BS)
    assert log.collect(pool.entries) == [stored(ta, 2, 3, ha[1])]
    b = pool.new(64)  # a copy of a's first 9 tokens, then its own
    tb = ta[:9] + [7] * 7
    b.tokens.extend(tb)
    hb = block_hashes(tb, BS)
    assert hb[:2] == ha[:2] and hb[2] != ha[2]
    assert log.collect(pool.entries) == [stored(tb, 2, 4, hb[1])]  # the shared blocks were held already
    assert log.refs[ha[0]] == 2 and log.refs[ha[1]] == 2
    pool.drop(b)  # freed: only the blocks a does not hold leave
    assert log.collect(pool.entries) == [BlockRemoved(hb[2:])]
    assert log.refs == {h: 1 for h in ha}


def test_truncation_removes_the_tail_blocks_and_a_re_evaluated_equal_prefix_makes_no_event() -> None:
    pool = KVPool(KVShape(1, 1, 4, 4), 4096)
    log = KVBlockLog(BS)
    a = pool.new(64)
    ta = list(range(1, 18))  # 4 full blocks + 1
    a.tokens.extend(ta)
    ha = block_hashes(ta, BS)
    log.collect(pool.entries)
    a.truncate(6)  # a checkpoint restore / a taken-over entry cut back: blocks 1.. go
    assert log.collect(pool.entries) == [BlockRemoved(ha[1:])]
    a.truncate(2)
    a.tokens.extend(ta[2:6])  # cut, then the same tokens again before anyone looked
    assert log.collect(pool.entries) == []
    a.truncate(3)
    a.tokens.extend([50, 51, 52, 53, 54])  # cut inside block 0 and grown with other tokens
    t2 = ta[:3] + [50, 51, 52, 53, 54]
    h2 = block_hashes(t2, BS)
    assert log.collect(pool.entries) == [stored(t2, 0, 2, None), BlockRemoved([ha[0]])]
    assert set(log.refs) == set(h2)


def test_the_pool_emptied_is_all_blocks_cleared_and_entries_moved_keep_their_blocks() -> None:
    pool = KVPool(KVShape(1, 1, 4, 4), 4096)
    log = KVBlockLog(BS)
    log.collect(pool.entries)
    a, b = pool.new(32), pool.new(32)
    a.tokens.extend(range(8))
    b.tokens.extend(range(20, 30))
    log.collect(pool.entries)
    c = pool.new(32)  # a slot restore: the same state installed, the old entry dropped
    c.tokens.extend(range(8))
    pool.drop(a)
    assert log.collect(pool.entries) == []
    pool.drop(b)
    pool.drop(c)  # erase all
    assert log.collect(pool.entries) == [AllBlocksCleared()]
    assert log.refs == {}
    with pytest.raises(ValueError):
        KVBlockLog(0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("g") / "tiny.gguf", n_ctx_train=512)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n_probs=2)


def run_two(eng: Engine, a: list[int], b: list[int]) -> dict[str, list[tuple[int, float]]]:
    """Run ``a`` and ``b`` together; each one's (token, logprob) list."""
    out: dict[str, list[tuple[int, float]]] = {"a": [], "b": []}
    for sid, ids in (("a", a), ("b", b)):
        eng.add(sid, ids, greedy(6), lambda ev, sid=sid: out[sid].append((ev.id, ev.logprob)) or True)
    while eng.has_work:
        eng.step()
    return out


def test_engine_events_follow_its_entries_and_change_nothing_it_computes(tiny: Path) -> None:
    off = Engine.load(str(tiny), n_ctx=256, parallel=2, weights="f32")
    on = Engine.load(str(tiny), n_ctx=256, parallel=2, weights="f32")
    on.enable_kv_events(16)
    assert off.take_kv_events() == []  # off: nothing, ever
    assert on.take_kv_events() == [AllBlocksCleared()]
    shared = list(range(10, 50))
    a, b = shared + list(range(60, 70)), shared + list(range(80, 95))
    assert run_two(off, a, b) == run_two(on, a, b)  # events never alter what the engine computes
    events = on.take_kv_events()
    want: set[int] = set()
    for e in on._sched.pool.entries:  # the entries the events describe
        want |= set(block_hashes(e.tokens, 16))
    got = [h for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))  # each block stored once
    for ev in events:
        assert isinstance(ev, BlockStored)
        toks = ev.token_ids
        assert ev.block_hashes == block_hashes(toks, 16, ev.parent_block_hash)
    on.reset_cache()
    assert on.take_kv_events() == [AllBlocksCleared()]


def test_a_state_restored_from_outside_enters_the_cache_and_an_erase_clears_it(tiny: Path) -> None:
    eng = Engine.load(str(tiny), n_ctx=256, parallel=1, weights="f32")
    eng.enable_kv_events(16)
    assert eng.take_kv_events() == [AllBlocksCleared()]
    eng.generate(list(range(10, 60)), greedy(3))  # 50 prompt tokens + 2 fed back: 3 full blocks
    state = eng.save_slot(0)
    toks = list(state.tokens)
    assert eng.take_kv_events() == [BlockStored(block_hashes(toks, 16), None, toks[:48], 16)]
    assert eng.erase_slot(0) == len(toks)
    assert eng.take_kv_events() == [AllBlocksCleared()]
    eng.restore_slot(state, 0)  # a slot restore, a KV stream, the disk cache: the same path
    assert eng.take_kv_events() == [BlockStored(block_hashes(toks, 16), None, toks[:48], 16)]
