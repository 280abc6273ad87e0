"""LoRA affinity scorer (llm-d's `lora-affinity`): send an adapter's requests where it
already runs, else where a slot is free, last where every slot holds other adapters.

Reads the adapters each worker reports with its load (`GetLoad`, every poll; the same sets
as `vllm:lora_requests_info`): 1.0 when requests for it run or wait there (they share the
slot and the batch), `RESIDENT` when it sits in a device slot, `FREE_SLOT` when the worker
has a slot no running adapter uses (it loads at once) or has not reported, 0 when every
slot is busy with other adapters (the request waits until one drains). A base-model request
scores 1.0 everywhere. With the default weight a full affinity gap weighs as much as
`saturation_queue` requests of queue depth, so affinity holds "when load allows" and a
saturated holder spills to other replicas.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.router.scorers.base import RoutingContext, Scorer, register_scorer
from tandem.router.scorers.columns import Columns
from tandem.router.workers import Worker

RESIDENT = 0.8
FREE_SLOT = 0.5


@register_scorer
class LoRAAffinityScorer(Scorer):
    name = "lora_affinity"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        if ctx.lora is None:
            return [1.0] * len(workers)
        return [self._one(ctx.lora, w) for w in workers]

    def vector(self, ctx: RoutingContext, cols: Columns) -> np.ndarray:
        if ctx.lora is None:
            return np.ones(cols.n)
        return np.array(self.score_one(ctx.lora, cols.workers), np.float64)

    @classmethod
    def score_one(cls, lora: str, workers: Sequence[Worker]) -> list[float]:
        """The scores for adapter `lora` (not None), as `score` gives them."""
        return [cls._one(lora, w) for w in workers]

    @staticmethod
    def _one(lora: str, w: Worker) -> float:
        load = w.load
        active = load.running_loras | load.waiting_loras
        if lora in active:
            return 1.0
        if lora in load.resident_loras:
            return RESIDENT
        if load.max_loras == 0 or len(load.running_loras) < load.max_loras:
            return FREE_SLOT
        return 0.0
