"""What the router answers for a model it cannot route to yet: 503 "starting" or 404.

Right after the router (or its workers) start, no worker has reported its model: a bare 404
"model is not served here" would be wrong for a model whose workers are still loading. The
rule, for a request naming model M (or none) when no routable worker serves M:

* discovery has not reported its first set of workers: 503 (the router is starting);
* a known worker serves M but none is ready: 503 (its workers are starting, draining or
  failing their probes). A starting Tandem worker names its model in its 503 `/ready`, so
  the router knows M while it loads;
* M is unknown, and some known worker has never reported its model (discovery lists it as
  not ready, or its `/ready` does not answer yet): the request may be for it. 503 "workers
  are starting" while the router is within `window_s` of its start, or when M was served
  here before (a restarted worker keeps its model's requests waiting, not failing);
* otherwise 404: every known worker has reported a model and M is none of them (or the
  start-up window is over and M was never served).

Every 503 carries `Retry-After` and a message naming the cause. `/v1/models` answers 503
"starting" too while no model is ready and a 503 would be the answer for an unknown model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.protocol.web import APIError
from tandem.router.workers import Worker

RETRY_AFTER_S = 2
DEFAULT_WINDOW_S = 300.0


def _workers(n: int, singular: str, plural: str) -> str:
    """"1 worker <singular>" / "3 workers <plural>"."""
    return f"1 worker {singular}" if n == 1 else f"{n} workers {plural}"


def _starting(message: str) -> APIError:
    return APIError(503, message, "model", headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass
class StartupState:
    """Discovery's first report, the router's start and the models served here so far."""

    window_s: float = DEFAULT_WINDOW_S
    started_at: float = field(default_factory=time.monotonic)
    synced: bool = False  # discovery reported its first set of workers
    seen: set[str] = field(default_factory=set)  # models some worker has reported

    def observe(self, workers: Iterable[Worker]) -> None:
        """Remember the models `workers` report (call before workers are removed)."""
        for w in workers:
            if w.model:
                self.seen.add(w.model)
                self.seen.update(w.aliases)
                self.seen.update(w.lora_adapters)

    def in_window(self, now: float) -> bool:
        return now - self.started_at < self.window_s

    def check(self, model: str, workers: Iterable[Worker], now: float) -> APIError | None:
        """None when some routable worker serves `model` (route it); else the 503 or 404
        to answer ("" for `model`: the request named none and no model is ready)."""
        workers = list(workers)
        same = unattributed = 0
        for w in workers:
            if not w.model:
                unattributed += 1
            elif w.serves(model) or not model:  # no model named: any attributed worker
                if w.serves(model) and w.routable(now):
                    return None
                same += not w.routable(now)
        self.observe(workers)
        if not self.synced:
            return _starting("the router is starting: worker discovery has not reported yet; "
                             "retry later")
        if same:
            if not model:
                return _starting(f"no model is ready yet: {_workers(same, 'is', 'are')} "
                                 "starting, draining or failing probes; retry later")
            whose = "its worker is not" if same == 1 else f"none of its {same} workers is"
            return _starting(f"model {model!r}: {whose} ready yet (starting, draining or "
                             "failing probes); retry later")
        if unattributed and (self.in_window(now) or model in self.seen):
            which = f", so {model!r} may be served by one of them" if model else ""
            return _starting(f"workers are starting: {_workers(unattributed, 'has', 'have')} "
                             f"not reported a model yet{which}; retry later")
        if not model:
            return APIError(404, "no model is served here (no worker is ready)", "model")
        return APIError(404, f"model {model!r} is not served here", "model")

    def models_unavailable(self, workers: Iterable[Worker], now: float) -> APIError | None:
        """For `/v1/models` with no ready model: 503 while workers may still be starting,
        None when an empty list is the truth."""
        err = self.check("", workers, now)
        return err if err is not None and err.status == 503 else None
