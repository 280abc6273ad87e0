"""Which worker holds which KV block: the router's mirror of every worker's prefix cache.

Fed by each worker's `SubscribeKVEvents` stream: `reset(worker, snapshot)` on (re)connect,
then `stored` / `removed` / `cleared` events; `drop(worker)` when the stream breaks. Between
a routing decision and the worker's own `BlockStored` event, the routed blocks count as
present for `speculative_ttl_s` (`add_speculative`), so a burst of requests with the same new
prefix follows the first one instead of scattering.

`match(hashes)` returns, per worker, how many *leading* blocks of the chain it holds: a
block only helps if every block before it is there too. Cost: O(matched blocks x holders),
with one dict lookup per block. Pure data structure: no I/O, no clock of its own (callers
pass `now`), unit-tested alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tandem.protocol.block_hash import BlockHash


class PrefixIndex:
    def __init__(self, speculative_ttl_s: float = 2.0) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self._holders: dict[BlockHash, set[str]] = {}  # confirmed by the worker's events
        self._blocks: dict[str, set[BlockHash]] = {}
        # hash -> {worker: expiry}; only for blocks the worker has not (yet) confirmed
        self._speculative: dict[BlockHash, dict[str, float]] = {}

    # -- fed by KV events ------------------------------------------------------------------
    def reset(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        """Replace everything known about `worker` with a snapshot."""
        self.drop(worker)
        self.stored(worker, hashes)

    def stored(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.setdefault(worker, set())
        for h in hashes:
            blocks.add(h)
            self._holders.setdefault(h, set()).add(worker)
            spec = self._speculative.get(h)
            if spec is not None:
                spec.pop(worker, None)
                if not spec:
                    del self._speculative[h]

    def removed(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.get(worker)
        if blocks is None:
            return
        for h in hashes:
            blocks.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def cleared(self, worker: str) -> None:
        self.removed(worker, list(self._blocks.get(worker, ())))

    def drop(self, worker: str) -> None:
        """Forget `worker` (its stream broke, or it left)."""
        self.cleared(worker)
        self._blocks.pop(worker, None)
        for h in [h for h, spec in self._speculative.items() if worker in spec]:
            del self._speculative[h][worker]
            if not self._speculative[h]:
                del self._speculative[h]

    # -- routing ---------------------------------------------------------------------------
    def add_speculative(self, worker: str, hashes: Sequence[BlockHash], now: float) -> None:
        expiry = now + self.speculative_ttl_s
        known = self._blocks.get(worker, set())
        for h in hashes:
            if h not in known:
                self._speculative.setdefault(h, {})[worker] = expiry

    def match(self, hashes: Sequence[BlockHash], now: float,
              workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (confirmed or speculative, unexpired);
        only workers in `workers` when given. Workers with no hit are absent."""
        alive = None if workers is None else set(workers)
        result: dict[str, int] = {}
        candidates: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = set(self._holders.get(h, ()))
            spec = self._speculative.get(h)
            if spec:
                holders.update(w for w, exp in spec.items() if exp > now)
            if alive is not None:
                holders &= alive
            candidates = holders if candidates is None else candidates & holders
            if not candidates:
                break
            for w in candidates:
                result[w] = i + 1
        return result

    def expire(self, now: float) -> int:
        """Drop expired speculative entries; returns how many."""
        count = 0
        for h in list(self._speculative):
            spec = self._speculative[h]
            for w in [w for w, exp in spec.items() if exp <= now]:
                del spec[w]
                count += 1
            if not spec:
                del self._speculative[h]
        return count

    # -- introspection ---------------------------------------------------------------------
    def num_blocks(self, worker: str | None = None) -> int:
        if worker is None:
            return len(self._holders)
        return len(self._blocks.get(worker, ()))

    def workers(self) -> list[str]:
        return sorted(self._blocks)


class ApproximateIndex:
    """For workers that publish no KV events (stock vLLM): per worker, an LRU of the block
    hashes the router itself sent there, `capacity` entries each. A guess, not the truth:
    the worker may have evicted them already."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}

    def routed(self, worker: str, hashes: Sequence[BlockHash]) -> None:
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, hashes: Sequence[BlockHash], workers: Iterable[str]) -> dict[str, int]:
        result = {}
        for w in workers:
            lru = self._lru.get(w)
            if not lru:
                continue
            n = 0
            for h in hashes:
                if h not in lru:
                    break
                n += 1
            if n:
                result[w] = n
        return result

    def drop(self, worker: str) -> None:
        self._lru.pop(worker, None)
