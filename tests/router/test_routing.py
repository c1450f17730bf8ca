"""The replica routing policy (``router.serving.routing.choose``) and a replica's prefix index
(``router.workers.prefix_index``), fed KvEvents frames as a worker sends them: pure, no worker."""

from __future__ import annotations

import time

from protocol import decode, encode
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvents, block_hashes, encode_batch
from router.serving.routing import CACHE_FRACTION, choose, imbalance_threshold
from router.workers.prefix_index import PrefixIndex


def frame(seq: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> KvEvents:
    """A KvEvents frame through the real codec, as the router receives it."""
    msg = decode(encode(KvEvents(id="w", seq=seq, payload=encode_batch(time.time(), list(events)))))
    assert isinstance(msg, KvEvents)
    return msg


def stored(tokens: list[int], size: int = 4, parent: int | None = None) -> BlockStored:
    hashes = block_hashes(tokens, size, parent)
    return BlockStored(hashes, parent, tokens[:len(hashes) * size], size)


# ----------------------------------------------------------------------------- the policy


def test_cache_aware_sends_a_prompt_to_the_replica_holding_its_longest_prefix() -> None:
    assert choose([3, 0], [8, 0], 10, policy="cache_aware", threshold=4)[0] == 0  # its cache, though busier


def test_cache_aware_goes_to_the_least_loaded_when_the_load_is_imbalanced() -> None:
    assert choose([9, 0], [10, 0], 10, policy="cache_aware", threshold=4) == [1, 0]


def test_cache_aware_goes_to_the_least_loaded_below_the_cache_fraction() -> None:
    small = int(CACHE_FRACTION * 10) - 1
    assert choose([1, 0], [small, 0], 10, policy="cache_aware", threshold=4) == [1, 0]
    assert choose([1, 0], [0, 0], 0, policy="cache_aware", threshold=4) == [1, 0]  # too short to match


def test_cache_aware_ties_go_to_the_less_loaded_then_the_lower_replica() -> None:
    assert choose([2, 1, 1], [5, 5, 5], 10, policy="cache_aware", threshold=4)[0] == 1
    assert choose([0, 0], [0, 0], 0, policy="least_loaded", threshold=4) == [0, 1]


def test_round_robin_and_least_loaded_ignore_the_cache() -> None:
    assert [choose([0, 0, 0], [9, 0, 0], 10, policy="round_robin", threshold=4, turn=t)[0] for t in range(4)] \
        == [0, 1, 2, 0]
    assert choose([5, 1, 3], [9, 0, 0], 10, policy="least_loaded", threshold=4) == [1, 2, 0]


def test_imbalance_threshold_is_the_models_parallel_at_least_two() -> None:
    assert imbalance_threshold(1) == 2 and imbalance_threshold(4) == 4


# ----------------------------------------------------------------------------- the index


def test_index_matches_the_leading_blocks_its_worker_stored() -> None:
    idx = PrefixIndex(block_size=4)
    conv = list(range(100, 120))  # 5 blocks
    idx.feed(frame(0, stored(conv)))
    assert len(idx) == 5
    longer = conv + [7, 8, 9, 10, 11]
    assert idx.match(block_hashes(longer, 4)) == 5
    other = [1] + conv[1:]  # differs in its first token: no block matches (chained hashes)
    assert idx.match(block_hashes(other, 4)) == 0


def test_index_follows_a_chain_across_events_and_drops_removed_blocks() -> None:
    idx = PrefixIndex(block_size=4)
    first = list(range(8))
    h = block_hashes(first, 4)
    idx.feed(frame(0, stored(first)))
    idx.feed(frame(1, stored(list(range(8, 16)), parent=h[-1])))  # the sequence grew by two blocks
    whole = block_hashes(list(range(16)), 4)
    assert idx.match(whole) == 4
    idx.feed(frame(2, BlockRemoved(whole[2:3])))
    assert idx.match(whole) == 2
    idx.feed(frame(3, AllBlocksCleared()))
    assert len(idx) == 0 and idx.match(whole) == 0


def test_a_seq_gap_means_lost_events_and_empties_the_index() -> None:
    idx = PrefixIndex(block_size=4)
    idx.feed(frame(0, stored(list(range(8)))))
    idx.feed(frame(2, stored(list(range(50, 54)))))  # frame 1 was lost
    assert idx.cleared == 1 and len(idx) == 1  # only what came after the gap
    idx.feed(frame(3, stored(list(range(60, 64)))))
    assert idx.cleared == 1 and len(idx) == 2


def test_router_inserts_count_and_the_index_stays_bounded() -> None:
    idx = PrefixIndex(block_size=4, max_blocks=6)
    a = block_hashes(list(range(16)), 4)
    idx.insert(a)
    b = block_hashes(list(range(100, 116)), 4)
    idx.insert(b)
    assert len(idx) == 6  # the oldest blocks went first
    assert idx.match(b) == 4 and idx.match(a) == 0


def test_the_events_block_size_wins() -> None:
    idx = PrefixIndex(block_size=16)
    idx.insert(block_hashes(list(range(32)), 16))
    idx.feed(frame(0, stored(list(range(8)), size=4)))
    assert idx.block_size == 4 and len(idx) == 2
    idx.clear()
    assert len(idx) == 0
