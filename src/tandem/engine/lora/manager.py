"""Which adapters exist, which sit in host memory, which in the device slots.

- Registered adapters (`add`, `remove`): name -> `LoRARequest` (validated once when added:
  the files are read, so a bad adapter fails its load call, not a later request).
- Host cache: up to `max_cpu_loras` loaded `LoRAAdapter`s, least recently used evicted
  (re-read from disk, sha256 checked again, when needed later).
- Device slots: `max_loras` slots of `ModuleSlots` stacks in every wrapped linear
  (`slots.LoRASlots`: with tensor parallelism this rank's shard of each);
  `prepare(names)` makes a step's adapters resident (loading into free or least recently
  used slots not needed by this step) and returns each name's slot. The scheduler keeps
  the running requests' distinct adapters at most `max_loras`, so a step always fits.
  `on_load` (set by the engine with tensor parallelism) hands each load to the other
  ranks, which keep their shard of it in the same slot.
- Unloading under traffic (`retire`): the name stops resolving at once (new requests get
  404), the adapter's queued and running requests finish with it, and `reap` frees it
  once none is left.
- Identity: each adapter's `digest` (of its effective weights, `peft.adapter_digest`) keys
  its blocks in the prefix cache, so a different adapter loaded under a name used before
  never hits the old one's blocks, while the same files loaded again do. `state` (a
  `LoRAState`, replaced whole on every change, so readers on other threads see one
  consistent version) is what the worker reports to routers.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.errors import ConfigError, UnknownAdapterError
from tandem.engine.lora.paths import resolve_adapter
from tandem.engine.lora.peft import LoRAAdapter, load_adapter
from tandem.engine.lora.request import LoRARequest, LoRAState
from tandem.engine.lora.slots import FUSED, LoRASlots
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.parallel.tp import TPPlan

__all__ = ["FUSED", "LoRAConfig", "LoRAManager"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA engine arguments."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dirs: tuple[str, ...] = ()  # roots clients may load adapters from

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                              f"({self.max_loras})")


class LoRAManager:
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, config: LoRAConfig,
                 device: torch.device, dtype: torch.dtype, native: object | None = None,
                 tp: TPPlan | None = None) -> None:
        """`arch`: the whole model's (adapters are checked against it); `model`: this
        rank's shard of it when `tp` is set."""
        self.arch, self.config, self.device = arch, config, device
        self.slots = LoRASlots(model, arch, config.max_loras, config.max_lora_rank, device,
                               dtype, native, tp)
        self.native, self.ctx, self.modules = self.slots.native, self.slots.ctx, (
            self.slots.modules)
        self.num_slots = config.max_loras
        # called with (slot, adapter) after each load into a slot (the other ranks')
        self.on_load: Callable[[int, LoRAAdapter], None] | None = None
        self.max_cpu = config.max_cpu_loras or config.max_loras
        self.registered: dict[str, LoRARequest] = {}
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident, LRU first
        self.retiring: set[str] = set()  # unloaded names whose requests still run
        self.digests: dict[str, str] = {}  # registered name -> its adapter's digest
        self._roots: dict[str, str | None] = {}  # name -> the root it was confined to
        self.state = LoRAState(uuid.uuid4().hex, 0)
        self.num_loads = 0  # adapters copied into a slot (diagnostics)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of every slot stack (allocated up front)."""
        return self.slots.nbytes

    # -- registry ---------------------------------------------------------------------------
    def read(self, req: LoRARequest, trusted: bool = False) -> LoRAAdapter:
        """Resolve (confined to `lora_dirs` unless `trusted`: a path from the server's own
        configuration) and load an adapter; touches no shared state, so it may run off the
        engine thread. ConfigError (AdapterPathError) on a bad path or adapter."""
        found = resolve_adapter(req.lora_path, None if trusted else self.config.lora_dirs)
        return load_adapter(found.real, req.lora_name, req.lora_int_id, self.arch,
                            self.config.max_lora_rank, req.sha256,
                            root=None if trusted else found.root)

    def add(self, req: LoRARequest, trusted: bool = False,
            adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Register an adapter, loading it (`read`) unless `adapter` is that already.
        ConfigError on a bad adapter, ValueError when the name is taken by another one."""
        if req.lora_name in self.retiring:
            raise ValueError(f"adapter {req.lora_name!r} is being unloaded (its requests are "
                             "finishing); retry once they have")
        old = self.registered.get(req.lora_name)
        if old is not None and old != req:
            raise ValueError(f"adapter {req.lora_name!r} is already loaded")
        if any(r.lora_int_id == req.lora_int_id and r.lora_name != req.lora_name
               for r in self.registered.values()):
            raise ValueError(f"lora_int_id {req.lora_int_id} is taken by another adapter")
        if adapter is None:
            adapter = self.read(req, trusted)
        resolved = LoRARequest(req.lora_name, req.lora_int_id, str(adapter.path),
                               req.sha256 or adapter.sha256)
        self.registered[req.lora_name] = resolved
        self.digests[req.lora_name] = adapter.digest
        self._roots[req.lora_name] = adapter.root
        self._cache(adapter)
        self._publish()
        logger.info("LoRA adapter %s (id %d, rank %d, %d modules, %.1f MiB) from %s",
                    req.lora_name, req.lora_int_id, adapter.rank, len(adapter.weights),
                    adapter.nbytes / 2**20, adapter.path)
        return adapter

    def remove(self, name: str) -> None:
        """Forget an adapter (its slot and host copy); the caller has ended its requests."""
        if self.registered.pop(name, None) is None:
            raise UnknownAdapterError(name)
        self.digests.pop(name, None)
        self._roots.pop(name, None)
        self.host.pop(name, None)
        slot = self.slot_of.pop(name, None)
        if slot is not None:  # (the other ranks' copy is overwritten by the next load)
            self.slots.clear(slot)
        self._publish()

    def retire(self, name: str) -> None:
        """Unload under traffic: `name` stops resolving now; `reap` frees it later."""
        if not self.has(name):
            raise UnknownAdapterError(name)
        self.retiring.add(name)
        self._publish()

    def reap(self, in_use: set[str | None]) -> list[str]:
        """Free the retiring adapters no unfinished request uses; their names."""
        done = sorted(self.retiring - in_use)
        for name in done:
            self.retiring.discard(name)
            self.remove(name)
            logger.info("LoRA adapter %s unloaded", name)
        return done

    def has(self, name: str) -> bool:
        return name in self.registered and name not in self.retiring

    def names(self) -> list[str]:
        """Adapters requests may name (registered, not retiring), in load order."""
        return [n for n in self.registered if n not in self.retiring]

    def digest(self, name: str) -> str:
        """The digest of registered adapter `name` (its identity in block hashes)."""
        try:
            return self.digests[name]
        except KeyError:
            raise UnknownAdapterError(name) from None

    def _publish(self) -> None:
        """A new `state` (one assignment: readers off the engine thread see it whole)."""
        self.state = LoRAState(self.state.instance, self.state.version + 1,
                               tuple((n, self.digests[n]) for n in self.names()))

    def next_id(self) -> int:
        """A `lora_int_id` no registered adapter holds."""
        return max((r.lora_int_id for r in self.registered.values()), default=0) + 1

    def resident(self) -> list[str]:
        """Adapters in device slots, most recently used last."""
        return list(self.slot_of)

    # -- residency --------------------------------------------------------------------------
    def _cache(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu:
            self.host.popitem(last=False)

    def _host(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # read again, as confined as the first time
            req, root = self.registered[name], self._roots.get(name)
            found = resolve_adapter(req.lora_path, None if root is None else (root,))
            adapter = load_adapter(found.real, name, req.lora_int_id, self.arch,
                                   self.config.max_lora_rank, req.sha256,
                                   root=None if root is None else found.root)
            if adapter.digest != self.digests[name]:
                raise ConfigError(f"adapter {name!r} changed on disk since it was loaded "
                                  f"(digest {adapter.digest[:12]}, loaded "
                                  f"{self.digests[name][:12]}); unload and load it again")
        self._cache(adapter)
        return adapter

    def prepare(self, names: set[str]) -> dict[str, int]:
        """Each of this step's adapters (at most `max_loras`) -> its device slot, loading
        the missing ones into free slots or those of the least recently used adapters not
        in `names`."""
        if len(names) > self.num_slots:
            raise ValueError(f"{len(names)} adapters in one step; max_loras is "
                             f"{self.num_slots}")
        for name in names:
            if name not in self.registered:  # a retiring adapter still runs its requests
                raise UnknownAdapterError(name)
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
        for name in sorted(names - self.slot_of.keys()):
            used = set(self.slot_of.values())
            free = next((s for s in range(self.num_slots) if s not in used), None)
            if free is None:
                victim = next(n for n in self.slot_of if n not in names)
                free = self.slot_of.pop(victim)
            self._load(name, free)
        return {n: self.slot_of[n] for n in names}

    def _load(self, name: str, slot: int) -> None:
        adapter = self._host(name)
        if self.on_load is not None:
            self.on_load(slot, adapter)
        self.slots.load(slot, adapter.weights)
        self.slot_of[name] = slot
        self.num_loads += 1


