"""The autoscaler's decision rule (pure): the HPA's algorithm on one per-replica signal.

    recommendation = ceil(current * value / target), or current while value / target is
                     within the tolerance band (hysteresis), clamped to [min, max]; a pool
                     at zero: ceil(value / target) (`value` then is its whole load)
    scale up       at once, to the recommendation
    scale down     only to the highest recommendation of the stabilization window (so one
                   quiet sample after a burst does not remove replicas), never below it

The caller records every tick's recommendation (`remember`) and feeds the history back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

TOLERANCE = 0.1  # |value / target - 1| within this: no change (the HPA's default)
History = tuple[tuple[float, int], ...]  # (time, recommendation), oldest first


def clamp(n: int, lo: int, hi: int) -> int:
    return min(max(n, lo), hi)


def recommend(current: int, value: float, target: float, lo: int, hi: int,
              tolerance: float = TOLERANCE) -> int:
    """This tick's replica count for `value` per replica against `target` per replica."""
    if target <= 0:
        raise ValueError(f"target {target} must be > 0")
    ratio = value / target
    if current < 1:  # a pool at zero: `value` is its whole load (the router's demand)
        return clamp(math.ceil(value / target - 1e-9) if value > 0 else 0, lo, hi)
    if abs(ratio - 1.0) <= tolerance:
        return clamp(current, lo, hi)
    return clamp(math.ceil(current * ratio - 1e-9), lo, hi)


def desired_replicas(current: int, lo: int, hi: int, value: float, target: float,
                     history: Sequence[tuple[float, int]], window_s: float, now: float,
                     tolerance: float = TOLERANCE) -> int:
    """Replicas to run now. `history` holds the recommendations of earlier ticks (only those
    within `window_s` of `now` count); bounds always apply, whatever the window says."""
    rec = recommend(current, value, target, lo, hi, tolerance)
    if rec >= current:
        return rec
    recent = [r for t, r in history if now - t <= window_s]
    return clamp(min(current, max([rec, *recent])), lo, hi)


def remember(history: Sequence[tuple[float, int]], now: float, recommendation: int,
             window_s: float) -> History:
    """The history with this tick's recommendation, older entries than the window dropped."""
    return (*((t, r) for t, r in history if now - t <= window_s), (now, recommendation))
