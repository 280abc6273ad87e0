"""Flow control's view of each model's decode-side workers, kept current as workers change
rather than scanned per request (`core.Router.capacity` / `saturated` read it).

Every worker of the router is filed, per name it serves (its model, aliases and adapters),
as *free* (ready, below the saturation thresholds), *full* (at or past them; ready or not)
or neither; prefill-only workers are not filed. A worker is re-filed when a field the answer
depends on is assigned (`Worker.watcher`: its model, aliases, role, adapters, readiness,
load report or this router's open requests on it) and when it joins or leaves. So a
worker's `load`, `aliases` and `lora_digests` must be replaced, never mutated in place (the
monitor replaces them); while they are the same objects, a re-filing (twice per request,
as its open requests change) reuses the names it filed under.

The circuit breaker depends on the clock, so it is checked when asked: `capacity` walks the
free workers until one whose breaker lets a request through (the first, unless breakers are
open), then the full ones likewise. Each question costs O(1) while breakers are closed,
and each change O(names the worker serves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.router.flowcontrol.base import ModelCapacity
from tandem.router.workers import Worker

_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Filed:
    """Where one worker is filed: the names it serves, and free / full / neither."""

    names: frozenset[str]
    free: bool
    full: bool
    # the (model, aliases, lora_digests) objects `names` was made from: while the worker
    # holds the same ones, its names are unchanged (its fields are replaced, never mutated)
    source: tuple = field(default=(), compare=False)


class SaturationBook:
    """Free and full decode-side workers per served name (module doc); `is_saturated`
    decides a worker's side (`core.Router.is_saturated`)."""

    def __init__(self, is_saturated: Callable[[Worker], bool]) -> None:
        self.is_saturated = is_saturated
        self.filed: dict[str, Filed] = {}
        self.known: dict[str, int] = {}  # decode-side workers per name, routable or not
        self.free: dict[str, dict[str, Worker]] = {}
        self.full: dict[str, set[str]] = {}
        self.full_workers: dict[str, dict[str, Worker]] = {}

    def refresh(self, w: Worker) -> None:
        """File `w` as it is now (a watched field changed, or it joined)."""
        old = self.filed.get(w.id)
        if w.role == "prefill":
            filed = Filed(_NONE, False, False)
        else:
            full = self.is_saturated(w)
            free = w.ready and not full
            source = (w.model, w.aliases, w.lora_digests)
            was = old.source if old is not None else ()
            if was and was[0] is source[0] and was[1] is source[1] and was[2] is source[2]:
                if old.free == free and old.full == full:  # type: ignore[union-attr]
                    return  # the per-request case: only its open requests changed
                names = old.names  # type: ignore[union-attr]
            else:
                names = frozenset(n for n in (w.model, *w.aliases, *w.lora_adapters) if n)
            filed = Filed(names, free, full, source)
        if old == filed:
            if old is not None and filed.source:
                self.filed[w.id] = filed  # the same answer from new objects: remember them
            return
        if old is not None:
            self._unfile(w.id, old)
        self.filed[w.id] = filed
        for name in filed.names:
            self.known[name] = self.known.get(name, 0) + 1
            if filed.free:
                self.free.setdefault(name, {})[w.id] = w
            if filed.full:
                self.full.setdefault(name, set()).add(w.id)
                self.full_workers.setdefault(name, {})[w.id] = w

    def drop(self, worker_id: str) -> None:
        """`worker_id` left."""
        old = self.filed.pop(worker_id, None)
        if old is not None:
            self._unfile(worker_id, old)

    def _unfile(self, wid: str, old: Filed) -> None:
        for name in old.names:
            left = self.known[name] - 1
            if left:
                self.known[name] = left
            else:
                del self.known[name]
            if old.free:
                _pop(self.free, name, wid)
            if old.full:
                ids = self.full[name]
                ids.discard(wid)
                if not ids:
                    del self.full[name]
                _pop(self.full_workers, name, wid)

    def capacity(self, model: str, now: float, served: bool) -> ModelCapacity:
        """`core.Router.capacity`'s answer; `served`: the model is a `served_models` one."""
        for w in self.free.get(model, {}).values():
            if w.breaker.allows(now):
                return ModelCapacity.AVAILABLE
        for w in self.full_workers.get(model, {}).values():
            if w.ready and w.breaker.allows(now):
                return ModelCapacity.SATURATED
        if model in self.known or served:
            return ModelCapacity.STARTING
        return ModelCapacity.NONE

    def saturated(self, model: str) -> set[str]:
        """The ids of `model`'s full decode-side workers: the maintained set itself (read
        it, do not change it)."""
        return self.full.get(model) or set()


def _pop(table: dict[str, dict[str, Worker]], name: str, wid: str) -> None:
    group = table[name]
    group.pop(wid, None)
    if not group:
        del table[name]
