"""`AsyncLLMEngine`'s typed surface for callers outside the engine (serving, kvtransfer).

Coroutines run on the engine thread between steps and, once sent, run even if their caller
is cancelled while waiting (a release or unpin is never lost). Properties are read on the
caller's thread without locking: they are set at start-up, or (the LoRA manager's tables,
the prefix cache) read as a snapshot whose staleness only moves work.

Pages move the same way whatever the tensor-parallel size: `page_source` gives a send's pages
layer by layer (read in place with one rank, exported from the ranks at once with several),
`page_sink` writes an import's (into the cache as each layer arrives with one rank, handed to
the ranks at `finish` with several). Callers never learn how many ranks there are.

A KV transport (kvtransfer) calls only the engine's `kv_connector` (`engine/kv_connector`),
built on first use from `kv_connector_name`: the typed page API with leases, over these
coroutines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tandem.engine.kv_cache.pages import (
    block_index,
    gather_layer,
    host_pages_into,
    scatter_layer,
    scatter_layer_digest,
    scatter_targets,
)
from tandem.engine.kv_pages import ImportCommit, ImportPins, layer_page_views

if TYPE_CHECKING:
    import numpy as np
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.core import EngineState
    from tandem.engine.kv_cache.block_pool import KVBlock
    from tandem.engine.kv_connector.base import KVConnector
    from tandem.engine.kv_pages import PageLayout
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.lora.manager import LoRAManager
    from tandem.engine.lora.peft import LoRAAdapter
    from tandem.engine.lora.request import LoRARequest
    from tandem.engine.model_runner import LayerObserver
    from tandem.engine.request import TokenizedPrompt
    from tandem.engine.sampling_params import SamplingParams
    from tandem.protocol.block_hash import BlockHash
    from tandem.protocol.tokenizer import Tokenizer

T = TypeVar("T")


def unstarted_ids(e: LLMEngine) -> set[str]:
    """Engine thread: `unstarted_request_ids`."""
    waiting, started = set(), set()
    for r in e.scheduler.waiting_requests():
        (started if r.output_token_ids else waiting).add(r.parent_id or r.request_id)
    started.update(r.parent_id or r.request_id for r in e.scheduler.running)
    return waiting - started


class EngineAPI:
    """Mixed into `AsyncLLMEngine`, which provides `engine` and `_call`."""

    engine: LLMEngine
    kv_connector_name = "pd"  # `engine/kv_connector`'s registry
    _kv_connector: KVConnector | None = None

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        raise NotImplementedError

    # -- read-only views -------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        """What the engine serves: model, block size, KV blocks, max_model_len, vocab."""
        return self.engine.state

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def lora(self) -> LoRAManager | None:
        """The LoRA manager (None without --enable-lora); its tables are read as is."""
        return self.engine.lora

    def lora_digest(self, name: str | None) -> str | None:
        """The weight digest of loaded adapter `name` (None: no name, no LoRA, or not
        loaded)."""
        lora = self.engine.lora
        if not name or lora is None:
            return None
        return lora.digests.get(name)

    def process_prompt(self, prompt: str | list[int] | TokenizedPrompt) -> TokenizedPrompt:
        """Tokenize and check a prompt as `add` would (any thread: it reads no state)."""
        return self.engine.process_prompt(prompt)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile `params`' structured-output grammar now (any thread; it blocks for the
        compile, so not the event loop): `InvalidRequestError(param="structured_outputs")`
        when the engine cannot compile it. The engine's own compile is then a cache hit."""
        self.engine.check_structured_outputs(params)

    @property
    def prefix_caching(self) -> bool:
        """Whether the prefix cache is on (imported blocks could never be hit without)."""
        return self.engine.kv.enable_caching

    def cached_prefix_len(self, hashes: list[BlockHash]) -> int:
        """How many leading `hashes` the prefix cache holds, read without locking (a stale
        answer only moves work between P/D sides)."""
        return len(self.engine.kv.cached_prefix(hashes))

    def page_layout(self, model_id: str) -> PageLayout:
        """The wire layout of this engine's KV pages (`LLMEngine.page_layout`)."""
        return self.engine.page_layout(model_id)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's per-layer (K, V) caches; every KV head only when `kv_in_place`."""
        return self.engine.runner.kv_caches

    @property
    def kv_in_place(self) -> bool:
        """Whether other threads may read and write pinned pages in `kv_caches` directly
        (one rank); otherwise pages move only through `export_pages` / `import_pages`."""
        return self.engine.kv_in_place

    @property
    def layer_streaming(self) -> bool:
        """Whether a send can follow a running step layer by layer (`observe_layers`): any
        tensor-parallel size (with several, each layer's pages are gathered from the ranks
        as soon as it is written)."""
        return True

    def observe_layers(self, request_id: str, observer: LayerObserver) -> None:
        """Tell `observer` as each layer of `request_id`'s prompt step is written
        (`ModelRunner.observe`; with tensor parallelism it gets the gathered pages too)."""
        self.engine.runner.observe(request_id, observer)

    def unobserve_layers(self, request_id: str) -> None:
        self.engine.runner.unobserve(request_id)

    @property
    def kv_connector(self) -> KVConnector:
        """This engine's KV connector (`kv_connector_name`), built on first use: the only
        page API a transport calls."""
        if self._kv_connector is None:
            from tandem.engine.kv_connector.base import make_connector

            self._kv_connector = make_connector(self.kv_connector_name, self)
        return self._kv_connector

    async def unstarted_request_ids(self) -> set[str]:
        """The ids of the user requests (`{rid}-{i}` share the parent `rid`) whose every
        sample waits with no token generated (never started, or preempted before its first
        token): what a draining worker hands back."""
        return await self._call(unstarted_ids)

    # -- pages and pins (engine thread) ----------------------------------------------------
    async def pin_cached(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """Pin the leading run of `hashes` the prefix cache holds (`unpin` releases)."""
        return await self._call(lambda e: e.kv.pin_cached(hashes))

    async def import_blocks(self, hashes: list[BlockHash], tail: bool = False) -> ImportPins:
        """Pin blocks for pages of `hashes` arriving from elsewhere, all or none, plus one
        for the prompt's last block with `tail` (`KVCacheManager.import_blocks`)."""
        return await self._call(lambda e: ImportPins(*e.kv.import_blocks(hashes, tail)))

    async def commit_import(self, pins: ImportPins, commit: ImportCommit) -> list[KVBlock]:
        """Register the written full blocks of `pins` and stage the block after them (if
        pinned) for `commit.request_id`; returns the full blocks now pinned, which also
        replace the first ones of `pins.blocks` in place (a hash cached here meanwhile pins
        the cached block instead). The staged block's pin is dropped when staging fails."""
        n = len(commit.hashes)

        def run(e: LLMEngine) -> list[KVBlock]:
            full = pins.blocks[:n]
            if len(pins.blocks) > n:
                tail = pins.blocks[n]
                try:
                    e.kv.stage_tail(commit.request_id, tail, commit.tail_index,
                                    commit.tail_token_ids)
                except BaseException:
                    e.kv.unpin([tail])
                    raise
            e.kv.commit_import(full, commit.hashes, commit.parent_hash, commit.token_ids,
                               commit.lora_name, commit.lora_digest)
            pins.blocks[:n] = full
            return full

        return await self._call(run)

    async def unpin(self, blocks: Sequence[KVBlock], *, limit: int | None = None,
                    drop_tail: str | None = None) -> None:
        """Drop pins of `pin_cached` / `import_blocks`: `blocks[:limit]`, read on the
        engine thread (a `commit_import` sent before may have replaced some in place);
        then, with `drop_tail`, that request's staged block unless it took it over."""
        def run(e: LLMEngine) -> None:
            e.kv.unpin(list(blocks[:limit]))
            if drop_tail is not None:
                e.kv.drop_tail(drop_tail)

        await self._call(run)

    async def kept_block_ids(self, request_id: str) -> list[int] | None:
        """The block ids a finished `keep_blocks` request keeps, in order; None if none."""
        def run(e: LLMEngine) -> list[int] | None:
            kept = e.kv.kept_blocks(request_id)
            return None if kept is None else [b.block_id for b in kept]

        return await self._call(run)

    async def release_kept(self, request_id: str) -> bool:
        """Free the blocks a finished `keep_blocks` request kept; False if it kept none."""
        return await self._call(lambda e: e.kv.release_kept(request_id))

    async def export_pages(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Pinned `block_ids`' pages with every KV head, `[2, n, KVH, bs, row]` per layer on
        the host (`LLMEngine.export_kv`; one rank or many)."""
        return await self._call(lambda e: e.export_kv(block_ids))

    async def import_pages(self, block_ids: list[int], pages: list[torch.Tensor]) -> None:
        """Write full-head `pages` (one `[2, n, KVH, bs, row]` per layer) into pinned
        `block_ids` (`LLMEngine.import_kv`; one rank or many)."""
        await self._call(lambda e: e.import_kv(block_ids, pages))

    async def page_source(self, block_ids: list[int]) -> PageSource:
        """The pages of pinned `block_ids` for a send: read in place, layer by layer, with
        one rank; exported from the ranks at once (engine thread) with several."""
        if self.engine.kv_in_place:
            return PageSource(self.kv_caches, block_ids)
        return PageSource(self.kv_caches, block_ids, await self.export_pages(block_ids))

    def page_sink(self, block_ids: list[int]) -> PageSink:
        """A writer of pages into pinned `block_ids` (`PageSink`)."""
        return PageSink(self, block_ids)

    # -- LoRA (engine thread) --------------------------------------------------------------
    async def load_lora(self, request: LoRARequest, adapter: LoRAAdapter | None = None,
                        fresh_id: bool = False) -> LoRARequest:
        """Register adapter `request` (`LLMEngine.load_lora`); raises ValueError when its
        name is taken or being unloaded."""
        return await self._call(lambda e: e.load_lora(request, adapter=adapter,
                                                      fresh_id=fresh_id))

    async def unload_lora(self, name: str) -> bool:
        """Unload adapter `name`: True if freed now, False once its requests finish;
        raises `UnknownAdapterError`."""
        return await self._call(lambda e: e.unload_lora(name))


class PageSource:
    """A send's pages of pinned blocks, layer by layer (`EngineAPI.page_source`); valid
    while the blocks stay pinned."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_ids: list[int], exported: list[torch.Tensor] | None = None) -> None:
        """`exported`: every layer's pages already gathered (tensor parallelism); None: read
        them from `kv_caches`, which holds every KV head."""
        self.block_ids = block_ids
        self._caches = kv_caches
        self._exported = exported
        # the pages straight into a caller's buffer, for a host-memory cache (SendJob's)
        self.gather_into = None if exported is not None else host_pages_into(kv_caches,
                                                                              block_ids)

    def layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s `[2, n, KVH, bs, row]` pages with every KV head, on the cache's
        device or the host (a copy: may block)."""
        if self._exported is not None:
            return self._exported[layer]
        return gather_layer(self._caches, layer, self.block_ids)

    def views(self, layer: int) -> list[memoryview] | None:
        """The same bytes as 2n per-block views (K of each block, then V) read in place
        from a host-memory cache; None where there is none to read."""
        if self._exported is not None:
            return None
        return layer_page_views(self._caches, layer, self.block_ids)


class PageSink:
    """Writes an import's pages into pinned `block_ids` (`EngineAPI.page_sink`): `write`
    each layer from one thread at a time (the pages need stay valid only during the call),
    then `finish` on the event loop. With one rank a layer goes into the cache as it is
    written; with tensor parallelism the layers are kept and `finish` hands them to the
    ranks (engine thread)."""

    def __init__(self, engine: EngineAPI, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self._engine = engine
        self._caches = caches = engine.kv_caches
        self._in_place = engine.engine.kv_in_place
        self._index = block_index(block_ids, caches[0][0].device) if self._in_place else None
        self._staged: dict[int, torch.Tensor] = {}
        self._written: set[int] = set()
        # `write_hashed`'s (pages, selection) -> `scatter_targets`, the same every layer
        self._targets: tuple[tuple, np.ndarray | None] | None = None

    def write(self, layer: int, pages: torch.Tensor) -> None:
        """Layer `layer`'s `[2, n, KVH, bs, row]` pages (the cache's dtype, any device)."""
        if self._in_place:
            scatter_layer(self._caches, layer, self.block_ids, pages, self._index)
        else:
            self._staged[layer] = pages.clone()
        self._written.add(layer)

    def write_hashed(self, layer: int, pages: torch.Tensor,
                     select: list[int] | None) -> int | None:
        """Write pages `select` (positions in `pages`' blocks, in `block_ids` order; None:
        all) of layer `layer` into the cache while hashing every page of `pages`, and
        return their XXH3-64 (`scatter_layer_digest`); None, nothing written, where the
        cache is not written in place or not in host memory, or without the native kernel."""
        if not self._in_place:
            return None
        n = pages.shape[1] if pages.dim() > 1 else 0
        key = (n, None if select is None else tuple(select))
        if self._targets is None or self._targets[0] != key:  # once per import
            self._targets = key, scatter_targets(n, self.block_ids, select,
                                                 self._caches[0][0].shape[0])
        got = scatter_layer_digest(self._caches, layer, self._targets[1], pages)
        if got is not None:
            self._written.add(layer)
        return got

    async def finish(self) -> None:
        """Every layer written: the pages are in the cache when this returns. Raises
        ValueError when a layer was not written (nothing is handed to the ranks then)."""
        n = len(self._caches)
        if len(self._written) != n:
            raise ValueError(f"{len(self._written)} of {n} layers were written")
        if not self._in_place:
            pages, self._staged = [self._staged[i] for i in range(n)], {}
            await self._engine.import_pages(self.block_ids, pages)
