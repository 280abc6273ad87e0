"""A pool's `parallelism` (`ParallelismSpec`, `parse_parallelism`): tensor parallelism, as
KServe's LLMInferenceService and llm-d spell it (`parallelism: {tensor: N}`).

A worker runs one tensor-parallel rank per GPU, so a GPU pool's `nvidia.com/gpu` limit `g`
and `tensor` `t` must agree (`check_parallelism`): `g == t` puts every rank in one pod
(single node, local processes: `--distributed-executor-backend mp`); `g < t` with `t % g == 0`
spreads them over `t / g` pods of one group (multi-node: a LeaderWorkerSet, the Ray backend);
`g > t` would hold GPUs no rank uses. A CPU pool (no GPU) runs all its ranks in its one pod
(gloo over local processes); there is no multi-node CPU layout. The CRD's CEL rules refuse
the same (their messages are fixed; these name the values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.operator.fields import GPU, get_int
from tandem.operator.model_uri import SpecError

if TYPE_CHECKING:
    from tandem.operator.pod_settings import Strategy

MAX_TENSOR = 64  # the CRD's maximum and the engine's (EngineConfig refuses more)
KEYS = ("tensor",)  # pipeline, data, expert parallelism: not yet
ONE_RANK_PER_GPU = "a worker uses one GPU per tensor-parallel rank"


@dataclass(frozen=True)
class ParallelismSpec:
    """`tensor`: the ranks of one worker (the pool's `--tensor-parallel-size`)."""

    tensor: int = 1


@dataclass(frozen=True)
class Layout:
    """Where one worker's ranks run: `nodes` pods of `ranks_per_pod` ranks each."""

    tensor: int
    gpus_per_pod: int  # 0: a CPU pool
    nodes: int

    @property
    def multinode(self) -> bool:
        return self.nodes > 1

    @property
    def ranks_per_pod(self) -> int:
        return self.tensor // self.nodes

    @property
    def backend(self) -> str:
        """`--distributed-executor-backend`: local processes, or Ray across the group."""
        return "ray" if self.multinode else "mp"


def parse_parallelism(d: dict[str, Any] | None, where: str) -> ParallelismSpec:
    """`where.parallelism`; unknown keys (pipeline, data...) are refused by name."""
    if d is None:
        return ParallelismSpec()
    w = f"{where}.parallelism"
    if not isinstance(d, dict):
        raise SpecError(f"{w}: expected an object like {{tensor: 2}}, got {d!r}")
    extra = sorted(set(d) - set(KEYS))
    if extra:
        raise SpecError(f"{w}.{extra[0]}: not supported (tensor parallelism only: "
                        f"{w}.tensor)")
    return ParallelismSpec(tensor=get_int(d, "tensor", 1, w, 1, MAX_TENSOR))


def check_parallelism(par: ParallelismSpec, gpus: int, where: str) -> Layout:
    """The pool's `Layout` for `gpus` per pod, or a `SpecError` naming the fields."""
    t = par.tensor
    limit = f"{where}.resources.limits.{GPU}"
    if gpus > t:
        raise SpecError(f"{limit}: {gpus} needs parallelism.tensor {gpus} ({ONE_RANK_PER_GPU})"
                        f"; {where}.parallelism.tensor is {t}")
    if gpus and t % gpus:
        raise SpecError(f"{where}.parallelism.tensor {t} is not a multiple of {limit} "
                        f"{gpus}: {ONE_RANK_PER_GPU}, so a worker spans tensor / GPUs-per-pod "
                        f"pods (set tensor to {gpus * (t // gpus + 1)}, or the GPUs per pod "
                        f"to a divisor of {t})")
    return Layout(tensor=t, gpus_per_pod=gpus, nodes=t // gpus if gpus else 1)


def _groups(value: int | str, replicas: int, up: bool) -> int:
    if isinstance(value, int):
        return value
    share = int(value[:-1]) * replicas / 100
    return math.ceil(share) if up else math.floor(share)


def check_group_strategy(strategy: Strategy, replicas: int, where: str) -> None:
    """What the LeaderWorkerSet webhook refuses of a rollout: a percentage above 100%, and
    bounds that both come to 0 groups at `replicas` (maxSurge rounds up, maxUnavailable
    down, as it scales them). Both grow with the replica count, so a pool checked at the
    fewest replicas it runs (an autoscaled pool's minReplicas) passes at every count."""
    for name, value in (("maxSurge", strategy.max_surge),
                        ("maxUnavailable", strategy.max_unavailable)):
        if isinstance(value, str) and int(value[:-1]) > 100:
            raise SpecError(f"{where}.strategy.{name}: {value} is above 100% (a multi-node "
                            "pool's LeaderWorkerSet refuses it)")
    if replicas and not (_groups(strategy.max_surge, replicas, True)
                         or _groups(strategy.max_unavailable, replicas, False)):
        raise SpecError(f"{where}.strategy: maxSurge {strategy.max_surge} and maxUnavailable "
                        f"{strategy.max_unavailable} both come to 0 groups at {replicas} "
                        "replicas, which a multi-node pool's LeaderWorkerSet refuses (use a "
                        "whole number, e.g. maxUnavailable: 1)")
