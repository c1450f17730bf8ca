"""The thread governor (worker/engine/kernels/threadctl.py) on synthetic pass times: a fake clock and
made-up durations, so nothing here depends on this machine's speed or load."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.kernels import threadctl
from worker.engine.kernels.threadctl import ThreadGovernor, candidates


@pytest.fixture(autouse=True)
def _quiet_loadavg(monkeypatch: pytest.MonkeyPatch) -> None:
    # the governor's first guess reads the load average: this machine's must not matter here
    monkeypatch.setattr(threadctl, "busy_machine", lambda ceiling: False)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(g: ThreadGovernor, clock: Clock, cost: dict[int, float], passes: int, rows: int = 1,
        ceiling: int = 2) -> list[int]:
    """``passes`` passes where a pass on n threads takes ``cost[n]`` seconds; the counts chosen."""
    chosen = []
    for _ in range(passes):
        n = g.choose(ceiling, rows)
        assert 1 <= n <= ceiling
        clock.t += cost[n]
        g.record(ceiling, rows, n, cost[n])
        chosen.append(n)
    return chosen


def test_candidates() -> None:
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(3) == [1, 2, 3]
    assert candidates(8) == [1, 2, 4, 8]


def test_quiet_machine_keeps_the_ceiling_and_probes_rarely() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    chosen = run(g, clock, {1: 0.010, 2: 0.006}, 3000)     # two threads faster: 18 s of decode
    assert chosen[0] == 2
    assert chosen.count(1) <= 12                            # probes back off to one per 8 s
    assert g.state() == {1: 2}
    assert chosen[-100:].count(2) >= 99


def test_busy_machine_moves_to_one_thread_at_once_and_stays() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.010, 2: 0.006}, 200)                # quiet: both measured
    chosen = run(g, clock, {1: 0.019, 2: 0.110}, 400)       # two busy processes arrive
    assert chosen[:3] == [2, 2, 2] and chosen[3] == 1       # three slow passes, then one thread
    assert g.state() == {1: 1}
    slow = chosen[3:].count(2)
    assert slow <= 6                                        # a few probes of two threads, backing off
    total = sum(0.110 if n == 2 else 0.019 for n in chosen[3:])
    assert total <= 1.25 * 0.019 * len(chosen[3:])         # within 25 % of one thread throughout


def test_load_that_leaves_is_noticed_by_a_probe() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.019, 2: 0.110}, 300)
    assert g.state() == {1: 1}
    chosen = run(g, clock, {1: 0.010, 2: 0.006}, 2000)      # quiet again: back within one interval
    first2 = chosen.index(2)
    assert clock.t >= 0 and first2 * 0.010 <= threadctl.MAX_INTERVAL_S + 0.1
    assert g.state() == {1: 2}
    assert chosen[-50:] == [2] * 50


def test_one_outlier_does_not_switch() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.010, 2: 0.006}, 200)
    run(g, clock, {1: 0.010, 2: 0.050}, 1)                  # one preempted pass
    chosen = run(g, clock, {1: 0.010, 2: 0.006}, 20)
    assert chosen.count(1) <= 2 and g.state() == {1: 2}


def test_groups_by_rows_choose_separately() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    for _ in range(300):                                    # decode gains nothing from threads, prefill does
        for rows, cost in ((1, {1: 0.010, 2: 0.012}), (512, {1: 1.0, 2: 0.55})):
            n = g.choose(2, rows)
            clock.t += cost[n]
            g.record(2, rows, n, cost[n])
    assert g.state() == {1: 1, 10: 2}


def test_long_passes_are_probed_within_their_share() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    chosen = run(g, clock, {1: 2.0, 2: 1.0}, 200, rows=512)
    probes = chosen.count(1)
    assert probes * 2.0 <= threadctl.PROBE_SHARE * clock.t * 1.5 + 2.0


def test_ceiling_one_and_switched_off() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    assert run(g, clock, {1: 0.01}, 10, ceiling=1) == [1] * 10
    g = ThreadGovernor(clock, adaptive=False)
    assert run(g, clock, {1: 0.001, 2: 0.1}, 50) == [2] * 50


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(threadctl.ENV, "0")
    assert not ThreadGovernor().adaptive
    monkeypatch.setenv(threadctl.ENV, "1")
    assert ThreadGovernor().adaptive


def test_a_new_share_starts_over() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.019, 2: 0.110}, 50)
    assert g.state() == {1: 1}
    assert run(g, clock, {1: 0.019, 2: 0.110, 3: 0.2}, 1, ceiling=3) == [3]


@pytest.mark.parametrize("seed", range(3))
def test_noisy_quiet_machine_stays_near_the_best(seed: int) -> None:
    # pass times with 20 % jitter and an occasional 5x outlier: the chosen counts' total time
    # stays within 10 % of always running the faster count
    rng = np.random.default_rng(seed)
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    total = best = 0.0
    for _ in range(3000):
        n = g.choose(2, 1)
        base = {1: 0.010, 2: 0.006}
        f = float(rng.uniform(0.9, 1.1)) * (5.0 if rng.random() < 0.01 else 1.0)
        clock.t += base[n] * f
        total += base[n] * f
        best += base[2] * f
        g.record(2, 1, n, base[n] * f)
    assert total <= best * 1.10


def test_prefill_under_new_load_learns_from_the_decode_group() -> None:
    # long prefill passes (1 s) are probed rarely on their own; when load arrives and the decode
    # group switches to one thread, the prefill group probes at its next pass
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)

    def step(rows: int, cost: dict[int, float]) -> int:
        n = g.choose(2, rows)
        clock.t += cost[n]
        g.record(2, rows, n, cost[n])
        return n

    for _ in range(5):
        step(512, {1: 1.0, 2: 0.55})
        for _ in range(50):
            step(1, {1: 0.010, 2: 0.006})
    busy_pre, busy_dec = {1: 1.6, 2: 5.0}, {1: 0.019, 2: 0.110}
    for _ in range(20):
        step(1, busy_dec)
    assert g.state()[1] == 1
    chosen = [step(512, busy_pre) for _ in range(6)]
    assert chosen.count(1) >= 4 and g.state()[10] == 1


def test_a_slower_current_count_probes_without_waiting() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    chosen = run(g, clock, {1: 1.0, 2: 0.55}, 30, rows=512)   # quiet prefill: probes ~every 18 s
    assert chosen.count(1) <= 2
    chosen = run(g, clock, {1: 1.6, 2: 5.0}, 8, rows=512)     # load: no other count known recently
    assert chosen[-3:] == [1, 1, 1]


def test_a_busy_start_finds_one_thread_after_one_slow_pass() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    chosen = run(g, clock, {1: 0.019, 2: 0.110}, 20)
    assert chosen[:2] == [2, 1] and chosen[2:] == [1] * 18


def test_first_probe_of_long_passes_waits() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    assert run(g, clock, {1: 1.0, 2: 0.55}, 3, rows=512) == [2, 2, 2]


@pytest.mark.parametrize("seed", range(3))
def test_heavy_collapse_with_jitter_costs_little(seed: int) -> None:
    # two threads 30x slower than one, one thread's times jumping 0.5x-2.5x (a machine at load
    # 15): probes of two threads stay within a few per cent of the time
    rng = np.random.default_rng(seed)
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    total = best = 0.0
    for _ in range(3000):
        n = g.choose(2, 1)
        f = float(rng.uniform(0.5, 2.5))
        cost = {1: 0.041 * f, 2: 1.3 * f}[n]
        clock.t += cost
        total += cost
        best += 0.041 * f
        g.record(2, 1, n, cost)
    assert total <= best * 1.08


def test_a_new_group_starts_where_the_last_switch_went() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.019, 2: 0.110}, 10)                 # busy: decode steps on one thread
    assert run(g, clock, {1: 2.4, 2: 12.0}, 1, rows=128) == [1]   # the first prompt of 128 too
    run(g, clock, {1: 0.010, 2: 0.006}, 3000)               # quiet again: decode back on two
    assert run(g, clock, {1: 1.0, 2: 0.55}, 1, rows=300) == [2]


def test_the_first_guess_on_a_busy_machine_is_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threadctl, "busy_machine", lambda ceiling: True)
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    assert run(g, clock, {1: 2.4, 2: 12.0}, 1, rows=128) == [1]
    chosen = run(g, clock, {1: 0.010, 2: 0.006}, 300)        # wrong guess: the decode probe corrects it
    assert chosen[-10:] == [2] * 10


def test_an_unknown_probe_is_costed_by_the_other_groups() -> None:
    # busy: decode learned that two threads take 6x one thread; the prefill group (started on one
    # thread) must not try two threads on a 2 s prompt every minute
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.019, 2: 0.114}, 50)
    chosen = []
    for _ in range(20):                                         # a 2 s prompt every 30 s, decode between
        chosen += run(g, clock, {1: 2.0, 2: 12.0}, 1, rows=512)
        run(g, clock, {1: 0.019, 2: 0.114}, 100)
        clock.t += 28
    assert chosen.count(2) <= 1


def test_quieter_machine_is_noticed_soon_even_after_a_long_collapse() -> None:
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    run(g, clock, {1: 0.040, 2: 1.3}, 4000)                 # two threads 30x slower: probed rarely
    assert g.state() == {1: 1}
    t0 = clock.t
    chosen = run(g, clock, {1: 0.010, 2: 0.006}, 4000)      # quiet: one thread 4x faster
    back = chosen.index(2)
    assert back * 0.010 <= 30.0 and chosen[-10:] == [2] * 10  # back on two threads within 30 s
    assert clock.t > t0


def test_load_swings_do_not_make_probes_costly() -> None:
    # one thread's time swinging 2.7x every hundred passes (other processes coming and going),
    # two threads always 30x slower: the tries of two threads stay within ~5 % of the time
    clock = Clock()
    g = ThreadGovernor(clock, adaptive=True)
    total = best = 0.0
    for k in range(40):
        f = 2.0 if k % 2 else 0.75
        for _ in range(100):
            n = g.choose(2, 1)
            cost = {1: 0.040 * f, 2: 1.2 * f}[n]
            clock.t += cost
            total += cost
            best += 0.040 * f
            g.record(2, 1, n, cost)
    assert total <= best * 1.06
