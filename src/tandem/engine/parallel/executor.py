"""Executors: how an engine's tensor-parallel ranks run (vLLM's
`distributed_executor_backend`). Rank 0 is always the engine's own process: it schedules,
builds each step's `StepPlan`, sends it, runs its own share of the forward and samples.
An executor starts ranks 1..N-1, connects rank 0 to them and watches them:

- `uni`: one rank, nothing to start (tensor_parallel_size 1).
- `mp`: local processes (spawned), one per rank (`parallel/worker.run_rank`).
- `ray`: Ray actors in one placement group (`parallel/ray_executor.py`).

`EXECUTORS` maps the names to the classes (`register` adds one). A rank that exits makes
`dead` say why; `send` then raises `EngineDeadError` instead of waiting on it.

Exit: a started executor is shut down at interpreter exit if its owner has not (a script
that builds `LLM(tensor_parallel_size=N)` and returns), as vLLM does: the ranks get STOP and
are joined before multiprocessing's own exit handler would terminate them and before the
process groups are torn down under live peers (which aborted with `terminate called without
an active exception`, status 134, and leaked the ranks' semaphores).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError, EngineDeadError
from tandem.engine.parallel.comm import (
    Groups,
    PlanChannel,
    close_groups,
    connect,
    host_store,
)
from tandem.engine.parallel.plan import PlanKind, StepPlan

logger = logging.getLogger(__name__)
EXECUTORS: dict[str, type[Executor]] = {}
# started, not yet shut down: held (a script's engine may be garbage before the exit, its
# ranks still running) until `shutdown`
_LIVE: set[Executor] = set()
_live_lock = threading.Lock()


def _shutdown_live() -> None:
    """atexit: shut down every executor still running (ranks stopped and joined)."""
    with _live_lock:
        live = list(_LIVE)
    for executor in live:
        try:
            executor.shutdown()
        except Exception:  # noqa: BLE001 - the others must still stop
            logger.exception("stopping the tensor-parallel ranks at exit failed")


def track(executor: Executor) -> None:
    """Shut `executor` down at exit unless it is first. The hook is registered again after
    each start, so it runs before the exit handlers of what the start set up (atexit runs
    last-in first-out: multiprocessing's, Ray's)."""
    with _live_lock:
        _LIVE.add(executor)
        atexit.unregister(_shutdown_live)
        atexit.register(_shutdown_live)


def register(name: str):  # noqa: ANN201 - a class decorator
    def add(cls: type[Executor]) -> type[Executor]:
        cls.name = name
        EXECUTORS[name] = cls
        return cls
    return add


@dataclass(frozen=True)
class RankSpec:
    """What a rank > 0 needs to start: the engine's config, its place, rank 0's store."""

    config: EngineConfig
    rank: int
    world: int
    host: str
    port: int
    device: str  # this rank's device ("cpu", "cuda:N")
    timeout_s: float = 120.0


class Executor(ABC):
    name = ""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.world = config.tensor_parallel_size
        self.groups: Groups | None = None
        self.channel: PlanChannel | None = None
        self.dead: str | None = None  # why a rank is gone; None while all run
        self._noticed = threading.Event()  # set once `dead` is
        self.on_dead: Callable[[], None] | None = None  # called once, from a watcher thread
        self.send_seconds = 0.0  # wall seconds rank 0 spent sending plans (bench/tp.py)
        self._stopping = False
        self._watcher: threading.Thread | None = None  # waits on the ranks (`watch`)

    @abstractmethod
    def start(self) -> Groups | None:
        """Start ranks 1..N-1; rank 0's groups once all joined (None with one rank)."""

    def rank_device(self, rank: int) -> str:
        """Rank `rank`'s device: the CPU, or the GPU `rank` places after rank 0's."""
        if self.device.type != "cuda":
            return "cpu"
        return f"cuda:{(self.device.index or 0) + rank}"

    def _connect(self, store: object) -> Groups:
        """Rank 0 joins the groups through its own `store` (host and port unused then)."""
        self.groups = connect(0, self.world, "", store.port, self.device, store=store)
        self.channel = PlanChannel(self.groups.ctrl)
        return self.groups

    def send(self, plan: StepPlan) -> None:
        """Hand `plan` to ranks 1..N-1 (before rank 0 runs its own share of it)."""
        if self.channel is None:
            return
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        t0 = time.perf_counter()
        try:
            self.channel.send(plan)
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        self.send_seconds += time.perf_counter() - t0

    def failure(self, exc: BaseException) -> EngineDeadError:
        """What an error inside a step's collectives means: the ranks may be out of step
        (one waits in a collective the others left), so the engine cannot go on. The reason
        is a rank's exit when one is gone (waited for briefly: its exit may trail the
        socket's close), else `exc`."""
        self._await_death(2.0)
        if self.dead is None:
            self._mark_dead(f"rank 0's step failed mid-way ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); the ranks are out of step")
        return EngineDeadError(self.dead or str(exc))

    def _await_death(self, timeout: float) -> None:
        """Wait up to `timeout` s for a rank's exit to be noticed."""
        self._noticed.wait(timeout)

    def _mark_dead(self, why: str) -> None:
        if not self._stopping and self.dead is None:
            self.dead = why
            logger.error("tensor-parallel %s; the engine stops", why)
            self._noticed.set()
            if self.on_dead is not None:
                self.on_dead()

    def shutdown(self) -> None:
        """Stop the ranks (a STOP plan, then they exit); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        with _live_lock:
            _LIVE.discard(self)
        if self.channel is not None and self.dead is None:
            try:
                self.channel.send(StepPlan.control(PlanKind.STOP))
            except RuntimeError:
                logger.warning("a rank was gone at shutdown")
        self._stop_ranks()
        # the watcher wakes as the ranks exit; joined, so that no daemon thread drops the
        # last reference to the process groups during interpreter finalization (their
        # destructor then retakes the GIL, the thread is unwound, and C++ terminates)
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5)
        if self.groups is not None:
            close_groups(self.groups)

    def watch(self, target: Callable[[], None]) -> None:
        """Run `target` (waits for a rank to exit, then `_mark_dead`) in a daemon thread."""
        self._watcher = threading.Thread(target=target, name="tandem-tp-watch", daemon=True)
        self._watcher.start()

    def _stop_ranks(self) -> None:  # noqa: B027 - optional
        """Wait for (and, past a grace period, kill) the ranks."""


@register("uni")
class UniExecutor(Executor):
    def start(self) -> Groups | None:
        if self.world != 1:
            raise ConfigError("the uni executor runs tensor_parallel_size 1 only")
        return None


@register("mp")
class MPExecutor(Executor):
    """Ranks 1..N-1 as spawned local processes (`torch.multiprocessing`'s spawn context)."""

    def start(self) -> Groups:
        import torch.multiprocessing as mp

        from tandem.engine.parallel.worker import run_rank

        store = host_store("127.0.0.1", world=self.world)
        ctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(1, self.world):
            spec = RankSpec(self.config, rank, self.world, "127.0.0.1", store.port,
                            self.rank_device(rank))
            proc = ctx.Process(target=run_rank, args=(spec,), name=f"tandem-tp{rank}",
                               daemon=True)
            proc.start()
            self.procs.append(proc)
        self.watch(self._watch)
        track(self)  # from here on, the ranks are stopped at exit at the latest
        try:
            return self._connect(store)
        except Exception as exc:
            self.shutdown()
            raise ConfigError(f"tensor-parallel ranks did not start: {exc}") from exc

    def _watch(self) -> None:
        sentinels = {p.sentinel: (i + 1, p) for i, p in enumerate(self.procs)}
        ready = wait(list(sentinels))
        rank, proc = sentinels[ready[0]]
        proc.join(timeout=1)
        self._mark_dead(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _stop_ranks(self) -> None:
        grace = 10 if self.dead is None else 1  # after a death the others may be stuck
        for proc in self.procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def build_executor(config: EngineConfig, device: torch.device) -> Executor:
    name = config.distributed_executor_backend or (
        "uni" if config.tensor_parallel_size == 1 else "mp")
    if name == "ray" and "ray" not in EXECUTORS:
        from tandem.engine.parallel import ray_executor  # noqa: F401 - registers "ray"
    cls = EXECUTORS.get(name)
    if cls is None:
        raise ConfigError(f"distributed_executor_backend must be one of "
                          f"{sorted({*EXECUTORS, 'ray'})}, got {name!r}")
    return cls(config, device)
