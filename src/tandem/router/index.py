"""Which worker holds which KV block: the router's mirror of every worker's prefix cache.

Fed by each worker's `SubscribeKVEvents` stream: `reset(worker, snapshot)` on (re)connect,
then `stored` / `removed` / `cleared` events; `drop(worker)` when the stream breaks. Between
a routing decision and the worker's own `BlockStored` event, the routed blocks count as
present for `speculative_ttl_s` (`add_speculative`), so a burst of requests with the same new
prefix follows the first one instead of scattering.

`match(hashes)` returns, per worker, how many *leading* blocks of the chain it holds: a
block only helps if every block before it is there too.

Layout, sized for thousands of workers and tens of millions of blocks: each worker gets a bit
slot, each block maps to the bitmask of its holders, keyed by the first 8 bytes of its
SHA-256 (`block_key`; a collision can only mis-score a route, never corrupt a result, and is
~1e-5 likely at 10M blocks). `match` is one dict lookup and a few integer operations per
matched block, independent of the number of workers. Pure data structure: no I/O, no clock
of its own (callers pass `now`), unit-tested alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tandem.protocol.block_hash import BlockHash


def block_key(h: BlockHash) -> int:
    """The index key of a block hash: its first 8 bytes as an unsigned integer."""
    return int.from_bytes(h[:8], "little")


class PrefixIndex:
    def __init__(self, speculative_ttl_s: float = 2.0) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self._slot: dict[str, int] = {}  # worker -> bit position
        self._names: dict[int, str] = {}  # bit position -> worker
        self._free: list[int] = []  # released slots, reused first
        self._holders: dict[int, int] = {}  # block key -> bitmask of confirmed holders
        self._blocks: dict[str, set[int]] = {}  # worker -> its confirmed block keys
        # block key -> {slot: expiry}; only for blocks the worker has not (yet) confirmed
        self._speculative: dict[int, dict[int, float]] = {}

    def _slot_of(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot)
            self._slot[worker] = slot
            self._names[slot] = worker
        return slot

    # -- fed by KV events ------------------------------------------------------------------
    def reset(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        """Replace everything known about `worker` with a snapshot."""
        self.cleared(worker)
        self.stored(worker, hashes)

    def stored(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        slot = self._slot_of(worker)
        bit = 1 << slot
        blocks = self._blocks.setdefault(worker, set())
        holders, spec = self._holders, self._speculative
        for h in hashes:
            k = block_key(h)
            blocks.add(k)
            holders[k] = holders.get(k, 0) | bit
            if spec:
                entry = spec.get(k)
                if entry is not None and entry.pop(slot, None) is not None and not entry:
                    del spec[k]

    def removed(self, worker: str, hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.get(worker)
        if blocks is None:
            return
        self._remove_keys(self._slot[worker], blocks, [block_key(h) for h in hashes])

    def _remove_keys(self, slot: int, blocks: set[int], keys: Iterable[int]) -> None:
        clear = ~(1 << slot)
        holders = self._holders
        for k in keys:
            blocks.discard(k)
            bits = holders.get(k)
            if bits is not None:
                bits &= clear
                if bits:
                    holders[k] = bits
                else:
                    del holders[k]

    def cleared(self, worker: str) -> None:
        blocks = self._blocks.get(worker)
        if blocks:
            self._remove_keys(self._slot[worker], blocks, list(blocks))

    def drop(self, worker: str) -> None:
        """Forget `worker` (its stream broke, or it left); its slot is reused later."""
        self.cleared(worker)
        self._blocks.pop(worker, None)
        slot = self._slot.pop(worker, None)
        if slot is None:
            return
        del self._names[slot]
        for k in [k for k, entry in self._speculative.items() if slot in entry]:
            entry = self._speculative[k]
            del entry[slot]
            if not entry:
                del self._speculative[k]
        self._free.append(slot)

    # -- routing ---------------------------------------------------------------------------
    def add_speculative(self, worker: str, hashes: Sequence[BlockHash], now: float) -> float:
        """Count `hashes` as held by `worker` until `now` + the TTL (blocks it has confirmed
        are left alone); returns that expiry, which `retract_speculative` takes."""
        slot = self._slot_of(worker)
        self._blocks.setdefault(worker, set())
        bit, expiry = 1 << slot, now + self.speculative_ttl_s
        for h in hashes:
            k = block_key(h)
            if not self._holders.get(k, 0) & bit:
                self._speculative.setdefault(k, {})[slot] = expiry
        return expiry

    def retract_speculative(self, worker: str, hashes: Sequence[BlockHash],
                            expiry: float) -> None:
        """Undo `add_speculative(worker, hashes, ...)` that returned `expiry` (the request
        never reached the worker); entries a later routing refreshed stay."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        spec = self._speculative
        for h in hashes:
            k = block_key(h)
            entry = spec.get(k)
            if entry is not None and entry.get(slot) == expiry:
                del entry[slot]
                if not entry:
                    del spec[k]

    def match(self, hashes: Sequence[BlockHash], now: float,
              workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (confirmed or speculative, unexpired);
        only workers in `workers` when given. Workers with no hit are absent."""
        if workers is None:
            mask = sum(1 << s for s in self._names)
        else:
            slots = self._slot
            mask = 0
            for w in workers:
                s = slots.get(w)
                if s is not None:
                    mask |= 1 << s
        result: dict[str, int] = {}
        holders, spec = self._holders, self._speculative
        n = 0
        for h in hashes:
            if not mask:
                break
            k = int.from_bytes(h[:8], "little")
            bits = holders.get(k, 0)
            if spec:
                entry = spec.get(k)
                if entry:
                    for s, exp in entry.items():
                        if exp > now:
                            bits |= 1 << s
            kept = mask & bits
            if kept != mask and n:
                self._record(mask & ~kept, n, result)
            mask = kept
            n += 1
        if mask and n:
            self._record(mask, n, result)
        return result

    def _record(self, bits: int, n: int, result: dict[str, int]) -> None:
        names = self._names
        while bits:
            low = bits & -bits
            result[names[low.bit_length() - 1]] = n
            bits ^= low

    def expire(self, now: float) -> int:
        """Drop expired speculative entries; returns how many."""
        count = 0
        for k in list(self._speculative):
            entry = self._speculative[k]
            for s in [s for s, exp in entry.items() if exp <= now]:
                del entry[s]
                count += 1
            if not entry:
                del self._speculative[k]
        return count

    # -- introspection ---------------------------------------------------------------------
    def num_blocks(self, worker: str | None = None) -> int:
        if worker is None:
            return len(self._holders)
        return len(self._blocks.get(worker, ()))

    def workers(self) -> list[str]:
        return sorted(self._blocks)

    def keys(self, worker: str) -> set[int]:
        """A copy of the block keys confirmed for `worker`."""
        return set(self._blocks.get(worker, ()))


class ApproximateIndex:
    """For workers that publish no KV events (stock vLLM): per worker, an LRU of the block
    hashes the router itself sent there, `capacity` entries each. A guess, not the truth:
    the worker may have evicted them already."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[BlockHash, int]] = {}  # hash -> last routing's seq
        self._seq = 0

    def routed(self, worker: str, hashes: Sequence[BlockHash]) -> tuple[int, list[BlockHash]]:
        """Record `hashes` as sent to `worker`; (this routing's sequence number, the hashes
        it added), for `retract`."""
        self._seq += 1
        lru = self._lru.setdefault(worker, OrderedDict())
        added = []
        for h in hashes:
            if h not in lru:
                added.append(h)
            lru[h] = self._seq
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return self._seq, added

    def retract(self, worker: str, seq: int, added: Sequence[BlockHash]) -> None:
        """Take back what routing `seq` added, except hashes a later routing refreshed."""
        lru = self._lru.get(worker)
        if lru:
            for h in added:
                if lru.get(h) == seq:
                    del lru[h]

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
