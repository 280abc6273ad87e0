"""Attention backend interface and registry.

A step's batch is flattened: `T` new tokens from `B` sequences, decodes (one new token)
first. Each backend turns a `BatchLayout` into its own metadata once per step, then per layer
writes the new K/V into the paged cache and attends over each sequence's whole context.

Layers may differ in their scale, sliding window and score soft cap (Gemma 3 alternates
windowed and global layers): `backend.for_layer(spec)` is a view of the backend with that
layer's spec, sharing its cache layout and state, that reads the same per-step metadata
(built once by the backend, for every window its views registered).
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.quant import kv_format

logger = logging.getLogger(__name__)


class BatchLayout:
    """Backend-agnostic description of one step (host-side values plus a few tensors).

    The block tables come as lists (`block_tables`) or as one zero-padded int32 array
    (`block_table`, [B, W]) with each row's length (`table_lens`); either form is derived
    from the other on first access and cached, so a backend reads the one it wants."""

    def __init__(self, query_lens: list[int], seq_lens: list[int],
                 block_tables: list[list[int]] | None, slot_mapping: torch.Tensor,
                 num_decodes: int, block_size: int, block_table: np.ndarray | None = None,
                 table_lens: np.ndarray | None = None) -> None:
        if block_tables is None and (block_table is None or table_lens is None):
            raise ValueError("a BatchLayout needs block_tables, or block_table with table_lens")
        self.query_lens = query_lens  # new tokens per sequence
        self.seq_lens = seq_lens  # context length per sequence after this step (cached + new)
        self.slot_mapping = slot_mapping  # [T] int64: block_id * block_size + offset per token
        self.num_decodes = num_decodes  # the first ones have query_len 1, sorted by seq_len
        self.block_size = block_size
        self._lists = block_tables
        self._array = block_table
        self._lens = table_lens

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def with_tables(self, slot_mapping: torch.Tensor, block_table: np.ndarray,
                    table_lens: np.ndarray) -> BatchLayout:
        """This step's layout over other block tables and slots (a hybrid model's KV
        group: `kv_cache/groups.py`)."""
        return BatchLayout(self.query_lens, self.seq_lens, None, slot_mapping,
                           self.num_decodes, self.block_size, block_table=block_table,
                           table_lens=table_lens)

    @property
    def block_tables(self) -> list[list[int]]:
        """Block ids per sequence, covering seq_lens."""
        if self._lists is None:
            assert self._array is not None and self._lens is not None
            self._lists = [row[:n] for row, n in zip(self._array.tolist(), self._lens.tolist(),
                                                      strict=True)]
        return self._lists

    @block_tables.setter
    def block_tables(self, tables: list[list[int]]) -> None:
        self._lists, self._array, self._lens = tables, None, None

    @property
    def block_table(self) -> np.ndarray:
        """[B, W] int32 block ids, zero-padded; W the longest table (at least 1)."""
        if self._array is None:
            lists = self._lists
            assert lists is not None
            self._lens = np.fromiter(map(len, lists), dtype=np.int32, count=len(lists))
            array = np.zeros((len(lists), max(1, max(map(len, lists), default=0))),
                             dtype=np.int32)
            for i, t in enumerate(lists):
                array[i, : len(t)] = t
            self._array = array
        elif self._array.shape[1] == 0:
            self._array = np.zeros((self._array.shape[0], 1), dtype=np.int32)
        return self._array

    @property
    def table_lens(self) -> np.ndarray:
        """[B] int32 blocks in each row of `block_table`."""
        if self._lens is None:
            self.block_table  # noqa: B018 - derives the lengths
        assert self._lens is not None
        return self._lens


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # keys within this many positions of the query
    logit_softcap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2)


@dataclass(frozen=True)
class GroupedMetadata:
    """A hybrid model's step metadata (`kv_cache/groups.py`): `metas[g]` was built from KV
    group g's block tables and slots; layer i reads `metas[layer_group[i]]`."""

    layer_group: tuple[int, ...]
    metas: tuple[Any, ...]

    def of_layer(self, layer: int) -> Any:
        return self.metas[self.layer_group[layer]]


