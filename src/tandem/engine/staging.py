"""Host <-> device staging for per-step engine inputs and results.

On CUDA a host buffer is pinned and copied without blocking (the caching host allocator
keeps it alive until the copy is done), and results come back through pinned memory with
one wait; on the CPU nothing is copied. Host tensors are always created with an explicit
device, so a surrounding `torch.device(...)` context cannot move them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


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
