"""Cache churn: how much new (uncached) prompt text the router has lately sent each worker.

Per worker, an exponentially decayed sum of the prompt tokens the router's own decisions
inserted into that worker's KV cache (`prompt_tokens - matched_tokens` of the winner, at
decision time). A worker that keeps receiving new prefixes evicts the ones it holds; one
that has received little new text lately has room for a new prefix group. The
`cache_churn` scorer turns the value into a [0, 1] score against the worker's KV capacity;
vllm-router's `cache_aware` policy gets the same effect from the size of its per-worker
radix trees.

Pure data structure: O(1) per call (a value and its time per worker, decayed lazily as
`v * 0.5 ** ((now - t) / half_life_s)`), no clock of its own (callers pass `now`, in
seconds), unit-tested alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set


class ChurnTracker:
    """Decayed uncached-token totals per worker (tokens, or characters in approximate mode)."""

    def __init__(self, half_life_s: float = 30.0) -> None:
        if not half_life_s > 0:
            raise ValueError(f"churn half-life must be > 0 seconds, not {half_life_s!r}")
        self.half_life_s = half_life_s
        self._state: dict[str, tuple[float, float]] = {}  # worker -> (value, as of time)

    def value(self, worker: str, now: float) -> float:
        """The worker's total decayed to `now`; 0.0 for an unknown worker. A `now` before
        the last update does not decay (nor grow) the value."""
        state = self._state.get(worker)
        if state is None:
            return 0.0
        v, t = state
        if now <= t:
            return v
        return v * 0.5 ** ((now - t) / self.half_life_s)

    def add(self, worker: str, tokens: float, now: float) -> None:
        """Count `tokens` (negative counts as 0) newly sent to `worker` at `now`."""
        state = self._state.get(worker)
        t = now if state is None else max(state[1], now)
        self._state[worker] = (self.value(worker, now) + max(tokens, 0.0), t)

    def refund(self, worker: str, tokens: float, now: float) -> None:
        """Take back `tokens` charged by `add` that never reached `worker` (the total stays
        >= 0; what decayed since the charge comes off in full, a negligible excess for the
        milliseconds between a charge and its failed attempt)."""
        state = self._state.get(worker)
        if state is not None and tokens > 0:
            self._state[worker] = (max(self.value(worker, now) - tokens, 0.0),
                                   max(state[1], now))

    def drop(self, worker: str) -> None:
        """Forget `worker` (it left the pool); a no-op for an unknown one."""
        self._state.pop(worker, None)

    def workers(self) -> list[str]:
        return sorted(self._state)


class ChurnView(Mapping[str, float]):
    """`tracker`'s values at `now` for `workers`, each computed when read (a policy may read
    a few of them: the cost policy only to break near-equal costs)."""

    def __init__(self, tracker: ChurnTracker, now: float, workers: Set[str]) -> None:
        self._tracker, self._now, self._workers = tracker, now, workers

    def __getitem__(self, worker: str) -> float:
        if worker not in self._workers:
            raise KeyError(worker)
        return self._tracker.value(worker, self._now)

    def get(self, worker: str, default: float | None = None) -> float | None:
        """`Mapping.get` without its two extra calls (read once per candidate)."""
        if worker in self._workers:
            return self._tracker.value(worker, self._now)
        return default

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)
