"""Per-request block allocation on top of the `BlockPool`, with prefix-cache lookups.

Check/act pairs as in nano-vllm: `get_computed_blocks` finds a prefix hit without side
effects; `allocate_slots` takes the blocks or returns None when the pool is too small.

A block joins the prefix cache (and its `BlockStored` event goes out) only in
`commit_computed`, which the scheduler calls once the forward that wrote the block's last
token has completed: a request that is preempted, aborted or fails before that leaves no
hash behind for tokens it did not compute. Between `new_step` and the commit, the full
blocks the step's chunks will complete are *pending*: `pending_run` tells how much of a
waiting request's prefix a step of waiting would turn into a hit.

Every request's block ids are also kept in a persistent `BlockTable` (`block_table`),
updated where `_blocks` (the source of truth) changes, so a step's attention metadata
gathers its rows without per-request lists.

Blocks held for a reader outside the engine are leased (`leases`, `kv_cache/leases.py`): a
finished `keep_kv` request's blocks under its id for `keep_lease_s`, which its reader
shortens or extends (`lease_kept`), and prefix-cached runs for a reader (`lease_cached`).
A lease nobody releases ends at `expire_leases`, which the engine thread calls. The
engine's KV connector, scheduler side (`connector`, `engine/kv_connector`), is told of each
allocation that adds blocks (with the tokens to load into them from outside, on an
admission: `allocate_slots`' `num_external_tokens`, which count as computed: the scheduler
commits them with the step that loads them) and decides what becomes of each normally
finished request's blocks (kept under a lease, or freed).

Sliding window (`sliding_window` W: every layer of the model attends only to the last W
positions, `uniform_window`): a query at position p reads keys (p - W, p], so once a
request has computed `c` tokens no future query (this step's chunk starts at `c`; drafts
come after it) reads a block whose positions are all < c - W + 1. `free_out_of_window`
releases such leading blocks (after registering them in the prefix cache: they stay
hittable until evicted) and points their entries at the pool's null block (block 0, never
written: the backends mask those positions out). A prefix hit takes no reference on the
hit blocks that are already out of the window of its first query. A request then holds at
most `max_blocks` blocks at once. `keep_kv` requests (a KV transfer's source) keep every
block. Mixed sliding and full-attention layers (Gemma 3) have one block table per KV group
(`kv_cache/hybrid.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.kv_cache.block_pool import BlockPool, KVBlock
from tandem.engine.kv_cache.block_table import BlockTable
from tandem.engine.kv_cache.leases import MAX_LEASE_S, LeaseBook, LeaseStats, PageLease
from tandem.engine.request import Request
from tandem.protocol.block_hash import BlockHash

if TYPE_CHECKING:
    from tandem.engine.kv_connector.base import KVConnectorScheduler


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def uniform_window(layer_windows: Sequence[int | None]) -> int | None:
    """The window at which a model's KV blocks can be freed: W when every layer slides with
    the same window W; None with any full-attention layer or windows that differ."""
    windows = set(layer_windows)
    if len(windows) != 1:
        return None
    (window,) = windows
    return window


def window_blocks(num_tokens: int, block_size: int, window: int | None,
                  step_tokens: int) -> int:
    """The most blocks a request of `num_tokens` tokens holds at once when a step runs at
    most `step_tokens` of its tokens: all of them, or with a window W on every layer at most
    cdiv(W + step_tokens - 2, block_size) + 1: a step's positions back to W - 1 before its
    first query, one block more where they start mid-block."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    return min(full, cdiv(window + step_tokens - 2, block_size) + 1)


@dataclass(frozen=True)
class StagedTail:
    """A prompt's last block, pinned for one request (`stage_tail`): slots
    [0, len(token_ids)) of `block` hold the KV of `token_ids`, the prompt's first tokens
    from position `index * block_size` (all but its last token when the partial block was
    imported; none when the last token starts the block or the sender left the partial
    block out); the request computes the rest of the block itself."""

    block: KVBlock
    index: int  # the block's position in the prompt: the full blocks before it
    token_ids: tuple[int, ...]


