"""The engine's KV connector seam: how KV pages leave and enter the engine.

Modelled on vLLM's `KVConnectorBase_V1`, a connector has three faces:

* a **scheduler side** (`KVConnectorScheduler`, rank 0's engine thread): how many tokens of
  a request after its locally computed ones can be loaded from outside
  (`get_num_new_matched_tokens`); the blocks allocated for them
  (`update_state_after_alloc`); the step's `ConnectorMetadata` (`build_connector_meta`);
  and what becomes of a finished request's blocks (`request_finished`: kept for a reader
  under a lease, or freed);
* a **worker side** (`KVConnectorWorker`, rank 0's forward): start loading a step's
  pages (`start_load_kv`), wait for one layer's (`wait_for_layer_load`), save each layer's
  pages as soon as it is computed (`save_kv_layer`), wait for the saves (`wait_for_save`);
  it reads and writes full-head pages through `pages` (`PageIO`), the same for one rank or
  many;
* a **page API** for the connector's transport (`KVConnector`'s coroutines): the page
  layout, leases on kept or cached blocks, import pins and commits, and page sources and
  sinks. Pages cross it with every KV head (`PageLayout`), whatever the tensor-parallel
  size: a transport never learns how many ranks there are.

Where the engine calls them (`KVConnector.attach` hands the sides to the engine): the
scheduler asks `get_num_new_matched_tokens` when it admits a waiting request (after the local
prefix hit; asked only while at least one prompt token is left to compute, and its answer is
cut so that one is); the KV manager calls `update_state_after_alloc` on each allocation that
adds blocks (on an admission with external tokens: all the request's blocks, in position
order, and how many tokens load into them) and `request_finished` on each normal finish
(stopped or length; keep or free its blocks); the scheduler builds the step's
`ConnectorMetadata` (`build_connector_meta`, once per step, in `SchedulerOutput`) and rank
0's model runner calls `start_load_kv` with it before the forward, `wait_for_layer_load(i)`
before layer i attends (every layer before the forward when the step replays decode graphs
or runs on several tensor-parallel ranks; only in steps with loads) and `wait_for_save`
after the forward; the runner's layer observers reach `save_kv_layer`. Loads are
synchronous: the loaded tokens count as computed from admission on, the step that loads
them computes the rest, and the blocks join the prefix cache only after that step's forward
(a failed step caches nothing). An answer with `load_async` is refused (ConfigError). With
tensor parallelism a loading worker side writes through `pages.write` (kept until every
layer is waited for, then handed to every rank, each its own heads, before the step's
forward plan); writing into `kv_caches` directly reaches rank 0's heads only. The P/D
connector loads nothing in a step (its imports land before the request is added): it
answers 0.

Every pin a transport holds for a reader outside the process is a `PageLease`: it ends when
released, or `lease_s` after its last renewal (expired on the engine thread, counted in
`lease_stats`), so a reader that dies cannot hold the pool. Connectors register by name
(`register`, `KV_CONNECTORS`) and an engine builds its own (`make_connector`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.leases import MAX_LEASE_S, LeaseError, LeaseStats, PageLease

if TYPE_CHECKING:
    import torch

    from tandem.engine.async_api import EngineAPI
    from tandem.engine.kv_cache.block_pool import KVBlock
    from tandem.engine.kv_cache.pages import HostPages
    from tandem.engine.kv_pages import ImportCommit, ImportPins, PageLayout
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.request import Request
    from tandem.protocol.block_hash import BlockHash

__all__ = ["KV_CONNECTORS", "ConnectorMetadata", "ExternalMatch", "FinishAction",
           "KVConnector", "KVConnectorRole", "KVConnectorScheduler", "KVConnectorWorker",
           "LayerSaver", "LeaseError", "LeaseStats", "PageIO", "PageLease", "PageSinkAPI",
           "PageSourceAPI", "make_connector", "register"]


class KVConnectorRole(Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class ExternalMatch:
    """`get_num_new_matched_tokens`' answer: `num_tokens` after the request's computed
    ones can be loaded from outside, in the step that admits it (the worker side writes
    them before each layer attends). `load_async` (they would arrive over later steps) is
    refused by the scheduler with a ConfigError: the engine loads synchronously only."""

    num_tokens: int = 0
    load_async: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")


@dataclass(frozen=True)
class FinishAction:
    """`request_finished`'s answer: `keep` the request's blocks pinned for a reader, under a
    lease of `lease_s` owned by the request id, or free them (`keep` False)."""

    keep: bool = False
    lease_s: float = MAX_LEASE_S


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the worker side does in one step, built by the scheduler side: `loads` maps a
    request id to the block ids its pages go into, `saves` to the block ids whose layers are
    saved as each is computed."""

    loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    saves: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves)


