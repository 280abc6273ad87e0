"""Per-request block allocation on top of the `BlockPool`, with prefix-cache lookups.

Check/act pairs as in nano-vllm: `get_computed_blocks` finds a prefix hit without side
effects; `allocate_slots` takes the blocks or returns None when the pool is too small.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.kv_cache.block_pool import BlockPool, KVBlock
from tandem.engine.request import Request
from tandem.protocol.block_hash import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StagedTail:
    """A prompt's partial last block imported for one request (`stage_tail`): slots
    [0, len(token_ids)) of `block` hold the KV of `token_ids`, the prompt's tokens from
    position `index * block_size` up to, not including, its last token."""

    block: KVBlock
    index: int  # the block's position in the prompt: the full blocks before it
    token_ids: tuple[int, ...]


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
        self._tails: dict[str, StagedTail] = {}  # imported partial blocks, by request id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which served from it

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached leading blocks of `req` and the tokens they cover; when
        they are all of the prompt's full blocks before its last token and a tail was staged
        for `req` that continues them, that partial block too (then every token but the last
        is covered).

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
        num_hit = len(hit) * self.block_size
        tail = self._usable_tail(req, len(hit))
        if tail is not None:
            hit.append(tail.block)
            num_hit += len(tail.token_ids)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_hit
        return hit, num_hit

    def _usable_tail(self, req: Request, num_full: int) -> StagedTail | None:
        """`req`'s staged tail if it continues `num_full` leading blocks up to the prompt's
        last token, on the request's first scheduling."""
        tail = self._tails.get(req.request_id)
        if tail is None or tail.index != num_full or req.num_computed_tokens:
            return None
        start = num_full * self.block_size
        end = start + len(tail.token_ids)
        if end != req.num_prompt_tokens - 1 or req.num_tokens != req.num_prompt_tokens:
            return None
        return tail if tuple(req.all_token_ids[start:end]) == tail.token_ids else None

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `computed` are prefix-hit blocks from `get_computed_blocks` (first scheduling only).
        Returns the newly allocated blocks, or None (nothing changed) if the pool is short.
        """
        computed = computed or []
        tail = self._tails.get(req.request_id)
        takes_tail = tail is not None and bool(computed) and computed[-1] is tail.block
        full = computed[:-1] if takes_tail else computed  # the staged tail is pinned already
        num_computed = req.num_computed_tokens + len(full) * self.block_size + (
            len(tail.token_ids) if takes_tail else 0)
        blocks = self._blocks.setdefault(req.request_id, [])
        total = num_computed + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed)
        revived = sum(1 for b in full if b.ref_cnt == 0)
        if need + revived > self.pool.num_free_blocks():
            if not blocks:
                del self._blocks[req.request_id]
            return None
        self.pool.touch(full)
        if takes_tail:  # the staged tail's pin becomes the request's reference
            del self._tails[req.request_id]
        blocks.extend(computed)
        self._num_cached.setdefault(req.request_id, 0)
        if full:
            self._num_cached[req.request_id] = len(full)
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
        self.drop_tail(req.request_id)
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

    def import_blocks(self, hashes: list[BlockHash], tail: bool = False
                      ) -> tuple[list[KVBlock], list[int]]:
        """Pin blocks for a chain of full blocks arriving from another worker: hashes this
        cache already holds are reused, the rest get fresh blocks. With `tail`, one more
        fresh block follows them for the prompt's partial last block (only when every full
        block was pinned). Returns (pinned blocks in chain order, indexes into the pinned
        list whose pages must be written). Stops at the first block the pool cannot supply.
        The caller writes the pages, then `commit_import` (and `stage_tail`)."""
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
        if tail and len(pinned) == len(hashes) and self.pool.num_free_blocks() > 0:
            fresh.append(len(pinned))
            pinned.append(self.pool.get_new_blocks(1)[0])
        return pinned, fresh

    def stage_tail(self, request_id: str, block: KVBlock, index: int,
                   token_ids: list[int]) -> None:
        """Hand a pinned, written partial block to request `request_id` (`StagedTail`): its
        first scheduling takes it over when it continues the prefix hit; `free` or
        `drop_tail` release it otherwise. Takes over the caller's pin."""
        if not 0 < len(token_ids) < self.block_size:
            raise ValueError(f"a tail holds 1..{self.block_size - 1} tokens")
        self.drop_tail(request_id)
        self._tails[request_id] = StagedTail(block, index, tuple(token_ids))

    def drop_tail(self, request_id: str) -> None:
        """Release `request_id`'s staged tail unless its request took it over; idempotent."""
        tail = self._tails.pop(request_id, None)
        if tail is not None:
            self.pool.free_blocks([tail.block])

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
