"""The worker state machine's transition table (router/process.py) as documented."""

from __future__ import annotations

from router.process import TRANSITIONS, WorkerState as S


def test_every_state_has_its_documented_exits() -> None:
    assert TRANSITIONS == {
        S.UNLOADED: {S.LOADING},
        S.LOADING: {S.READY, S.FAILED, S.UNLOADED},
        S.READY: {S.DRAINING, S.FAILED},
        S.DRAINING: {S.UNLOADED},
        S.FAILED: {S.LOADING, S.UNLOADED},
    }


def test_failed_is_not_unloaded_and_every_state_is_reachable() -> None:
    assert S.FAILED != S.UNLOADED
    reachable = {S.UNLOADED}
    frontier = [S.UNLOADED]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in reachable:
                reachable.add(nxt)
                frontier.append(nxt)
    assert reachable == set(S)