class KVConnectorScheduler(ABC):
    """The scheduler side (rank 0's engine thread)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> ExternalMatch:
        """Tokens of `request` after its first `num_computed_tokens` (local prefix hits,
        block-aligned) that can be loaded from outside instead of computed. Asked at each
        admission from the waiting queue (again after a preemption); may be asked for a
        request that then does not fit this step. The scheduler loads at most up to the
        last prompt token (and none of the positions whose prompt logprobs are due)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """An allocation added `block_ids` to `request` (prefix hits, then fresh blocks;
        `KVCacheManager.allocate_slots`). With `num_external_tokens` > 0 (its admission):
        they are all its blocks in position order, and that many tokens from the
        `num_computed_tokens` it was last asked with are to be loaded in this step (put them
        in the step's `ConnectorMetadata.loads`)."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """The step's loads and saves; resets what was gathered for it."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: Sequence[int]) -> FinishAction:
        """`request` has finished normally (stopped or length; `keep_kv` or not) holding
        `block_ids`, whose full blocks up to its computed tokens hold its KV
        (`KVCacheManager.free`): keep them (for a reader, or until the connector has saved
        them), for how long, or free them. Aborted, failed and preempted requests are not
        asked."""


class LayerSaver(Protocol):
    """What a save streams to (e.g. a transport's layer stream): the block table once the
    prompt's last step begins, then each layer once written (`event`: a CUDA event to wait
    on before reading on another stream; None on the CPU)."""

    def begin(self, block_ids: list[int]) -> None: ...

    def layer_done(self, layer: int, event: Any | None) -> None: ...


class PageIO(Protocol):
    """Full-head pages (`[2, n, KVH, bs, row]` per layer) in and out of the engine's cache,
    whatever the tensor-parallel size; engine thread only (`llm_engine.KVPageIO`)."""

    def read(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every layer's pages of pinned `block_ids`, on the host (gathered from the ranks
        with tensor parallelism)."""
        ...

    def write(self, layer: int, block_ids: list[int], pages: torch.Tensor) -> None:
        """Load layer `layer`'s pages into `block_ids`: in the cache on return with one
        rank; with several, on every rank before the step's forward (written for every
        layer of the step's loads, from `wait_for_layer_load`)."""
        ...


class KVConnectorWorker(ABC):
    """The worker side (rank 0's model runner, on the engine thread, around the
    forward). `pages`: full-head page reads and writes (set by `KVConnector.attach`)."""

    pages: PageIO | None = None

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           layout: PageLayout) -> None:
        """This rank's per-layer (K, V) caches and the full-head layout they are a share
        of (`PageLayout.rank_layout`)."""

    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Before the forward (every step): begin writing the step's `loads` into the
        cache."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Before `layer`'s attention, in steps with `loads`: its pages for this step are
        in the cache when this returns (each layer once, in order)."""

    @abstractmethod
    def save_kv_layer(self, request_id: str, layer: int, event: Any | None,
                      pages: torch.Tensor | None = None) -> None:
        """`layer`'s K/V of `request_id`'s step are written: save (or send) them. With one
        rank read them from the cache (after `event`, on a GPU); with tensor parallelism
        `pages` holds them, `[2, n, KVH, bs, row]` with every KV head for the blocks the save
        began with, gathered from the ranks onto rank 0's host (`event` is None)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward (every step): every save of the step is done with the
        cache."""


class PageSourceAPI(Protocol):
    """A send's pages of pinned blocks, layer by layer; valid while they stay pinned."""

    block_ids: list[int]
    # the pages straight into caller buffers (`kv_cache.pages.HostPages`); None: use `layer`
    gather_into: HostPages | None

    def layer(self, layer: int) -> torch.Tensor: ...

    def views(self, layer: int) -> list[memoryview] | None: ...


class PageSinkAPI(Protocol):
    """Writes an import's pages into pinned blocks: `write` each layer, then `finish`."""

    block_ids: list[int]

    def write(self, layer: int, pages: torch.Tensor) -> None: ...

    def write_hashed(self, layer: int, pages: torch.Tensor,
                     select: list[int] | None) -> int | None: ...

    async def finish(self) -> None: ...


