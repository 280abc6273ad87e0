"""The KV offload connector ("offload"): host-memory and disk tiers (`engine/kv_tiers`)
under the device pool, composed with the P/D connector (its page API, sends and imports
work unchanged, so a prefill or decode worker can have tiers too).

Saving: the device pool tells the connector of every cached block it evicts, before the
block's memory is reused (`BlockPool.track_evictions`); the connector copies the blocks'
pages (every layer, every KV head: `PageIO.read`) and hands them to the tier store, whose
offload thread encodes them (digest, compression) and spills to disk what the host tier
pushes out. So every block the pool evicts is saved, and blocks that are never evicted cost
nothing. (vLLM's offloading connector stores blocks as they are computed instead.)

Loading: at admission, after the local prefix hit, `get_num_new_matched_tokens` fetches the
leading run of the request's next blocks from the tiers, each verified against the request's
own chain hash at its position, the layout, dtype and adapter digest (`TierStore.fetch`);
the run stops at the first block not held or not verifying (dropped from its tier), so what
the answer counts is exactly what loads, and the rest is computed. The fetched pages are
staged for the step: `wait_for_layer_load(i)` writes layer i's into the request's blocks
before layer i attends. A request asked and not admitted (it did not fit) keeps its stage
for the next step, where it is asked again at the same position (no tier read while it
waits at the head of the queue); a stage not asked for again in a step is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.block_pool import BlockPool, EvictedBlock
from tandem.engine.kv_connector.base import (
    ConnectorMetadata,
    ExternalMatch,
    FinishAction,
    KVConnectorScheduler,
    KVConnectorWorker,
    PageLease,
    register,
)
from tandem.engine.kv_connector.pd import PDConnector, PDScheduler, PDWorker
from tandem.engine.kv_tiers.codec import BlockMeta
from tandem.engine.kv_tiers.store import EventInfo, TierStore

if TYPE_CHECKING:
    from tandem.engine.async_api import EngineAPI
    from tandem.engine.kv_pages import PageLayout
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadMeta(ConnectorMetadata):
    """The step's loads with their verified pages (`[L, 2, 1, KVH, bs, row]` per block, in
    the order of the block ids)."""

    pages: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)


class OffloadScheduler(KVConnectorScheduler):
    def __init__(self, pd: PDScheduler, store: TierStore, block_size: int,
                 page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.pd, self.store, self.bs = pd, store, block_size
        self.page_shape, self.dtype = page_shape, dtype
        # request id -> (first block, end block, the run's verified pages)
        self._staged: dict[str, tuple[int, int, list[torch.Tensor]]] = {}
        self._asked: set[str] = set()  # this step's
        self._loads: dict[str, tuple[tuple[int, ...], tuple[torch.Tensor, ...]]] = {}

    @property
    def staged_blocks(self) -> int:
        """Blocks fetched and not yet handed to a step: a request asked and not admitted
        keeps its run until the next step's build, no longer."""
        return sum(len(p) for _, _, p in self._staged.values())

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> ExternalMatch:
        rid = request.request_id
        staged = self._staged.pop(rid, None)
        if num_computed_tokens % self.bs:
            return ExternalMatch(0)
        hashes = request.update_block_hashes(self.bs)
        first = num_computed_tokens // self.bs
        # the scheduler loads at most up to the last prompt token: fetch no further
        end = min(len(hashes), -(-(len(request.all_token_ids) - 1) // self.bs))
        if staged is not None and staged[:2] == (first, end):  # not admitted last step
            pages = staged[2]
        else:
            pages = self.fetch_run(hashes[first:end], request.hash_keys.adapter_id)
        if not pages:
            return ExternalMatch(0)
        self._staged[rid] = (first, end, pages)
        self._asked.add(rid)
        return ExternalMatch(len(pages) * self.bs)

    def fetch_run(self, hashes: Sequence[bytes], lora_digest: str) -> list[torch.Tensor]:
        """The verified pages of the leading run of `hashes` the tiers hold (engine thread;
        stops at the first block not held or not verifying, which is dropped)."""
        pages: list[torch.Tensor] = []
        for h in hashes:
            got = self.store.fetch(h, self.page_shape, self.dtype, lora_digest)
            if got is None:
                break
            pages.append(got)
        return pages

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        self.pd.update_state_after_alloc(request, block_ids, num_external_tokens)
        staged = self._staged.pop(request.request_id, None)
        if num_external_tokens and staged is not None:
            first, _, pages = staged
            n = -(-num_external_tokens // self.bs)
            self._loads[request.request_id] = (tuple(block_ids[first:first + n]),
                                               tuple(pages[:n]))

    def build_connector_meta(self) -> OffloadMeta:
        saves = self.pd.build_connector_meta().saves
        loads, self._loads = self._loads, {}
        # asked and not admitted this step: kept for the next; older stages dropped
        self._staged = {r: s for r, s in self._staged.items() if r in self._asked}
        self._asked = set()
        return OffloadMeta({r: ids for r, (ids, _) in loads.items()}, saves,
                           {r: pages for r, (_, pages) in loads.items()})

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> FinishAction:
        return self.pd.request_finished(request, block_ids)


class OffloadWorker(KVConnectorWorker):
    """Writes a step's loaded pages layer by layer; saves and sends go to the P/D side."""

    def __init__(self, pd: PDWorker) -> None:
        self.pd = pd
        self._step: list[tuple[list[int], tuple[torch.Tensor, ...]]] = []

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           layout: PageLayout) -> None:
        self.pd.pages = self.pages
        self.pd.register_kv_caches(kv_caches, layout)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self.pd.start_load_kv(ConnectorMetadata({}, metadata.saves))
        pages = getattr(metadata, "pages", {})
        self._step = [(list(ids), pages[r]) for r, ids in metadata.loads.items()]

    def wait_for_layer_load(self, layer: int) -> None:
        assert self.pages is not None
        for ids, pages in self._step:
            self.pages.write(layer, ids, torch.cat([p[layer] for p in pages], dim=1))

    def save_kv_layer(self, request_id: str, layer: int, event: Any | None,
                      pages: torch.Tensor | None = None) -> None:
        self.pd.save_kv_layer(request_id, layer, event, pages)

    def wait_for_save(self) -> None:
        self._step = []
        self.pd.wait_for_save()


@register("offload")
class OffloadConnector(PDConnector):
    """The P/D connector's page API, with the KV tiers as its scheduler and worker sides'
    loads and the device pool's evictions as their saves. The engine's config gives the
    tiers (`kv_offload_*`)."""

    loads_kv = True

    def __init__(self, engine: EngineAPI) -> None:
        super().__init__(engine)
        core: LLMEngine = engine.engine
        cfg = core.config
        pool = core.kv.pool
        if type(pool) is not BlockPool or pool.reported is not None:
            raise ConfigError("KV offload needs one KV block table (a hybrid model's "
                              "cache groups are not offloaded)")
        if pool.null_block is not None:
            raise ConfigError("KV offload does not serve sliding-window models (their block "
                              "tables point out-of-window positions at a shared null block)")
        if not core.kv.enable_caching:
            raise ConfigError("KV offload needs prefix caching")
        layout = core.page_layout("")
        self.page_shape = (layout.num_layers, 2, 1, layout.num_kv_heads,
                           *core.runner.kv_caches[0][0].shape[2:])
        self.store = TierStore(cfg.kv_offload_host_bytes, cfg.kv_offload_disk_path,
                               cfg.kv_offload_disk_bytes, cfg.kv_offload_compression,
                               events_enabled=cfg.enable_kv_events)
        self.block_size = core.kv.block_size
        self.pd_scheduler, self.pd_worker = self.scheduler, self.worker
        self.scheduler = OffloadScheduler(self.pd_scheduler, self.store, self.block_size,
                                          self.page_shape, layout.dtype)
        self.worker = OffloadWorker(self.pd_worker)
        self.attach(core)
        core.kv_tiers = self.store
        pool.track_evictions(self._save)

    def load_into_cache(self, core: LLMEngine, hashes: list[bytes], parent_hash: bytes,
                        token_ids: list[int], lora_name: str = "",
                        lora_digest: str = "") -> int:
        """Engine thread: load the leading run of `hashes` (a chain after `parent_hash`,
        holding `token_ids`, one block's worth each) the tiers hold into fresh device
        blocks, registered in the prefix cache as computed, as an admission's tier load
        would (`fetch_run`'s verification). Returns how many blocks now sit in the device
        pool's cache (0 when none is held or the pool has no room for the run); the blocks
        are left unpinned: the caller pins them before anything else runs."""
        pages = self.scheduler.fetch_run(hashes, lora_digest)
        if not pages:
            return 0
        n = len(pages)
        pinned, fresh = core.kv.import_blocks(hashes[:n])
        if not pinned:
            return 0
        try:
            io = self.worker.pages
            assert io is not None
            if fresh:
                ids = [pinned[i].block_id for i in fresh]
                for layer in range(self.page_shape[0]):
                    io.write(layer, ids, torch.cat([pages[i][layer] for i in fresh], dim=1))
                flush = getattr(io, "flush", None)
                if flush is not None:
                    flush()
            core.kv.commit_import(pinned, hashes[:n], parent_hash,
                                  token_ids[: n * self.block_size], lora_name, lora_digest)
        finally:
            core.kv.unpin(pinned)
        return n

    async def lease_with_tiers(self, owner: str, hashes: list[bytes], parent_hash: bytes,
                               token_ids: list[int], lora_name: str, lora_digest: str,
                               lease_s: float) -> PageLease:
        """A lease on the leading run of `hashes` (a chain after `parent_hash`) this worker
        can serve: the device pool's cached run, then the blocks after it the tiers hold,
        loaded into the cache first (`load_into_cache`). A tier block that is missing or
        fails verification ends the run there; with no room in the pool the device run alone
        is leased. One engine-thread call, between two steps."""
        bs = self.block_size

        def load_and_lease(e: LLMEngine) -> PageLease:
            # pin the device run first: the tier load's fresh blocks must not evict it
            head = e.kv.lease_cached(owner, hashes, lease_s)
            n = len(head.block_ids)
            if n == len(hashes) or self.store.holds(hashes[n]) is None:
                return head
            try:
                loaded = self.load_into_cache(e, hashes[n:], hashes[n - 1] if n else parent_hash,
                                              token_ids[n * bs:], lora_name, lora_digest)
            except Exception:  # noqa: BLE001 - a failed load serves the device run
                logger.exception("[%s] loading KV tier blocks into the cache failed", owner)
                return head
            if not loaded:
                return head
            logger.info("[%s] %d blocks loaded from the KV tiers", owner, loaded)
            e.kv.release_lease(head.lease_id)
            return e.kv.lease_cached(owner, hashes, lease_s)

        return await self._engine._call(load_and_lease)

    def _save(self, blocks: list[EvictedBlock]) -> None:
        """Engine thread, inside the allocation that evicts `blocks`: copy their pages out
        (one host copy) before the memory is reused; the store holds each block as views
        into it by layer and stacks and encodes them on its own thread."""
        assert self.worker.pages is not None
        layers = self.worker.pages.read([b.block_id for b in blocks])
        self.store.save([(BlockMeta(b.block_hash, b.parent_hash, b.lora_digest),
                          EventInfo(b.parent_hash, b.token_ids, self.block_size, b.lora_name,
                                    b.lora_digest), [p[:, j:j + 1] for p in layers])
                         for j, b in enumerate(blocks)])

    async def close(self) -> None:
        self.store.close()
