"""The `ray` executor: ranks 1..N-1 as Ray actors in one placement group.

One bundle per rank (`{"GPU": 1}` on CUDA, `{"CPU": 1}` on the CPU: a share of the CPUs
when a local Ray has fewer than ranks), strategy PACK, so one
worker's shards share a node when one has room and spread over as few nodes as possible
otherwise. Bundle 0 is rank 0's, pinned to this node (its `node:<ip>` resource): rank 0
is the engine's own process. Each actor runs `parallel.worker.run_rank` to the end (its
`run` call returns at STOP); a watcher waits on those calls, so an actor that dies (its
process killed, its node lost) marks the executor dead. Rank 0's store listens on this
node's IP so actors on other nodes reach it.

Ray is imported only here: `ray.init()` joins `RAY_ADDRESS` when set (a cluster started by
`ray start`, e.g. the operator's multi-node layout), else starts a local one.
"""

from __future__ import annotations

import logging
import os

from tandem.engine.errors import ConfigError
from tandem.engine.parallel.comm import Groups, host_store
from tandem.engine.parallel.executor import Executor, RankSpec, register, track
from tandem.engine.parallel.worker import run_rank

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0  # placement group resources (a cluster may be scaling up)


class _Rank:
    """The actor body: one rank's whole life in `run`."""

    def run(self, spec: RankSpec) -> int:
        run_rank(spec)
        return spec.rank


@register("ray")
class RayExecutor(Executor):
    def start(self) -> Groups:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ConfigError("distributed_executor_backend 'ray' needs Ray: "
                              "pip install 'tandem[ray]'") from exc
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=True, ignore_reinit_error=True)
        self._ray = ray
        cuda = self.device.type == "cuda"
        ip = ray.util.get_node_ip_address()
        unit = {"GPU": 1.0} if cuda else {"CPU": 1.0}
        (kind, _), = unit.items()
        have = ray.cluster_resources().get(kind, 0.0)
        if have < self.world and not os.environ.get("RAY_ADDRESS"):
            # a local Ray cannot grow: CPU ranks share its cores (as `mp` ranks would),
            # GPU ranks are refused now rather than after the placement wait
            if cuda:
                raise ConfigError(f"tensor_parallel_size {self.world} needs {self.world} GPU "
                                  f"in Ray; the local Ray cluster has {have:g}")
            unit = {"CPU": have / self.world}
            logger.warning("the local Ray cluster has %g CPUs for %d ranks: each gets %.2f",
                           have, self.world, have / self.world)
        bundles = [{**unit, f"node:{ip}": 0.001}] + [dict(unit) for _ in range(self.world - 1)]
        self.pg = placement_group(bundles, strategy="PACK", name=f"tandem-tp-{os.getpid()}")
        ready, _ = ray.wait([self.pg.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise ConfigError(f"Ray could not place {self.world} ranks ({unit} each) within "
                              f"{READY_TIMEOUT_S:.0f} s: {ray.cluster_resources()}")
        # actors on other nodes reach rank 0's store on this node's IP
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        host = ip if nodes > 1 or os.environ.get("RAY_ADDRESS") else "127.0.0.1"
        store = host_store(host, world=self.world)
        actor_cls = ray.remote(num_cpus=0 if cuda else unit["CPU"],
                               num_gpus=1 if cuda else 0)(_Rank)
        self.actors, self.calls = [], []
        for rank in range(1, self.world):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank)
            actor = actor_cls.options(scheduling_strategy=strategy,
                                      name=f"tandem-tp{rank}-{os.getpid()}").remote()
            # Ray sets the actor's CUDA_VISIBLE_DEVICES to its bundle's GPU: cuda:0
            spec = RankSpec(self.config, rank, self.world, host, store.port,
                            "cuda:0" if cuda else "cpu")
            self.actors.append(actor)
            self.calls.append(actor.run.remote(spec))
        self.watch(self._watch)
        track(self)  # stopped at exit at the latest, before Ray's own exit handler
        try:
            return self._connect(store)
        except Exception as exc:
            self.shutdown()
            raise ConfigError(f"tensor-parallel ranks did not start: {exc}") from exc

    def _watch(self) -> None:
        ray = self._ray
        done, _ = ray.wait(self.calls, num_returns=1, timeout=None)
        rank = self.calls.index(done[0]) + 1
        try:
            ray.get(done[0])
            why = f"rank {rank} (Ray actor) returned"
        except Exception as exc:  # noqa: BLE001 - RayActorError, a task error: its reason
            why = f"rank {rank} (Ray actor) died: {type(exc).__name__}: {str(exc)[:300]}"
        self._mark_dead(why)

    def _stop_ranks(self) -> None:
        ray = self._ray
        grace = 10 if self.dead is None else 1  # after a death the others may be stuck
        _, pending = ray.wait(self.calls, num_returns=len(self.calls), timeout=grace)
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.pg)
        if pending:
            logger.warning("%d Ray ranks killed after the grace period", len(pending))