class KVConnector(ABC):
    """An engine's connector: its `scheduler` and `worker` sides, and the page API its
    transport calls (coroutines run on the engine thread between steps)."""

    name = ""
    # whether `get_num_new_matched_tokens` may answer tokens to load in a step
    loads_kv = False
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker

    def attach(self, core: LLMEngine) -> None:
        """Hand this connector's sides to `core`: the KV manager and scheduler ask the
        scheduler side from now on, rank 0's model runner calls the worker side, which gets
        the caches and the full-head page reader and writer (`pages`)."""
        core.kv.connector = self.scheduler
        core.runner.kv_connector = self.worker
        self.worker.pages = core.runner.kv_pages
        self.worker.register_kv_caches(core.runner.kv_caches, core.page_layout(""))

    # -- what both ends share --------------------------------------------------------------
    @abstractmethod
    def layout(self, model_id: str) -> PageLayout:
        """The full-head layout of this engine's pages on the wire."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the KV cache lives (a transport's buffers go there)."""

    @property
    @abstractmethod
    def prefix_caching(self) -> bool:
        """Whether imported pages can be hit (False: import nothing)."""

    @abstractmethod
    def cached_prefix_len(self, hashes: list[BlockHash]) -> int:
        """How many leading `hashes` the prefix cache holds (stale answers only move work)."""

    # -- sending: leases on kept or cached blocks ------------------------------------------
    @abstractmethod
    async def lease_kept(self, request_id: str, lease_s: float) -> PageLease | None:
        """The lease on finished `keep_blocks` request `request_id`'s blocks, now ending
        `lease_s` from now; None if it kept none."""

    @abstractmethod
    async def lease_cached(self, owner: str, hashes: list[BlockHash],
                           lease_s: float) -> PageLease:
        """Lease the leading run of `hashes` the prefix cache holds, for `owner`'s reader."""

    @abstractmethod
    async def renew(self, lease: PageLease, lease_s: float) -> PageLease:
        """Extend `lease` to `lease_s` from now; `LeaseError` once it has ended."""

    @abstractmethod
    async def release(self, lease: PageLease | str) -> bool:
        """End a lease (a handle or its id): False if it had ended already."""

    @abstractmethod
    async def release_kept(self, request_id: str) -> bool:
        """End the lease on `request_id`'s kept blocks; False if there is none."""

    @abstractmethod
    async def page_source(self, lease: PageLease, start: int = 0,
                          count: int | None = None) -> PageSourceAPI:
        """The pages of `lease.block_ids[start:start + count]`; `LeaseError` once the lease
        has ended."""

    @abstractmethod
    async def saved_page_source(self, request_id: str,
                                block_ids: list[int]) -> PageSourceAPI:
        """The pages of `block_ids` of request `request_id` while its layers are saved
        (`save_layers`; some of the ids its saver's `begin` gave); read each layer once
        saved. The same reader whatever the tensor-parallel size."""

    @abstractmethod
    def save_layers(self, request_id: str, saver: LayerSaver) -> bool:
        """Stream `request_id`'s pages to `saver` layer by layer while its last prompt step
        runs (any tensor-parallel size); False (nothing registered) where the connector
        cannot. `unsave_layers` ends it."""

    @abstractmethod
    def unsave_layers(self, request_id: str) -> None: ...

    @abstractmethod
    def lease_stats(self) -> LeaseStats:
        """Leases active now, released and expired since start."""

    # -- receiving: import pins, sinks, commits ---------------------------------------------
    @abstractmethod
    async def pin_cached(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """Pin the leading cached run of `hashes` (`unpin` releases)."""

    @abstractmethod
    async def import_blocks(self, hashes: list[BlockHash], tail: bool = False) -> ImportPins:
        """Pin blocks for arriving pages of `hashes`, all or none (+ one for the tail)."""

    @abstractmethod
    def page_sink(self, block_ids: list[int]) -> PageSinkAPI:
        """A writer of pages into pinned `block_ids`."""

    @abstractmethod
    async def commit_import(self, pins: ImportPins, commit: ImportCommit) -> list[KVBlock]:
        """Register written pages in the prefix cache, staging the tail block."""

    @abstractmethod
    async def unpin(self, blocks: Sequence[KVBlock], *, limit: int | None = None,
                    drop_tail: str | None = None) -> None:
        """Drop pins of `pin_cached` / `import_blocks` (and a staged tail)."""

    async def close(self) -> None:
        """Stop background work the connector started; leases stay until the engine goes."""
        return None


KV_CONNECTORS: dict[str, Callable[[EngineAPI], KVConnector]] = {}


def register(name: str):  # noqa: ANN201 - a class decorator
    """Register a connector class under `name`; it is built with the engine it serves."""
    def add(cls: type[KVConnector]) -> type[KVConnector]:
        cls.name = name
        KV_CONNECTORS[name] = cls
        return cls
    return add


def make_connector(name: str, engine: EngineAPI) -> KVConnector:
    """Build connector `name` for `engine`; ConfigError naming the known ones otherwise."""
    from tandem.engine.kv_connector import offload, pd  # noqa: F401 - built-ins register

    if name not in KV_CONNECTORS:
        raise ConfigError(f"unknown KV connector {name!r}; available: "
                          f"{', '.join(sorted(KV_CONNECTORS))}")
    return KV_CONNECTORS[name](engine)
