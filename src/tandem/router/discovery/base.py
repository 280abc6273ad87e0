"""Worker discovery: the plugin interface, its registry, and the static list.

A discovery tells the router which worker base URLs exist, their pool's role, and whether
their platform considers them ready. It reports the complete set every time (keyed by URL),
never a delta, so a consumer can always reconcile from scratch. The router routes to a
worker only while discovery reports it ready and its own readiness probe passes.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Self, TypeVar


@dataclass(frozen=True)
class WorkerEndpoint:
    """One worker as discovered: its base URL (e.g. `http://10.0.0.7:8000`), its pool's
    role and whether the platform reports it ready."""

    url: str
    role: str = "both"  # both | prefill | decode
    ready: bool = True


OnChange = Callable[[dict[str, WorkerEndpoint]], None]


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where `tandem router` looks for workers; each kind of discovery reads its own part."""

    urls: tuple[str, ...] = ()  # static
    namespace: str = "default"  # kubernetes: where the worker EndpointSlices are
    label_selector: str | None = None  # kubernetes: None = the default worker selector
    # kubernetes: only these InferenceServices' workers (one name, or several comma-separated)
    inference_service: str | None = None
    router_group: str | None = None  # kubernetes: only worker Services of this router group
    port_name: str = "http"  # kubernetes: the named port that serves HTTP
    scheme: str = "http"


class Discovery(ABC):
    name: str

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: DiscoveryConfig) -> Self: ...

    @abstractmethod
    async def run(self, on_change: OnChange) -> None:
        """Call `on_change` on the running event loop with the complete current set of
        endpoints (keyed by URL): once it is first known, then on every change. Runs until
        cancelled. Configuration errors raise before the first await, so that a router
        whose discovery cannot work fails at start-up rather than serving no one."""


DISCOVERY: dict[str, type[Discovery]] = {}


D = TypeVar("D", bound=type[Discovery])


def register_discovery(cls: D) -> D:
    DISCOVERY[cls.name] = cls
    return cls


def make_discovery(name: str, cfg: DiscoveryConfig) -> Discovery:
    if name not in DISCOVERY:
        raise ValueError(f"unknown discovery {name!r}; choose from {sorted(DISCOVERY)}")
    return DISCOVERY[name].from_config(cfg)


@register_discovery
class StaticDiscovery(Discovery):
    """A fixed list of URLs (`--workers`), reported once as ready with role "both": the
    router's probe finds each worker's real readiness and role."""

    name = "static"

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = [u for u in urls if u]

    @classmethod
    def from_config(cls, cfg: DiscoveryConfig) -> Self:
        return cls(cfg.urls)

    async def run(self, on_change: OnChange) -> None:
        on_change({u: WorkerEndpoint(u) for u in self.urls})
        await asyncio.Event().wait()  # nothing ever changes
