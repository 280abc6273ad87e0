"""The prefill/decode connector ("pd"): the engine side of P/D disaggregation, whose
transport is `tandem.kvtransfer`.

Sending (prefill worker): the prompt runs as a `keep_blocks` request; when it finishes its
blocks stay pinned under a lease owned by its request id (`request_finished`), which the
transport sets to the decode worker's `lease_s` (`lease_kept`), reads through `page_source`
and ends with `release` on the decode worker's acknowledgement, or leaves to expire (the
engine thread unpins it; `lease_stats` counts it). With `save_layers`, each layer's pages
are handed to the transport as soon as the prompt's last step has written them
(`save_kv_layer`), whatever the tensor-parallel size: with one rank the transport reads each
layer from the cache, with several every rank hands rank 0 its heads of the prompt's blocks
right after writing the layer and the transport reads the assembled full-head pages
(`saved_page_source` is the same `PageSource`-like reader either way).

Receiving (decode worker): pages land before the request is added (`import_blocks`,
`page_sink`, `commit_import`, which stages the prompt's last block), so the scheduler's
prefix lookup finds them: nothing loads during a step (`get_num_new_matched_tokens` is 0,
`start_load_kv` has nothing to start).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.engine.kv_connector.base import (
    ConnectorMetadata,
    ExternalMatch,
    FinishAction,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    LayerSaver,
    register,
)

if TYPE_CHECKING:
    import torch

    from tandem.engine.async_api import EngineAPI, PageSink, PageSource
    from tandem.engine.kv_cache.block_pool import KVBlock
    from tandem.engine.kv_cache.leases import LeaseStats, PageLease
    from tandem.engine.kv_cache.manager import KVCacheManager
    from tandem.engine.kv_pages import ImportCommit, ImportPins, PageLayout
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.request import Request
    from tandem.protocol.block_hash import BlockHash

logger = logging.getLogger(__name__)


class PDScheduler(KVConnectorScheduler):
    """Imports are committed before their request is added: nothing loads during a step;
    a finished `keep_kv` request's blocks are kept under a lease of `kv.keep_lease_s`."""

    def __init__(self, kv: KVCacheManager, saving: dict[str, LayerSaver]) -> None:
        self.kv = kv
        self._saving = saving  # request id -> saver (`PDConnector.save_layers`)
        self._saves: dict[str, tuple[int, ...]] = {}

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> ExternalMatch:
        return ExternalMatch(0, False)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        if rid in self._saving:
            self._saves[rid] = self._saves.get(rid, ()) + tuple(block_ids)
        if len(self._saves) > len(self._saving):  # some are no longer saved: forget them
            self._saves = {r: ids for r, ids in self._saves.items() if r in self._saving}

    def build_connector_meta(self) -> ConnectorMetadata:
        saves, self._saves = self._saves, {}
        return ConnectorMetadata({}, saves)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> FinishAction:
        """A `keep_kv` request's blocks are kept for their reader; others are freed."""
        return FinishAction(request.keep_kv, self.kv.keep_lease_s)


class PDWorker(KVConnectorWorker):
    """Hands each written layer of a saved request to its transport's `LayerSaver`; with
    tensor parallelism it keeps the layer's full-head pages gathered from the ranks until
    the save ends (`saved_layer`)."""

    def __init__(self, saving: dict[str, LayerSaver]) -> None:
        self._saving = saving
        # request id -> (its block table at `begin`, layer -> gathered pages); TP only
        self._gathered: dict[str, tuple[list[int], dict[int, torch.Tensor]]] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layout: PageLayout | None = None

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           layout: PageLayout) -> None:
        self.kv_caches, self.layout = kv_caches, layout

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        if metadata.loads:  # the scheduler side never asks for one
            raise ValueError("the pd connector loads pages before admission, not in a step")

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def begin_save(self, request_id: str, block_ids: list[int]) -> None:
        saver = self._saving.get(request_id)
        if saver is not None:  # a rerun (after a preemption) starts afresh
            self._gathered[request_id] = (list(block_ids), {})
            saver.begin(block_ids)

    def save_kv_layer(self, request_id: str, layer: int, event: Any | None,
                      pages: torch.Tensor | None = None) -> None:
        saver = self._saving.get(request_id)
        if saver is None:
            return
        entry = self._gathered.get(request_id)
        if pages is not None and entry is not None:  # TP: the layer gathered from the ranks
            entry[1][layer] = pages
        saver.layer_done(layer, event)

    def saved_layer(self, request_id: str, layer: int, block_ids: list[int]) -> torch.Tensor:
        """Layer `layer`'s gathered pages of `block_ids` (some of the request's blocks at
        `begin`), `[2, n, KVH, bs, row]` on the host; ValueError before it is saved."""
        table, layers = self._gathered.get(request_id, ([], {}))
        if layer not in layers:
            raise ValueError(f"layer {layer} of {request_id!r} has not been saved")
        pos = {b: i for i, b in enumerate(table)}
        if any(b not in pos for b in block_ids):
            raise ValueError(f"blocks {block_ids} are not all among {request_id!r}'s saved "
                             "ones")
        at = [pos[b] for b in block_ids]
        pages = layers[layer]
        if at and at == list(range(at[0], at[0] + len(at))):  # a run: a view, no copy
            return pages[:, at[0]:at[0] + len(at)]
        return pages[:, at]

    def end_save(self, request_id: str) -> None:
        self._gathered.pop(request_id, None)

    def wait_for_save(self) -> None:
        return None  # the transport reads each layer on its own stream once `event` is done


