"""Host <-> device staging for per-step engine inputs and results.

On CUDA a host buffer is pinned and copied without blocking (the caching host allocator
keeps it alive until the copy is done), and results come back through pinned memory with
one wait; on the CPU nothing is copied. Host tensors are always created with an explicit
device, so a surrounding `torch.device(...)` context cannot move them.

`start_download` starts a result's copy without waiting (a CUDA event marks its end);
`PendingOutput` is a step whose sampled ids are on their way (`async_scheduling`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tandem.engine.core import RunnerOutput


def upload(values: Sequence[float] | Sequence[int] | np.ndarray, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """1-D `values` on `device`: filled into (pinned, on CUDA) host memory and copied once,
    without blocking; on the CPU the host tensor itself."""
    pin = device.type == "cuda"
    host = torch.empty(len(values), dtype=dtype, device="cpu", pin_memory=pin)
    if len(values):
        host.numpy()[:] = values
    return host if device.type == "cpu" else host.to(device, non_blocking=pin)


def download(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: on CUDA one copy into pinned memory, waited for."""
    if t.device.type == "cpu":
        return t
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


class IndexUploads:
    """The int64 index segments of one step, uploaded as one buffer with one copy:
    `add` each segment (it returns its number), then `upload` gives one device view per
    segment, in order."""

    def __init__(self) -> None:
        self.parts: list[Sequence[int]] = []

    def add(self, values: Sequence[int]) -> int:
        self.parts.append(values)
        return len(self.parts) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        flat = upload(list(chain.from_iterable(self.parts)), torch.int64, device)
        return list(flat.split([len(p) for p in self.parts]))


@dataclass
class HostCopy:
    """A device-to-host copy in flight: `wait()` gives the host tensor (on the CPU, the
    tensor itself at once)."""

    host: torch.Tensor
    event: torch.cuda.Event | None = None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def start_download(t: torch.Tensor) -> HostCopy:
    """Start copying `t` to the host: on CUDA into pinned memory, non-blocking, with an
    event recorded after it on the current stream; elsewhere the copy is immediate."""
    if t.device.type == "cpu":
        return HostCopy(t)
    if t.device.type != "cuda":
        return HostCopy(t.cpu())
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return HostCopy(host, event)


@dataclass
class PendingOutput:
    """One launched step (`ModelRunner.execute_async`). `output` holds the host-side parts
    already known: everything when `sampled` is None; otherwise all but the sampled ids of
    the requests in `rows` (request id -> its row in `sampled`, the step's [N] int64
    sampled ids on the device, copied to the host by `copy`). The next step's inputs read
    those ids from `sampled` on the device."""

    output: RunnerOutput
    sampled: torch.Tensor | None = None
    rows: dict[str, int] = field(default_factory=dict)
    copy: HostCopy | None = None

    @property
    def deferred(self) -> bool:
        """True while sampled ids are still to come from the device."""
        return self.copy is not None

    def resolve(self) -> RunnerOutput:
        """The step's whole output: waits for the sampled ids' copy (its event) only."""
        if self.copy is not None:
            ids = self.copy.wait().tolist()
            self.copy = None
            for rid, row in self.rows.items():
                self.output.sampled[rid] = int(ids[row])
        return self.output
