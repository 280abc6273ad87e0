"""Block allocation for a hybrid model: one block table per KV group (`kv_cache/groups.py`)
over one shared `BlockPool`.

Every group of a request covers the same token positions, so each allocation takes the same
number of blocks in every group; a group with a window W frees its leading blocks once no
future query reads them (as `KVCacheManager.free_out_of_window` does for a uniform window),
a full-attention group keeps them. Freed entries point at the null block (block 0).

Prefix caching: group g's block of hash h is cached under `group_key(g, h)` (the first
full-attention group's under h itself: the only keys KV events and the routers' snapshot
report), so a block id holds one group's KV of one hash. A hit of L blocks needs every
full group's blocks [0, L) and each sliding group's blocks from the first one a query at
position L * block_size reads (vLLM: each manager's `find_longest_cache_hit`, the longest
length that all accept). Entries before that are the null block.

Not supported here (refused by the engine for hybrid models): `keep_kv` requests, leases,
imports and staged tails (P/D page transfer), a KV connector: P/D workers run hybrid models
on one block table (`kv_cache_groups=False`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.block_pool import KVBlock
from tandem.engine.kv_cache.block_table import BlockTable
from tandem.engine.kv_cache.leases import PageLease
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv, window_blocks
from tandem.engine.request import Request
from tandem.protocol.block_hash import BlockHash

HASH_LEN = 32  # a plain block hash's bytes (a group's key prefixes its group's)

if TYPE_CHECKING:
    from tandem.engine.kv_connector.base import KVConnectorScheduler


def group_key(group: int, block_hash: BlockHash, plain: int = 0) -> BlockHash:
    """The prefix-cache key of group `group`'s block of `block_hash` (the `plain` group's
    is the hash itself)."""
    return block_hash if group == plain else bytes((group,)) + block_hash


@dataclass(frozen=True)
class GroupHit:
    """A prefix hit of `num_blocks` leading blocks: `groups[g]` group g's blocks (the null
    block where a sliding group's first query reads none of the block)."""

    groups: tuple[list[KVBlock], ...]

    @property
    def num_blocks(self) -> int:
        return len(self.groups[0])

    def __bool__(self) -> bool:
        return self.num_blocks > 0