def group_builders(backend: AttentionBackend, windows: Sequence[int | None]
                   ) -> list[AttentionBackend]:
    """Per KV group, `backend` building the metadata of that group's window only (the
    views of its layers read it: `for_window` of their own window)."""
    return [backend.metadata_builder(w) for w in windows]


class AttentionBackend(ABC):
    """Paged attention. Implementations must be safe for mixed prefill/decode batches."""

    name: str = ""
    # the metadata of a decode-only batch can live in fixed buffers (`static_decode_metadata`)
    # and `forward` launches no host work, so decode steps can be captured as CUDA graphs
    supports_cuda_graphs: bool = False

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto") -> None:
        self.spec = spec
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        # "auto": K/V rows in `dtype`; "fp8" / "int8": uint8 pages of codes, then float16
        # scales (`kv_cache/quant.py`)
        self.kv_format = kv_format(kv_cache_dtype)
        # the sliding window of every layer (`for_layer`), shared with the views: the
        # metadata `build_metadata` returns serves each
        self.layer_windows: list[int | None] = [spec.sliding_window]

    def for_layer(self, spec: AttentionSpec) -> AttentionBackend:
        """This backend for a layer whose `spec` differs from the backend's own only in
        `scale`, `sliding_window` or `logit_softcap` (heads and head size, hence the cache
        layout, are shared): `self` for an equal spec, else a view sharing this backend's
        state whose `forward` reads the metadata of this backend's `build_metadata`. Make the
        views before building metadata. ConfigError for a spec it cannot share."""
        if spec == self.spec:
            return self
        own = self.spec
        if (spec.num_heads, spec.num_kv_heads, spec.head_dim) != (
                own.num_heads, own.num_kv_heads, own.head_dim):
            raise ConfigError(
                f"attention layers of one backend share heads and head size: "
                f"({spec.num_heads}, {spec.num_kv_heads}, {spec.head_dim}) against "
                f"({own.num_heads}, {own.num_kv_heads}, {own.head_dim})")
        view = self._view(spec)
        if spec.sliding_window not in self.layer_windows:
            self.layer_windows.append(spec.sliding_window)
        return view

    def _view(self, spec: AttentionSpec) -> AttentionBackend:
        """A shallow copy with `spec`; backends whose state depends on the spec extend it
        (or raise ConfigError for a spec they cannot run)."""
        view = copy.copy(self)
        view.spec = spec
        return view

    def metadata_builder(self, window: int | None) -> AttentionBackend:
        """A copy of this backend whose `build_metadata` serves the layers of `window` only
        (a hybrid model's KV group); backends with per-step staging state give each copy
        its own."""
        builder = copy.copy(self)
        builder.layer_windows = [window]
        return builder

    def bytes_per_block(self) -> int:
        """KV bytes one block costs in one layer (K and V)."""
        s = self.spec
        return (2 * self.block_size * s.num_kv_heads
                * self.kv_format.row_bytes(s.head_dim, self.dtype))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's K (and V) tensor: [num_blocks, KVH, block_size, D], or quantized
        [num_blocks, KVH, block_size * (D + 2)] uint8 pages (`KVCacheFormat.cache_shape`)."""
        s = self.spec
        return self.kv_format.cache_shape(num_blocks, s.num_kv_heads, self.block_size,
                                          s.head_dim)

    def _zero_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V tensors in the cache's layout and dtype."""
        shape = self.kv_cache_shape(num_blocks)
        dtype = self.kv_format.cache_dtype(self.dtype)
        return (torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device))

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V tensors of one layer for `num_blocks` blocks."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """Precompute per-step indices shared by every layer (and every `for_layer` view)."""

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
    native kernel where it builds (and `native` kernels are allowed), else "torch"; "torch"
    for a model whose attention scores are soft-capped (`spec.logit_softcap`), which only
    the torch backend runs. Triton's interpreter is a test tool, so "auto" never picks it on
    the CPU."""
    from tandem.engine.kernels import triton_unavailable_reason

    if name == "auto":
        if spec.logit_softcap is not None:
            return get_backend("torch")
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
