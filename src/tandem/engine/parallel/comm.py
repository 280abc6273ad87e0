"""The process groups of one tensor-parallel engine and rank 0's plan channel.

`connect` joins rank `rank` of `world` through a TCPStore at `host:port` (rank 0 hosts it)
and builds two groups of its own, registered nowhere (so one process may hold several
engines, one after another or at once): `tp`, the model's collectives (NCCL on CUDA, gloo on
the CPU), and `ctrl`, always gloo on host tensors, which carries the step plans and the KV
page moves of P/D transfers. Peers that die show up as a RuntimeError from the next
collective (gloo sees the socket close); `timeout_s` bounds a peer that hangs instead.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tandem.engine.parallel.plan import HEADER, StepPlan
from tandem.engine.parallel.tp import TPGroup


@dataclass
class Groups:
    rank: int
    world: int
    tp: TPGroup
    ctrl: dist.Backend
    store: dist.Store


def host_store(world: int, host: str = "127.0.0.1", timeout_s: float = 120.0) -> dist.TCPStore:
    """Rank 0's store on a free port of `host` (`store.port`), before the others start."""
    return dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect(rank: int, world: int, host: str, port: int, device: torch.device,
            timeout_s: float = 120.0, store: dist.Store | None = None) -> Groups:
    """Blocks until all `world` ranks joined (rank 0 passes its `host_store`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, world, timeout)
    if device.type == "cuda":
        tp_backend = dist.ProcessGroupNCCL(dist.PrefixStore("tp", store), rank, world)
    else:
        tp_backend = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, world, timeout)
    return Groups(rank, world, TPGroup(world, backend=tp_backend), ctrl, store)


def broadcast(ctrl: dist.Backend, tensor: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    ctrl.broadcast([tensor], opts).wait()


def all_reduce_min(ctrl: dist.Backend, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    ctrl.allreduce([t], opts).wait()
    return int(t.item())


class PlanChannel:
    """Rank 0 `send`s each plan, the other ranks `recv` it, in the same order."""

    def __init__(self, ctrl: dist.Backend) -> None:
        self.ctrl = ctrl

    def send(self, plan: StepPlan) -> None:
        data = torch.from_numpy(plan.encode())
        broadcast(self.ctrl, data[:HEADER].clone())
        if len(data) > HEADER:
            broadcast(self.ctrl, data[HEADER:].clone())

    def recv(self) -> StepPlan:
        header = torch.empty(HEADER, dtype=torch.int64)
        broadcast(self.ctrl, header)
        size = StepPlan.payload_size(header.numpy())
        payload = torch.empty(size, dtype=torch.int64)
        if size:
            broadcast(self.ctrl, payload)
        return StepPlan.decode(np.concatenate([header.numpy(), payload.numpy()]))