class _SaveObserver:
    """The model runner's layer observer for one saved request: forwards to the worker."""

    def __init__(self, worker: PDWorker, request_id: str) -> None:
        self.worker, self.request_id = worker, request_id

    def begin(self, block_ids: list[int]) -> None:
        self.worker.begin_save(self.request_id, block_ids)

    def layer_done(self, layer: int, event: Any | None,
                   pages: torch.Tensor | None = None) -> None:
        self.worker.save_kv_layer(self.request_id, layer, event, pages)


class _GatheredSource:
    """`PageSource`'s reader over a saved request's layers as gathered from the tensor-parallel
    ranks (`PDWorker.saved_layer`): `layer(i)` once layer i is saved; nothing to read in
    place."""

    def __init__(self, worker: PDWorker, request_id: str, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self._worker, self._request_id = worker, request_id
        self.gather_into = None

    def layer(self, layer: int) -> torch.Tensor:
        return self._worker.saved_layer(self._request_id, layer, self.block_ids)

    def views(self, layer: int) -> list[memoryview] | None:
        return None


@register("pd")
class PDConnector(KVConnector):
    def __init__(self, engine: EngineAPI) -> None:
        self._engine = engine
        core: LLMEngine = engine.engine
        self._saving: dict[str, LayerSaver] = {}
        self.scheduler = PDScheduler(core.kv, self._saving)
        self.worker = PDWorker(self._saving)
        self.attach(core)  # told of allocations, finishes and steps from now on

    # -- what both ends share --------------------------------------------------------------
    def layout(self, model_id: str) -> PageLayout:
        return self._engine.page_layout(model_id)

    @property
    def device(self) -> torch.device:
        return self._engine.device  # the KV cache's

    @property
    def prefix_caching(self) -> bool:
        return self._engine.prefix_caching

    def cached_prefix_len(self, hashes: list[BlockHash]) -> int:
        return self._engine.cached_prefix_len(hashes)

    # -- sending ---------------------------------------------------------------------------
    async def lease_kept(self, request_id: str, lease_s: float) -> PageLease | None:
        return await self._engine._call(lambda e: e.kv.lease_kept(request_id, lease_s))

    async def lease_cached(self, owner: str, hashes: list[BlockHash],
                           lease_s: float) -> PageLease:
        return await self._engine._call(lambda e: e.kv.lease_cached(owner, hashes, lease_s))

    async def renew(self, lease: PageLease, lease_s: float) -> PageLease:
        return await self._engine._call(lambda e: e.kv.renew_lease(lease.lease_id, lease_s))

    async def release(self, lease: PageLease | str) -> bool:
        lease_id = lease if isinstance(lease, str) else lease.lease_id
        return await self._engine._call(lambda e: e.kv.release_lease(lease_id))

    async def release_kept(self, request_id: str) -> bool:
        return await self._engine.release_kept(request_id)

    async def page_source(self, lease: PageLease, start: int = 0,
                          count: int | None = None) -> PageSource:
        def ids(e: LLMEngine) -> list[int]:  # raises LeaseError once it has ended
            blocks = e.kv.lease_blocks(lease.lease_id)
            end = len(blocks) if count is None else start + count
            if not 0 <= start <= end <= len(blocks):
                raise ValueError(f"blocks [{start}, {end}) of a lease on {len(blocks)}")
            return [b.block_id for b in blocks[start:end]]

        return await self._engine.page_source(await self._engine._call(ids))

    async def saved_page_source(self, request_id: str,
                                block_ids: list[int]) -> PageSource | _GatheredSource:
        if request_id not in self._saving:
            raise ValueError(f"{request_id!r}'s layers are not being saved")
        if self._engine.kv_in_place:  # one rank: each layer read from the cache once saved
            return await self._engine.page_source(block_ids)
        return _GatheredSource(self.worker, request_id, block_ids)

    def save_layers(self, request_id: str, saver: LayerSaver) -> bool:
        self._saving[request_id] = saver
        self._engine.observe_layers(request_id, _SaveObserver(self.worker, request_id))
        return True

    def unsave_layers(self, request_id: str) -> None:
        self._engine.unobserve_layers(request_id)
        self._saving.pop(request_id, None)
        self.worker.end_save(request_id)

    def lease_stats(self) -> LeaseStats:
        return self._engine.engine.kv.lease_stats()

    # -- receiving -------------------------------------------------------------------------
    async def pin_cached(self, hashes: list[BlockHash]) -> list[KVBlock]:
        return await self._engine.pin_cached(hashes)

    async def import_blocks(self, hashes: list[BlockHash], tail: bool = False) -> ImportPins:
        return await self._engine.import_blocks(hashes, tail)

    def page_sink(self, block_ids: list[int]) -> PageSink:
        return self._engine.page_sink(block_ids)

    async def commit_import(self, pins: ImportPins, commit: ImportCommit) -> list[KVBlock]:
        return await self._engine.commit_import(pins, commit)

    async def unpin(self, blocks: Sequence[KVBlock], *, limit: int | None = None,
                    drop_tail: str | None = None) -> None:
        await self._engine.unpin(blocks, limit=limit, drop_tail=drop_tail)
