"""Per-request block allocation on top of the `BlockPool`, with prefix-cache lookups.

Check/act pairs as in nano-vllm: `get_computed_blocks` finds a prefix hit without side
effects; `allocate_slots` takes the blocks or returns None when the pool is too small.
"""

from __future__ import annotations

from tandem.engine.kv_cache.block_pool import BlockPool, KVBlock
from tandem.engine.request import Request
from tandem.protocol.block_hash import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to their blocks; the block table of a request is `block_ids(req)`."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 enable_events: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_events)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks registered in the hash map
        self._kept: dict[str, list[KVBlock]] = {}  # finished requests' pinned blocks
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which served from it

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached leading blocks of `req` and the tokens they cover.

        The last token is never served from the cache: its logits must be computed.
        """
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `computed` are prefix-hit blocks from `get_computed_blocks` (first scheduling only).
        Returns the newly allocated blocks, or None (nothing changed) if the pool is short.
        """
        computed = computed or []
        blocks = self._blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if need + revived > self.pool.num_free_blocks():
            if not blocks:
                del self._blocks[req.request_id]
            return None
        self.pool.touch(computed)
        blocks.extend(computed)
        self._num_cached.setdefault(req.request_id, 0)
        if computed:
            self._num_cached[req.request_id] = len(blocks)
        new = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new)
        self._cache_blocks(req, min(total, req.num_tokens))
        return new

    def _cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once `num_tokens` tokens are computed."""
        if not self.enable_caching:
            return
        start = self._num_cached[req.request_id]
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = req.update_block_hashes(self.block_size)
        bs = self.block_size
        self.pool.cache_full_blocks(
            self._blocks[req.request_id][start:end], hashes[start:end], req.parent_hash(start),
            req.all_token_ids[start * bs : end * bs], bs,
        )
        self._num_cached[req.request_id] = end

    def free(self, req: Request, keep: bool = False) -> None:
        """Release every block of `req` (tail first, so the tail is evicted first); with
        `keep` they stay referenced under the request id until `release_kept`."""
        blocks = self._blocks.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        if blocks and keep:
            self._kept[req.request_id] = blocks
        elif blocks:
            self.pool.free_blocks(reversed(blocks))

    def kept_blocks(self, request_id: str) -> list[KVBlock] | None:
        """The pinned blocks of a finished `keep_kv` request, in position order."""
        return self._kept.get(request_id)

    def release_kept(self, request_id: str) -> bool:
        blocks = self._kept.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        return blocks is not None

    def import_blocks(self, hashes: list[BlockHash]) -> tuple[list[KVBlock], list[int]]:
        """Pin blocks for a chain of full blocks arriving from another worker: hashes this
        cache already holds are reused, the rest get fresh blocks. Returns (pinned blocks in
        chain order, indexes into `hashes` whose pages must be written). Stops at the first
        block the pool cannot supply. The caller writes the pages, then `commit_import`."""
        pinned: list[KVBlock] = []
        fresh: list[int] = []
        for i, h in enumerate(hashes):
            block = self.pool.get_cached_block(h)
            if block is not None:
                self.pool.touch([block])
            elif self.pool.num_free_blocks() > 0:
                block = self.pool.get_new_blocks(1)[0]
                fresh.append(i)
            else:
                break
            pinned.append(block)
        return pinned, fresh

    def commit_import(self, pinned: list[KVBlock], hashes: list[BlockHash],
                      parent_hash: BlockHash, token_ids: list[int]) -> None:
        """Register imported blocks (pages written) in the prefix cache; events go out."""
        n = len(pinned)
        self.pool.cache_full_blocks(pinned, hashes[:n], parent_hash,
                                    token_ids[: n * self.block_size], self.block_size)

    def unpin(self, blocks: list[KVBlock]) -> None:
        """Drop `import_blocks` pins (tail first)."""
        self.pool.free_blocks(reversed(blocks))

    def usage(self) -> float:
        return self.pool.usage()

    def unused_slots(self, requests: list[Request]) -> int:
        """KV slots allocated to `requests` but not (yet) holding a computed token."""
        return sum(len(self._blocks.get(r.request_id, ())) * self.block_size
                   - r.num_computed_tokens for r in requests)
