"""The pool of KV blocks: reference counts, an O(1) LRU free queue and the prefix-hash map.

Plain Python values only (no torch): block ids index the per-layer KV tensors elsewhere.
A block with ``ref_cnt == 0`` sits in the free queue; if it still carries a hash it can be
revived by a prefix hit (`touch`) until `get_new_blocks` evicts it from the queue's head.
With a sliding-window model block 0 is the reserved null block (`reserve_null`): never in
the free queue, never allocated, referenced or written; block tables point out-of-window
positions at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.protocol.block_hash import BlockHash
from tandem.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    """Metadata of one KV block."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block `get_new_blocks` is about to reuse (its pages still intact), as
    handed to `BlockPool.on_evict`: its hash, chain parent, tokens and adapter."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    lora_name: str = ""
    lora_digest: str = ""


class BlockPool:
    """Owns all blocks, the free queue (LRU order: head is evicted first) and cached hashes."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        self.null_block: KVBlock | None = None  # `reserve_null`
        # which cached keys events and `cached_hashes` report (None: all); a hybrid model's
        # pool reports one KV group's (`kv_cache/hybrid.py`)
        self.reported: Callable[[BlockHash], bool] | None = None
        # told of cached blocks as they are evicted, before their memory is reused (the KV
        # offload connector saves them); `track_evictions` turns it on
        self.on_evict: Callable[[list[EvictedBlock]], None] | None = None
        self._meta: dict[int, tuple[BlockHash, tuple[int, ...], str, str]] | None = None

    def track_evictions(self, on_evict: Callable[[list[EvictedBlock]], None]) -> None:
        """Call `on_evict` with each batch of cached blocks `get_new_blocks` evicts (their
        parent hash, tokens and adapter are kept per cached block from now on)."""
        self.on_evict = on_evict
        if self._meta is None:
            self._meta = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block, if reserved."""
        return self.num_blocks - (self.null_block is not None)

    def reserve_null(self) -> KVBlock:
        """Take block 0 out of circulation for good as the null block (before any use):
        it is never allocated, and `touch` / `free_blocks` of it raise."""
        if self.null_block is not None:
            return self.null_block
        if self.num_blocks < 2 or len(self._free) != self.num_blocks:
            raise ValueError("the null block needs an unused pool of at least 2 blocks")
        del self._free[0]
        self.null_block = self.blocks[0]
        return self.null_block

    # -- queries -------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of usable blocks referenced by live requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash currently hittable (a snapshot for routers that (re)connect)."""
        if self.reported is not None:
            return [h for h in self._cached if self.reported(h)]
        return list(self._cached)

    # -- mutations -----------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue, evicting their hashes.

        Raises ValueError when fewer than `n` are free: callers check `num_free_blocks` first.
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out: list[KVBlock] = []
        evicted: list[BlockHash] = []
        saved: list[EvictedBlock] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                meta = self._meta.pop(block_id, None) if self._meta is not None else None
                if meta is not None:
                    saved.append(EvictedBlock(block_id, block.block_hash, *meta))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.enable_events and self.reported is not None:
            evicted = [h for h in evicted if self.reported(h)]
        if evicted and self.enable_events:
            self._events.append(BlockRemoved(tuple(evicted)))
        if saved and self.on_evict is not None:
            self.on_evict(saved)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (cached) blocks, reviving free ones out of the queue."""
        for block in blocks:
            if block is self.null_block:
                raise ValueError("the null block cannot be referenced")
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order.

        Callers pass a request's blocks tail-first so its tail is evicted before its prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash],
                          parent_hash: BlockHash, token_ids: Sequence[int],
                          block_size: int, lora_name: str = "",
                          lora_digest: str = "") -> None:
        """Register full blocks under their hashes (`blocks[i]` holds tokens of `hashes[i]`).

        A hash already present keeps its existing block; the duplicate stays uncached.
        """
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        prev = parent_hash
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            parent, prev = prev, block_hash
            if block.block_hash is not None or block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
            if self._meta is not None:
                self._meta[block.block_id] = (
                    parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), lora_name,
                    lora_digest)
        if stored and self.reported is not None and not all(map(self.reported, hashes)):
            stored = []  # a chain of another group's keys: not reported
        if stored and self.enable_events:
            if len(stored) == len(hashes):
                self._events.append(BlockStored(tuple(stored), parent_hash, tuple(token_ids),
                                                block_size, lora_name, lora_digest))
            else:  # partial: emit per block so each event carries its own parent and tokens
                prev = parent_hash
                for i, h in enumerate(hashes):
                    if h in stored:
                        toks = tuple(token_ids[i * block_size:(i + 1) * block_size])
                        self._events.append(BlockStored((h,), prev, toks, block_size,
                                                        lora_name, lora_digest))
                    prev = h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self._meta is not None:
            self._meta.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