class KVCacheManager:
    """Maps requests to their blocks; the block table of a request is `block_ids(req)`, of
    a batch `block_table.gather(ids)`."""

    supports_keep = True  # finished requests' blocks can be kept (`free(keep=True)`)

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 enable_events: bool = False, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_events)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        # every layer's window (None: some layer reads the whole context: nothing is freed)
        self.sliding_window = sliding_window
        self.null_block = None if sliding_window is None else self.pool.reserve_null()
        self._num_freed: dict[str, int] = {}  # leading entries pointing at the null block
        self.window_freed_blocks = 0  # blocks released by `free_out_of_window`, in all
        self._blocks: dict[str, list[KVBlock]] = {}
        # the ids of `_blocks`, row per request id: changed only with `_blocks`
        self.block_table = BlockTable()
        self._num_cached: dict[str, int] = {}  # leading blocks registered in the hash map
        # pins held for readers outside the engine, on `clock`'s time: finished keep_kv
        # requests' blocks under their request ids, leased cached runs
        self.leases = LeaseBook(self.pool)
        self.clock: Callable[[], float] = time.monotonic
        self.keep_lease_s = MAX_LEASE_S  # until the reader sets its own (`lease_kept`)
        # the engine's KV connector, scheduler side; None: none built
        self.connector: KVConnectorScheduler | None = None
        # blocks staged for a prompt's last block, by request id (or the user request's)
        self._tails: dict[str, StagedTail] = {}
        # hashes of full blocks this step's scheduled chunks complete (until the commit)
        self._pending: set[BlockHash] = set()
        self.prefix_queries = 0  # tokens looked up at first admissions
        self.prefix_hits = 0  # of which served from the cache

    @property
    def frees_blocks(self) -> bool:
        """Whether `free_out_of_window` can release anything (some layer slides)."""
        return self.sliding_window is not None

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_table.row(request_id).tolist()

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached leading blocks of `req` and the tokens they cover; when
        they are all of the prompt's full blocks before its last token and a block was staged
        for `req`'s last one that continues them, that block too, with the tokens written in
        it (every token but the last when the partial block was imported; none when only
        the block was reserved).

        The last token is never served from the cache: its logits must be computed. Neither
        are prompt positions whose prompt logprobs are still to be emitted. Pure: the
        scheduler counts the hit (`record_admission`) once the request is admitted.
        """
        max_blocks = self._max_hit_blocks(req)
        if max_blocks <= 0:
            return [], 0
        hit = self.cached_prefix(req.update_block_hashes(self.block_size)[:max_blocks])
        num_hit = len(hit) * self.block_size
        tail = self._usable_tail(req, len(hit))
        if tail is not None:
            hit.append(tail.block)
            num_hit += len(tail.token_ids)
        return hit, num_hit

    def cached_prefix(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """The blocks of the leading run of `hashes` that the prefix cache holds (read-only:
        safe, if possibly stale, from another thread)."""
        run: list[KVBlock] = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            run.append(block)
        return run

    def _max_hit_blocks(self, req: Request) -> int:
        """How many leading full blocks of `req` a prefix hit may cover."""
        if not self.enable_caching:
            return 0
        limit = req.num_tokens - 1
        if req.prompt_logprobs_pos is not None:
            # position p's logits give prompt token p + 1's logprob: positions from the
            # first one not yet emitted must be computed
            limit = min(limit, req.prompt_logprobs_pos)
        return limit // self.block_size

    def pending_run(self, req: Request, num_blocks: int) -> int:
        """Tokens of `req`'s consecutive blocks after its first `num_blocks` (within what a
        hit may cover) that chunks of this step are computing: cached after the step."""
        if not self._pending:
            return 0
        hashes = req.update_block_hashes(self.block_size)
        end = self._max_hit_blocks(req)
        run = num_blocks
        while run < end and hashes[run] in self._pending:
            run += 1
        return (run - num_blocks) * self.block_size

    def record_admission(self, req: Request, num_hit: int) -> None:
        """Count a first admission's lookup: `req.num_tokens` queried, `num_hit` served (a
        re-admission after a preemption mostly hits what the request computed itself)."""
        if not req.num_preemptions:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_hit

    def new_step(self) -> None:
        """A step's scheduling begins: nothing is pending."""
        self._pending.clear()

    def _tail_key(self, req: Request) -> str | None:
        """Where `req`'s staged block is filed: under its own id, or under its user request's
        (n > 1 samples: the first one admitted takes it)."""
        if req.request_id in self._tails:
            return req.request_id
        if req.parent_id is not None and req.parent_id in self._tails:
            return req.parent_id
        return None

    def _usable_tail(self, req: Request, num_full: int) -> StagedTail | None:
        """`req`'s staged block if it is the prompt's last block, right after `num_full`
        leading blocks, and its tokens are the prompt's, on the request's first
        scheduling."""
        key = self._tail_key(req)
        tail = None if key is None else self._tails[key]
        if tail is None or tail.index != num_full or req.num_computed_tokens:
            return None
        start = num_full * self.block_size
        end = start + len(tail.token_ids)
        if end >= req.num_prompt_tokens or req.num_tokens != req.num_prompt_tokens:
            return None
        if (req.num_prompt_tokens - 1) // self.block_size != num_full:  # not its last block
            return None
        return tail if tuple(req.all_token_ids[start:end]) == tail.token_ids else None

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[KVBlock] | None = None,
                       max_free: int | None = None,
                       num_external_tokens: int = 0) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `computed` are prefix-hit blocks from `get_computed_blocks` (first scheduling only).
        Returns the newly allocated blocks, or None (nothing changed) if the pool is short or
        the allocation would take more than `max_free` blocks out of the free queue (fresh
        ones and revived cached ones). `num_external_tokens`: the first that many of the
        new tokens are loaded by the connector (told with the blocks), not computed.
        """
        computed = computed or []
        tail_key = self._tail_key(req)
        tail = None if tail_key is None else self._tails[tail_key]
        takes_tail = tail is not None and bool(computed) and computed[-1] is tail.block
        full = computed[:-1] if takes_tail else computed  # the staged tail is pinned already
        num_computed = req.num_computed_tokens + len(full) * self.block_size + (
            len(tail.token_ids) if takes_tail else 0)
        blocks = self._blocks.setdefault(req.request_id, [])
        total = num_computed + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed)
        # hit blocks already out of the first query's window: not taken (null entries)
        skip = min(len(full), self._out_of_window(req, num_computed)) if full else 0
        taken = full[skip:]
        revived = sum(1 for b in taken if b.ref_cnt == 0)
        free = self.pool.num_free_blocks()
        if need + revived > (free if max_free is None else min(free, max_free)):
            if not blocks:
                del self._blocks[req.request_id]
                self.block_table.drop(req.request_id)
            return None
        self.pool.touch(taken)
        if takes_tail:  # the staged tail's pin becomes the request's reference
            del self._tails[tail_key]
        if skip:
            computed = [self.null_block] * skip + computed[skip:]  # type: ignore[list-item]
            self._num_freed[req.request_id] = skip
        blocks.extend(computed)
        self._num_cached.setdefault(req.request_id, 0)
        if full:
            self._num_cached[req.request_id] = len(full)
        new = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new)
        added = [b.block_id for b in computed + new]
        self.block_table.append(req.request_id, added)
        if added and self.connector is not None:
            self.connector.update_state_after_alloc(req, added, num_external_tokens)
        if self.enable_caching:  # the full blocks this chunk completes: cached after the step
            end = min(total, req.num_tokens) // self.block_size
            start = self._num_cached[req.request_id]
            if end > start:
                self._pending.update(req.update_block_hashes(self.block_size)[start:end])
        return new

    def _out_of_window(self, req: Request, num_computed: int) -> int:
        """How many leading blocks of `req` no query from position `num_computed` on reads
        (0 without a window, and for `keep_kv` requests, whose blocks all stay)."""
        w = self.sliding_window
        if w is None or req.keep_kv:
            return 0
        return max(0, num_computed - w + 1) // self.block_size

    def free_out_of_window(self, req: Request) -> int:
        """Release `req`'s leading blocks that lie wholly before the window of its next
        query (position `num_computed_tokens`), once they are in the prefix cache; their
        entries become the null block. Call between steps (the scheduler does, as each
        step's scheduling begins). Returns how many were released."""
        rid = req.request_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return 0
        start = self._num_freed.get(rid, 0)
        end = min(len(blocks), self._out_of_window(req, req.num_computed_tokens))
        if end <= start:
            return 0
        if self.enable_caching:  # cached first: a freed block stays hittable until evicted
            self.commit_computed(req)
            end = min(end, self._num_cached[rid])
            if end <= start:
                return 0
        freed = blocks[start:end]
        blocks[start:end] = [self.null_block] * (end - start)  # type: ignore[list-item]
        self.block_table.clear(rid, start, end)
        self._num_freed[rid] = end
        self.pool.free_blocks(reversed(freed))  # the earliest is evicted last
        self.window_freed_blocks += end - start
        return end - start

    def max_blocks(self, num_tokens: int, step_tokens: int, keep: bool = False) -> int:
        """The most blocks a request of `num_tokens` tokens (prompt + max_tokens) holds at
        once when a step runs at most `step_tokens` of its tokens (`window_blocks`; a
        `keep` request, a `keep_kv` one, holds all of them)."""
        return window_blocks(num_tokens, self.block_size,
                             None if keep else self.sliding_window, step_tokens)

    def capacity_tokens(self, step_tokens: int) -> int:
        """The tokens the pool's usable blocks hold (what error messages quote)."""
        return self.pool.num_usable_blocks * self.block_size

    def resident_blocks(self, request_id: str) -> int:
        """Blocks `request_id` holds (its entries that are not the null block)."""
        return len(self._blocks.get(request_id, ())) - self._num_freed.get(request_id, 0)

    def commit_computed(self, req: Request) -> None:
        """Register `req`'s full blocks up to `req.num_computed_tokens` in the prefix cache
        (their `BlockStored` events go out). Call only once the forward that wrote them has
        completed."""
        if not self.enable_caching or req.request_id not in self._blocks:
            return
        start = self._num_cached[req.request_id]
        # accepted drafts are computed before they join all_token_ids: cached next step
        end = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = req.update_block_hashes(self.block_size)
        bs = self.block_size
        self.pool.cache_full_blocks(
            self._blocks[req.request_id][start:end], hashes[start:end], req.parent_hash(start),
            req.all_token_ids[start * bs : end * bs], bs, req.lora_name or "",
            req.hash_keys.adapter_id,
        )
        self._num_cached[req.request_id] = end

    def pin_cached(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """Pin the leading run of `hashes` that the prefix cache holds (a P/D decode side's
        local prefix, so it cannot be evicted before its request is admitted); `unpin`
        releases them."""
        pinned = self.cached_prefix(hashes)
        self.pool.touch(pinned)
        return pinned

    def free(self, req: Request, keep: bool = False, finished: bool = False) -> None:
        """Release every block of `req` (tail first, so the tail is evicted first); with
        `keep` (a normal finish of a `keep_kv` request) they stay pinned under a lease
        owned by the request id, for `keep_lease_s`, until `release_kept` or its expiry.
        With `finished` (a normal finish) the connector's `request_finished` decides
        instead whether and how long they are kept."""
        self.drop_tail(req.request_id)
        blocks = self._blocks.pop(req.request_id, None)
        self.block_table.drop(req.request_id)
        self._num_cached.pop(req.request_id, None)
        lease_s = self.keep_lease_s
        if blocks and finished and self.connector is not None:
            action = self.connector.request_finished(req, [b.block_id for b in blocks])
            keep, lease_s = action.keep, action.lease_s
        if self._num_freed.pop(req.request_id, 0) and blocks:
            blocks = [b for b in blocks if b is not self.null_block]
        if blocks and keep:
            stale = self.leases.of_owner(req.request_id)  # an earlier request of that id's
            if stale is not None:
                self.leases.release(stale.lease_id)
            self.leases.add(req.request_id, blocks, lease_s, self.clock())
        elif blocks:
            self.pool.free_blocks(reversed(blocks))

    def kept_blocks(self, request_id: str) -> list[KVBlock] | None:
        """The pinned blocks of a finished `keep_kv` request, in position order (None once
        released or expired)."""
        lease = self.leases.of_owner(request_id)
        return None if lease is None else self.leases.blocks(lease.lease_id)

    def release_kept(self, request_id: str) -> bool:
        """Unpin a finished `keep_kv` request's blocks; False if it kept none (any more)."""
        lease = self.leases.of_owner(request_id)
        return lease is not None and self.leases.release(lease.lease_id)

    # -- leases for readers outside the engine ---------------------------------------------
    def lease_kept(self, request_id: str, lease_s: float) -> PageLease | None:
        """The lease on a finished `keep_kv` request's blocks, now ending `lease_s` from
        now; None if it kept none (any more)."""
        lease = self.leases.of_owner(request_id)
        if lease is None:
            return None
        return self.leases.renew(lease.lease_id, lease_s, self.clock())

    def lease_cached(self, owner: str, hashes: list[BlockHash],
                     lease_s: float) -> PageLease:
        """Lease the leading run of `hashes` the prefix cache holds (possibly none) for
        `owner`'s reader."""
        run = self.pin_cached(hashes)
        try:
            return self.leases.add(owner, run, lease_s, self.clock())
        except BaseException:
            self.unpin(run)
            raise

    def lease_blocks(self, lease_id: str) -> list[KVBlock]:
        """A live lease's blocks; `LeaseError` once released or expired."""
        return self.leases.blocks(lease_id)

    def renew_lease(self, lease_id: str, lease_s: float) -> PageLease:
        return self.leases.renew(lease_id, lease_s, self.clock())

    def release_lease(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def expire_leases(self, now: float | None = None) -> list[PageLease]:
        """Unpin the leases whose time is up (engine thread: between steps)."""
        return self.leases.expire(self.clock() if now is None else now)

    def lease_stats(self) -> LeaseStats:
        return self.leases.stats()

    def import_blocks(self, hashes: list[BlockHash], tail: bool = False
                      ) -> tuple[list[KVBlock], list[int]]:
        """Pin blocks for a chain of full blocks arriving from another worker, all or none:
        hashes this cache already holds are reused, the rest get fresh blocks; with `tail`,
        one more fresh block follows them for the prompt's last block (its partial tokens,
        if any, and the last token: `stage_tail`), so the request needs no free block to be
        admitted. Returns (pinned blocks in chain order, indexes into the pinned list whose
        pages must be written), or ([], []) when the pool cannot supply them all: a partial
        import would hold blocks while its request might not fit in what is left. The
        caller writes the pages, then `commit_import` (and `stage_tail`). Nothing without
        prefix caching: imported blocks could never be hit."""
        if not self.enable_caching:
            return [], []
        found = [self.pool.get_cached_block(h) for h in hashes]
        fresh = [i for i, b in enumerate(found) if b is None]
        revived = sum(1 for b in found if b is not None and b.ref_cnt == 0)
        if len(fresh) + int(tail) + revived > self.pool.num_free_blocks():
            return [], []
        self.pool.touch([b for b in found if b is not None])  # before fresh ones evict them
        new = iter(self.pool.get_new_blocks(len(fresh) + int(tail)))
        pinned = [b if b is not None else next(new) for b in found]
        if tail:
            fresh.append(len(pinned))
            pinned.append(next(new))
        return pinned, fresh

    def stage_tail(self, request_id: str, block: KVBlock, index: int,
                   token_ids: list[int]) -> None:
        """Hand a pinned block, written with `token_ids` (0..block_size - 1 tokens), to
        request `request_id` (`StagedTail`) for its prompt's last block: its first
        scheduling takes it over when it continues the prefix hit; `free` or `drop_tail`
        release it otherwise. Takes over the caller's pin."""
        if not 0 <= len(token_ids) < self.block_size:
            raise ValueError(f"a staged block holds 0..{self.block_size - 1} tokens")
        self.drop_tail(request_id)
        self._tails[request_id] = StagedTail(block, index, tuple(token_ids))

    def staged_request_ids(self) -> set[str]:
        """Ids (a request's, or its user request's) with a staged block (P/D imports): such
        a request fits without a free block."""
        return set(self._tails)

    def drop_tail(self, request_id: str) -> None:
        """Release `request_id`'s staged tail unless its request took it over; idempotent."""
        tail = self._tails.pop(request_id, None)
        if tail is not None:
            self.pool.free_blocks([tail.block])

    def commit_import(self, pinned: list[KVBlock], hashes: list[BlockHash],
                      parent_hash: BlockHash, token_ids: list[int],
                      lora_name: str = "", lora_digest: str = "") -> None:
        """Register imported blocks (pages written) in the prefix cache; events go out.

        `pinned` is updated in place: where the cache came to hold a hash meanwhile (this
        worker computed the same block while the pages travelled), that block is pinned
        instead and the imported copy is released, so the pins always hold the blocks a
        prefix lookup returns."""
        n = len(pinned)
        self.pool.cache_full_blocks(pinned, hashes[:n], parent_hash,
                                    token_ids[: n * self.block_size], self.block_size,
                                    lora_name, lora_digest)
        for i, (block, h) in enumerate(zip(pinned, hashes, strict=False)):
            cached = self.pool.get_cached_block(h)
            if cached is not None and cached is not block:
                self.pool.touch([cached])
                self.pool.free_blocks([block])
                pinned[i] = cached

    def unpin(self, blocks: list[KVBlock]) -> None:
        """Drop `import_blocks` pins (tail first)."""
        self.pool.free_blocks(reversed(blocks))

    def usage(self) -> float:
        return self.pool.usage()

    def unused_slots(self, requests: list[Request]) -> int:
        """KV slots allocated to `requests` but not (yet) holding a computed token."""
        return sum(len(self._blocks.get(r.request_id, ())) * self.block_size
                   - r.num_computed_tokens for r in requests)
