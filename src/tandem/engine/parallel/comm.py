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
import errno
import logging
import os
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tandem.engine.parallel.plan import HEADER, StepPlan
from tandem.engine.parallel.tp import TPGroup

logger = logging.getLogger(__name__)


@dataclass
class Groups:
    rank: int
    world: int
    tp: TPGroup
    ctrl: dist.Backend
    store: dist.Store


def host_store(host: str, timeout_s: float = 120.0,
               world: int | None = None) -> dist.TCPStore:
    """Blocking: a master TCPStore (`store.port`) on a fresh port of `host`'s address only
    (a TCPStore left to bind itself listens on every interface), for `world` ranks (None:
    any number). Where `host` is not an address of this machine (advertised through NAT),
    every interface, with a warning."""
    family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            logger.warning("%s is not an address here; the TCPStore listens on every "
                           "interface", host)
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        sock.listen(128)
        bound, port = sock.getsockname()[:2]
    except BaseException:
        sock.close()
        raise
    if bound in ("0.0.0.0", "::"):
        bound = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    fd = sock.detach()  # the store owns the listening socket from here
    try:
        return dist.TCPStore(bound, port, world, True, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


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


def close_groups(groups: Groups) -> None:
    """A rank's side of `destroy_process_group` once the ranks are done (STOP served or
    the ranks joined): both backends shut down, their threads joined now rather than torn
    down at interpreter exit (where gloo's aborted the process now and then); idempotent."""
    for backend in (groups.ctrl, groups.tp.backend):
        if backend is None:
            continue
        try:
            backend.shutdown()
        except Exception as exc:  # noqa: BLE001 - a backend already gone
            logger.debug("process group shutdown: %s", exc)


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
        data = torch.from_numpy(plan.encode())  # 1-D: both slices are contiguous views
        broadcast(self.ctrl, data[:HEADER])
        if len(data) > HEADER:
            broadcast(self.ctrl, data[HEADER:])

    def recv(self) -> StepPlan:
        header = torch.empty(HEADER, dtype=torch.int64)
        broadcast(self.ctrl, header)
        size = StepPlan.payload_size(header.numpy())
        payload = torch.empty(size, dtype=torch.int64)
        if size:
            broadcast(self.ctrl, payload)
        return StepPlan.decode(np.concatenate([header.numpy(), payload.numpy()]))
