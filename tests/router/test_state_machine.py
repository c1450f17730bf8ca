"""The worker state machine's transition table (router/workers/lifecycle.py) as documented."""

from __future__ import annotations

from router.workers.lifecycle import TRANSITIONS, WorkerState as S


def test_every_state_has_its_documented_exits() -> None:
    assert TRANSITIONS == {
        S.UNLOADED: {S.LOADING},
        S.LOADING: {S.READY, S.FAILED, S.UNLOADED},
        S.READY: {S.DRAINING, S.FAILED, S.UNRESPONSIVE},
        S.UNRESPONSIVE: {S.READY, S.FAILED, S.DRAINING},
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


def test_only_a_slot_writes_its_state() -> None:
    """ModelSlot's methods alone write a slot's scheduling state, in every module of the router
    (its subpackages too): no other module reaches into a slot's private attributes or another
    object's queue / lifecycle, a worker's state is assigned only by Lifecycle.move (a request
    record's only by the record), and nothing imports a private name of another router module."""
    import re
    from pathlib import Path

    router = Path(__file__).resolve().parents[2] / "router"
    # a private attribute reached through another object than ``self``, and who may do it
    owners = {r"\bslot\._[a-z]": set(), r"(?<!self)\._(running|waiting|fail_waiting|set_state|life)\b": set(),
              r"\bself\._(running|waiting)\b": {"workers/admission.py"},
              r"\bself\._life\b": {"workers/slot.py", "workers/views.py"},
              r"\.state\s*=[^=]": {"workers/lifecycle.py", "serving/record.py"}}
    scanned = 0
    for path in router.rglob("*.py"):
        text, rel = path.read_text(), path.relative_to(router).as_posix()
        scanned += 1
        for pattern, allowed in owners.items():
            assert rel in allowed or not re.search(pattern, text), (rel, pattern)
        assert not re.search(r"^from router\.[\w.]+ import .*\b_[a-z]\w*", text, re.M), rel
    assert scanned > 60  # the subpackages were walked


def test_only_the_slot_and_its_parts_move_the_state() -> None:
    """A model's state machine is made by its ModelSlot alone and moved only through the slot's
    ``move``, called by the slot and the parts it makes (router/workers/loading.py, unloading.py)."""
    import re
    from pathlib import Path

    router = Path(__file__).resolve().parents[2] / "router"
    movers, makers, lifecycle_moves = set(), set(), set()
    for path in router.rglob("*.py"):
        text = path.read_text()
        if re.search(r"\.move\(WorkerState\.", text):
            movers.add(path.name)
        if re.search(r"\bLifecycle\(", text):
            makers.add(path.name)
        if re.search(r"\._life\.move\(", text):
            lifecycle_moves.add(path.name)
    assert movers == {"slot.py", "loading.py", "unloading.py"}, movers
    assert makers == {"slot.py"} and lifecycle_moves == {"slot.py"}, (makers, lifecycle_moves)