class HybridKVCacheManager(KVCacheManager):
    """`KVCacheManager` with one block table per group: `tables[g]`; `block_table` is group
    0's. `windows[g]`: group g's window (None: full attention)."""

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None],
                 enable_caching: bool = True, enable_events: bool = False) -> None:
        if len(windows) > 255:
            raise ConfigError(f"{len(windows)} KV cache groups: at most 255")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be >= 1, got {list(windows)}")
        super().__init__(num_blocks, block_size, enable_caching, enable_events)
        self.windows = tuple(windows)
        # the group whose keys are the plain hashes, the only ones KV events and
        # `cached_hashes` report: the first full-attention group (it holds a whole prefix)
        self.plain = next((g for g, w in enumerate(self.windows) if w is None), 0)
        self.pool.reported = lambda key: len(key) == HASH_LEN
        self.null_block = self.pool.reserve_null()
        self.tables = [BlockTable() for _ in self.windows]
        self.block_table = self.tables[0]
        # per request: each group's blocks (`_blocks[rid]` is group 0's list) and how many
        # leading entries of each are the null block
        self._groups: dict[str, list[list[KVBlock]]] = {}
        self._freed: dict[str, list[int]] = {}

    supports_keep = False

    def key(self, group: int, block_hash: BlockHash) -> BlockHash:
        """Group `group`'s prefix-cache key of `block_hash` (`group_key`)."""
        return group_key(group, block_hash, self.plain)

    @property
    def frees_blocks(self) -> bool:
        return True

    @property
    def connector(self) -> KVConnectorScheduler | None:
        return None

    @connector.setter
    def connector(self, value: KVConnectorScheduler | None) -> None:
        if value is not None:
            raise self._refuse("a KV connector")

    def _out_of_window_in(self, window: int | None, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on reads in a group of
        `window`."""
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def get_computed_blocks(self, req: Request) -> tuple[GroupHit, int]:  # type: ignore[override]
        """The longest hit every group can serve (see the module doc) and its tokens.
        Pure, as `KVCacheManager.get_computed_blocks`."""
        empty = GroupHit(tuple([] for _ in self.windows))
        limit = self._max_hit_blocks(req)
        if limit <= 0:
            return empty, 0
        hashes = req.update_block_hashes(self.block_size)[:limit]
        get = self.pool.get_cached_block
        n = limit
        for g, w in enumerate(self.windows):  # full groups: the leading run
            if w is None:
                run = 0
                while run < n and get(self.key(g, hashes[run])) is not None:
                    run += 1
                n = run
        found = {g: [get(self.key(g, h)) for h in hashes[:n]]
                 for g, w in enumerate(self.windows) if w is not None}
        # per sliding group, how many cached blocks end at each index (a run)
        runs: dict[int, list[int]] = {}
        for g, blocks in found.items():
            run, ends = 0, []
            for b in blocks:
                run = run + 1 if b is not None else 0
                ends.append(run)
            runs[g] = ends
        while n > 0 and not all(
                n - self._out_of_window_in(self.windows[g], n * self.block_size) <= ends[n - 1]
                for g, ends in runs.items()):
            n -= 1
        if n == 0:
            return empty, 0
        groups = []
        for g, w in enumerate(self.windows):
            if w is None:
                groups.append([get(self.key(g, h)) for h in hashes[:n]])
            else:
                skip = self._out_of_window_in(w, n * self.block_size)
                groups.append([self.null_block] * skip + found[g][skip:n])
        return GroupHit(tuple(groups)), n * self.block_size  # type: ignore[arg-type]

    def allocate_slots(self, req: Request, num_new_tokens: int,  # type: ignore[override]
                       computed: GroupHit | None = None, max_free: int | None = None,
                       num_external_tokens: int = 0) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens in every group (`computed`: the hit of
        `get_computed_blocks`, first scheduling only). Returns the new blocks of all groups,
        or None (nothing changed) when the pool, or `max_free`, is short."""
        if num_external_tokens:
            raise ConfigError("a KV connector cannot load into a hybrid model's KV groups")
        rid = req.request_id
        hit = computed if computed else None
        num_hit = hit.num_blocks if hit is not None else 0
        groups = self._groups.get(rid)
        have = len(groups[0]) if groups else 0
        total = req.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        need = max(0, cdiv(total, self.block_size) - have - num_hit)
        taken = [] if hit is None else [b for blocks in hit.groups for b in blocks
                                        if b is not self.null_block]
        revived = sum(1 for b in taken if b.ref_cnt == 0)
        free = self.pool.num_free_blocks()
        if need * len(self.windows) + revived > (free if max_free is None
                                                 else min(free, max_free)):
            return None
        self.pool.touch(taken)
        if groups is None:
            groups = self._groups[rid] = [[] for _ in self.windows]
            self._blocks[rid] = groups[0]
            self._freed[rid] = [0] * len(self.windows)
            self._num_cached[rid] = 0
        new_all: list[KVBlock] = []
        for g, blocks in enumerate(groups):
            added = [] if hit is None else list(hit.groups[g])
            if hit is not None:
                self._freed[rid][g] = sum(1 for b in added if b is self.null_block)
            new = self.pool.get_new_blocks(need) if need else []
            added += new
            new_all += new
            blocks.extend(added)
            self.tables[g].append(rid, [b.block_id for b in added])
        if hit is not None:
            self._num_cached[rid] = num_hit
        if self.enable_caching:  # the full blocks this chunk completes: cached after the step
            end = min(total, req.num_tokens) // self.block_size
            start = self._num_cached[rid]
            if end > start:
                self._pending.update(req.update_block_hashes(self.block_size)[start:end])
        return new_all

    def free_out_of_window(self, req: Request) -> int:
        """Release, in each sliding group, `req`'s leading blocks wholly before the window
        of its next query, once they are in the prefix cache (entries become the null
        block). Returns how many were released in all."""
        rid = req.request_id
        groups = self._groups.get(rid)
        if not groups:
            return 0
        if self.enable_caching:  # cached first: a freed block stays hittable until evicted
            self.commit_computed(req)
        released = 0
        for g, (w, blocks) in enumerate(zip(self.windows, groups, strict=True)):
            start = self._freed[rid][g]
            end = min(len(blocks), self._out_of_window_in(w, req.num_computed_tokens))
            if self.enable_caching:
                end = min(end, self._num_cached[rid])
            if end <= start:
                continue
            freed = blocks[start:end]
            blocks[start:end] = [self.null_block] * (end - start)  # type: ignore[list-item]
            self.tables[g].clear(rid, start, end)
            self._freed[rid][g] = end
            self.pool.free_blocks(reversed(freed))  # the earliest is evicted last
            released += end - start
        self.window_freed_blocks += released
        return released

    def max_blocks(self, num_tokens: int, step_tokens: int, keep: bool = False) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, over all groups
        (`window_blocks` per group)."""
        return sum(window_blocks(num_tokens, self.block_size, None if keep else w, step_tokens)
                   for w in self.windows)

    def capacity_tokens(self, step_tokens: int) -> int:
        """The longest request the pool holds alone (`max_blocks` within the usable
        blocks); a huge number where no group keeps every block."""
        usable, lo, hi = self.pool.num_usable_blocks, 0, 1 << 40
        while lo < hi:  # max_blocks grows with the tokens
            mid = (lo + hi + 1) // 2
            if self.max_blocks(mid, step_tokens) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def resident_blocks(self, request_id: str) -> int:
        """Blocks `request_id` holds in all groups (entries that are not the null block)."""
        groups = self._groups.get(request_id)
        if groups is None:
            return 0
        return sum(len(b) for b in groups) - sum(self._freed[request_id])

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Each group's block ids of `request_id` (0: the null block)."""
        return [t.row(request_id).tolist() for t in self.tables]

    def commit_computed(self, req: Request) -> None:
        """Register `req`'s full blocks up to `req.num_computed_tokens` in the prefix cache,
        each group's under its own key. Only once the forward that wrote them completed."""
        rid = req.request_id
        if not self.enable_caching or rid not in self._groups:
            return
        start = self._num_cached[rid]
        end = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = req.update_block_hashes(self.block_size)[start:end]
        bs = self.block_size
        tokens = req.all_token_ids[start * bs: end * bs]
        for g, blocks in enumerate(self._groups[rid]):
            self.pool.cache_full_blocks(blocks[start:end], [self.key(g, h) for h in hashes],
                                        req.parent_hash(start), tokens, bs,
                                        req.lora_name or "", req.hash_keys.adapter_id)
        self._num_cached[rid] = end

    def free(self, req: Request, keep: bool = False, finished: bool = False) -> None:
        """Release every block of `req` in every group (tail first). `keep` is refused."""
        if keep:
            raise ConfigError("a hybrid model's KV blocks cannot be kept (keep_kv)")
        rid = req.request_id
        groups = self._groups.pop(rid, None)
        self._blocks.pop(rid, None)
        self._freed.pop(rid, None)
        self._num_cached.pop(rid, None)
        for t in self.tables:
            t.drop(rid)
        for blocks in groups or ():
            self.pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)

    # -- what hybrid groups do not support ----------------------------------------------
    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(f"{what} is not supported for a hybrid model's KV cache groups "
                           "(layers of mixed attention windows); kv_cache_groups=False runs "
                           "it on one block table")

    def pin_cached(self, hashes: list[BlockHash]) -> list[KVBlock]:
        raise self._refuse("pinning cached blocks (P/D transfer)")

    def lease_cached(self, owner: str, hashes: list[BlockHash],
                     lease_s: float) -> PageLease:
        raise self._refuse("leasing cached blocks")

    def import_blocks(self, hashes: list[BlockHash], tail: bool = False
                      ) -> tuple[list[KVBlock], list[int]]:
        raise self._refuse("importing KV pages")

    def stage_tail(self, request_id: str, block: KVBlock, index: int,
                   token_ids: list[int]) -> None:
        raise self._refuse("staging a prompt's last block")
