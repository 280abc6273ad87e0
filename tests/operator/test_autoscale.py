"""The autoscaler's decision rule (`tandem.operator.autoscale`), table-driven, plus a noisy
load series that must not make it flap."""

from __future__ import annotations

import random

import pytest

from tandem.operator.autoscale import desired_replicas, recommend, remember

#         current, lo, hi, value, target, expected recommendation
RECOMMEND = [
    pytest.param(2, 1, 10, 8.0, 4.0, 4, id="twice the target: double"),
    pytest.param(3, 1, 10, 4.0, 4.0, 3, id="on target: stay"),
    pytest.param(3, 1, 10, 4.39, 4.0, 3, id="inside +10%: stay"),
    pytest.param(3, 1, 10, 3.61, 4.0, 3, id="inside -10%: stay"),
    pytest.param(3, 1, 10, 4.5, 4.0, 4, id="above the band: ceil(3 * 1.125)"),
    pytest.param(4, 1, 10, 2.0, 4.0, 2, id="half the target: halve"),
    pytest.param(4, 1, 10, 0.0, 4.0, 1, id="idle: down to min"),
    pytest.param(2, 1, 5, 40.0, 4.0, 5, id="clamped to max"),
    pytest.param(4, 3, 10, 0.5, 4.0, 3, id="clamped to min"),
    pytest.param(1, 1, 10, 0.85, 0.8, 1, id="kv utilization inside the band"),
    pytest.param(5, 1, 10, 3.0, 4.0, 4, id="ceil, not round: 3.75 -> 4"),
    pytest.param(0, 0, 10, 2.0, 4.0, 1, id="a pool at zero with load: one replica"),
    pytest.param(0, 0, 10, 20.0, 4.0, 5, id="a pool at zero wakes to its whole demand"),
    pytest.param(0, 0, 3, 20.0, 4.0, 3, id="a pool at zero wakes to at most max"),
    pytest.param(0, 0, 10, 0.0, 4.0, 0, id="a pool at zero without demand stays there"),
    pytest.param(3, 0, 10, 0.0, 4.0, 0, id="idle with min 0: zero"),
    pytest.param(10, 1, 10, 4.0, 4.0, 10, id="at max, on target"),
    pytest.param(12, 1, 10, 4.0, 4.0, 10, id="above a lowered max: max"),
]


@pytest.mark.parametrize(("current", "lo", "hi", "value", "target", "want"), RECOMMEND)
def test_recommend(current, lo, hi, value, target, want):
    assert recommend(current, value, target, lo, hi) == want


#         current, value, history (age s, recommendation), window s, expected replicas
DESIRED = [
    pytest.param(2, 8.0, [(5, 2)], 60, 4, id="up at once, whatever the window"),
    pytest.param(4, 1.0, [], 60, 1, id="down with no history"),
    pytest.param(4, 1.0, [(10, 4)], 60, 4, id="down held by a recent 4"),
    pytest.param(4, 1.0, [(10, 3), (5, 2)], 60, 3, id="down only to the window's max"),
    pytest.param(4, 1.0, [(61, 4), (30, 2)], 60, 2, id="older than the window: ignored"),
    pytest.param(4, 1.0, [(10, 6)], 60, 4, id="a higher past: never up on the way down"),
    pytest.param(4, 1.0, [(10, 4)], 0, 1, id="no window: down at once"),
    pytest.param(3, 4.0, [(1, 5)], 60, 3, id="in the band: stay"),
]


@pytest.mark.parametrize(("current", "value", "history", "window", "want"), DESIRED)
def test_desired_replicas(current, value, history, window, want):
    now = 1000.0
    hist = [(now - age, r) for age, r in history]
    assert desired_replicas(current, 1, 10, value, 4.0, hist, window, now) == want


def test_bounds_win_over_the_window():
    """A max lowered below what runs applies at once, history or not."""
    assert desired_replicas(8, 1, 5, 4.0, 4.0, [(999.0, 8)], 300, 1000.0) == 5
    assert desired_replicas(1, 2, 5, 0.0, 4.0, [], 300, 1000.0) == 2


def test_remember_keeps_the_window_only():
    h = remember([(0.0, 5), (50.0, 4)], 100.0, 3, window_s=60)
    assert h == ((50.0, 4), (100.0, 3))


def simulate(loads: list[float], target: float, window: float, interval: float = 15.0,
             lo: int = 1, hi: int = 20) -> list[int]:
    """Replica counts over a series of total loads (spread over the running replicas)."""
    current, history, out = lo, (), []
    for i, load in enumerate(loads):
        now = i * interval
        value = load / current
        rec = recommend(current, value, target, lo, hi)
        current = desired_replicas(current, lo, hi, value, target, history, window, now)
        history = remember(history, now, rec, window)
        out.append(current)
    return out


def changes(series: list[int]) -> int:
    return sum(a != b for a, b in zip(series, series[1:], strict=False))


def test_noisy_steady_load_does_not_flap():
    """A steady total load of 24 waiting requests (target 4 per replica: 6 replicas) with
    ±30 % noise per sample, 400 ticks of 15 s: the pool climbs once to cover the peaks and
    stays (scale-down waits for a 5-minute window of lower recommendations)."""
    rng = random.Random(7)
    loads = [24 * rng.uniform(0.7, 1.3) for _ in range(400)]
    series = simulate(loads, target=4, window=300)
    settled = series[40:]
    assert changes(settled) <= 2, settled
    assert min(settled) >= 6 and max(settled) <= 9


def test_no_window_would_flap_on_the_same_series():
    """The window is what prevents the flapping above (the same series, window 0)."""
    rng = random.Random(7)
    loads = [24 * rng.uniform(0.7, 1.3) for _ in range(400)]
    assert changes(simulate(loads, target=4, window=0)[40:]) > 50


def test_step_up_then_down_follows_the_load():
    """Load 8 → 40 → 8 (target 4): 2 → 10 at once; back to 2 one window after the drop."""
    loads = [8.0] * 10 + [40.0] * 10 + [8.0] * 40
    series = simulate(loads, target=4, window=60)  # 4 ticks of 15 s
    assert series[9] == 2 and series[10] == 10
    assert series[20:24] == [10, 10, 10, 10]  # held for the window
    assert series[0] == 2 and series[-1] == 2  # the first tick takes 1 -> 2
    assert changes(series) == 2  # 2 -> 10, 10 -> 2
