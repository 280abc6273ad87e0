"""Attention backend interface and registry.

A step's batch is flattened: `T` new tokens from `B` sequences, decodes (one new token)
first. Each backend turns a `BatchLayout` into its own metadata once per step, then per layer
writes the new K/V into the paged cache and attends over each sequence's whole context.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class BatchLayout:
    """Backend-agnostic description of one step (host-side values plus a few tensors)."""

    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    block_tables: list[list[int]]  # block ids per sequence, covering seq_lens
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    num_decodes: int  # the first num_decodes sequences have query_len 1, sorted by seq_len
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None


class AttentionBackend(ABC):
    """Paged attention. Implementations must be safe for mixed prefill/decode batches."""

    name: str = ""
    # the metadata of a decode-only batch can live in fixed buffers (`static_decode_metadata`)
    # and `forward` launches no host work, so decode steps can be captured as CUDA graphs
    supports_cuda_graphs: bool = False

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec = spec
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    def bytes_per_block(self) -> int:
        """KV bytes one block costs in one layer (K and V)."""
        s = self.spec
        return 2 * self.block_size * s.num_kv_heads * s.head_dim * torch.finfo(self.dtype).bits // 8

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V tensors of one layer for `num_blocks` blocks."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """Precompute per-step indices shared by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (new tokens) -> out [T, H, D]; writes k/v to the cache."""

    def static_decode_metadata(self, sizes: Sequence[int], max_model_len: int) -> Any:
        """Metadata in fixed buffers for decode-only batches padded to each of `sizes` rows
        (CUDA graphs), as {size: metadata}; `build_metadata(layout, out=...)` refills one in
        place. Only where `supports_cuda_graphs`."""
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA-graph path")


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_backend(name: str) -> type[AttentionBackend]:
    # import built-in backends so they register themselves (triton_backend imports triton
    # itself only when a backend is built, so torch-only installs get here too)
    from tandem.engine.attention import cpu_backend, torch_backend, triton_backend  # noqa: F401

    if name not in _REGISTRY:
        raise ConfigError(
            f"unknown attention backend {name!r}; available: auto, "
            f"{', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def resolve_backend(name: str, spec: AttentionSpec, dtype: torch.dtype,
                    device: torch.device, native: bool = True) -> type[AttentionBackend]:
    """`name`'s class for `device`, or a ConfigError saying why it cannot run there.

    "auto": "triton" on CUDA (torch, with a warning, where Triton cannot run); on the CPU the
    native kernel where it builds (and `native` kernels are allowed), else "torch". Triton's
    interpreter is a test tool, so "auto" never picks it on the CPU."""
    from tandem.engine.kernels import triton_unavailable_reason

    if name == "auto":
        if device.type == "cuda":
            reason = triton_unavailable_reason(device)
            if reason is None:
                return get_backend("triton")
            logger.warning("attention backend 'auto' falls back to 'torch' on %s: %s",
                           device, reason)
            return get_backend("torch")
        from tandem.engine.attention.cpu_backend import native_available

        name = "cpu" if native and native_available(spec, dtype, device) else "torch"
    cls = get_backend(name)
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ConfigError(f"attention backend 'triton' cannot run on {device}: {reason}")
    elif name == "cpu" and device.type != "cpu":
        raise ConfigError(f"attention backend 'cpu' runs only on the CPU, not on {device}; "
                          "use 'triton' or 'torch' (or 'auto')")
    return cls
