"""`tandem serve` on a GPU host: which GPU each worker gets (its CUDA_VISIBLE_DEVICES).

Each worker gets its own GPU while there are enough; beyond that they share round-robin,
splitting the default gpu_memory_utilization, and start one after another so each profiles
its memory alone. A tensor-parallel worker (`--tensor-parallel-size N`) gets N consecutive
GPUs, one per rank (groups shared round-robin likewise); fewer than N visible GPUs is an
error. Without GPUs nothing changes (the workers split the CPU cores).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSlot:
    """One worker's GPUs: its CUDA_VISIBLE_DEVICES value (one GPU per tensor-parallel
    rank), how many workers share them, and the worker's place among them (0 = first)."""

    gpu: str
    sharers: int
    wave: int


def assign_gpus(visible: list[str], n_workers: int, per_worker: int = 1) -> list[GpuSlot]:
    """Worker i gets group i % G of the G = len(visible) // per_worker groups of
    `per_worker` consecutive GPUs: its own while there are enough, else round-robin sharing.
    No GPUs: [] (the workers run on the CPU). ValueError when one group does not fit, or
    `per_worker` < 1."""
    if per_worker < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {per_worker}")
    if not visible:
        return []
    if len(visible) < per_worker:
        raise ValueError(f"--tensor-parallel-size {per_worker} needs {per_worker} GPUs per "
                         f"worker; {len(visible)} visible")
    groups = [",".join(visible[g * per_worker:(g + 1) * per_worker])
              for g in range(len(visible) // per_worker)]
    per_group = [len(range(g, n_workers, len(groups))) for g in range(len(groups))]
    return [GpuSlot(groups[i % len(groups)], per_group[i % len(groups)], i // len(groups))
            for i in range(n_workers)]


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs `tandem serve` may hand out: CUDA_VISIBLE_DEVICES's entries (up to the
    first invalid one, as CUDA reads it), else torch's device count; torch is imported only
    when an NVIDIA device node exists."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        out = []
        for entry in (e.strip() for e in value.split(",")):
            if not entry or entry.startswith("-"):
                break
            out.append(entry)
        return out
    if not glob.glob("/dev/nvidia[0-9]*"):
        return []
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of `name` among pass-through arguments (`--x v` or `--x=v`), or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def gpu_plan(n_workers: int, passthrough: list[str],
             visible: list[str]) -> tuple[list[dict[str, str]], list[int], list[list[str]]]:
    """Per worker: extra environment, start wave and extra flags. GPUs are handed out
    unless `--device` names the CPU or one device; workers sharing a GPU split the default
    gpu_memory_utilization (0.9) unless it was passed."""
    device = flag_value(passthrough, "--device")
    tp = int(flag_value(passthrough, "--tensor-parallel-size")
             or flag_value(passthrough, "-tp") or 1)
    slots = [] if device not in (None, "auto", "cuda") else assign_gpus(visible, n_workers,
                                                                         tp)
    if not slots:
        return [{} for _ in range(n_workers)], [0] * n_workers, [[] for _ in range(n_workers)]
    from tandem.engine.config import EngineConfig

    util = None if flag_value(passthrough, "--gpu-memory-utilization") else (
        EngineConfig.gpu_memory_utilization)
    flags = []
    for slot in slots:
        extra = [] if device else ["--device", "cuda"]  # a GPU worker never runs on the CPU
        if util is not None and slot.sharers > 1:
            extra += ["--gpu-memory-utilization", f"{util / slot.sharers:.4g}"]
        flags.append(extra)
    return ([{"CUDA_VISIBLE_DEVICES": slot.gpu} for slot in slots],
            [slot.wave for slot in slots], flags)
