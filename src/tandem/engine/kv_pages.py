"""Typed values of the engine's KV page API: a page layout, import pins and commits.

`PageLayout` is the geometry both ends of a page transfer share (`LLMEngine.page_layout`
gives an engine's, with all of the model's KV heads whatever its tensor-parallel size).
`ImportPins` and `ImportCommit` are what `AsyncLLMEngine.import_blocks` returns and
`AsyncLLMEngine.commit_import` takes: the pins of blocks that pages from elsewhere are
written into, and how they join the prefix cache once written. `layer_page_views` and
`tensor_bytes` read pages' bytes in place from a host-memory cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tandem.engine.kv_cache.block_pool import KVBlock
from tandem.engine.kv_cache.quant import KV_FORMATS, SCALE_BYTES
from tandem.protocol.block_hash import BlockHash

# `PageHeader.kv_page_format` of quantized pages: a block's rows' codes, then their scales
QUANTIZED_PAGE_FORMAT = 1


@dataclass(frozen=True)
class PageLayout:
    """The KV cache geometry both ends of a transfer must share. `head_dim` is the model's;
    `dtype` is the cache tensors' storage dtype (the float dtype for `cache_dtype` "auto",
    uint8 for "fp8" / "int8"). A page is one block of one KV head: `[block_size, head_dim]`
    in `dtype`, or quantized `[block_size * (head_dim + 2)]` uint8, the codes
    (`code_bytes`) then one float16 scale per token (`scale_bytes`; `kv_cache/quant.py`)."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_FORMATS:
            raise ValueError(f"kv cache dtype must be one of {KV_FORMATS}, got "
                             f"{self.cache_dtype!r}")
        if not (self.dtype == torch.uint8 if self.quantized else self.dtype.is_floating_point):
            raise ValueError(f"a {self.cache_dtype!r} KV cache cannot be stored as "
                             f"{self.dtype_name} (quantized caches are uint8, others float)")

    @property
    def quantized(self) -> bool:
        return self.cache_dtype != "auto"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page's shape in `dtype` (a cache tensor's shape after [blocks, kv_heads])."""
        if self.quantized:
            return (self.block_size * (self.head_dim + SCALE_BYTES),)
        return (self.block_size, self.head_dim)

    @property
    def code_bytes(self) -> int:
        """Bytes of a page's values (quantized: its codes, first in the page)."""
        return self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of a page's float16 scales after its codes (0 unquantized)."""
        return self.block_size * SCALE_BYTES if self.quantized else 0

    @property
    def page_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes

    @property
    def page_format(self) -> int:
        """The wire's `kv_page_format`: 1 for quantized pages (codes, then scales), 0 for
        "auto" pages."""
        return QUANTIZED_PAGE_FORMAT if self.quantized else 0

    @property
    def row_bytes(self) -> int:
        """Bytes one token of one KV head costs (quantized: its codes and its scale)."""
        return self.page_bytes // self.block_size

    @property
    def block_layer_bytes(self) -> int:
        """K + V bytes of one block in one layer."""
        return 2 * self.num_kv_heads * self.page_bytes

    def rank_heads(self, rank: int, world: int) -> range:
        """The KV heads tensor-parallel rank `rank` of `world` caches (`tp.kv_heads`)."""
        from tandem.engine.parallel.tp import kv_heads

        return kv_heads(self.num_kv_heads, world, rank)

    def kv_heads_per_rank(self, world: int) -> int:
        """KV heads each of `world` ranks caches (every rank holds as many)."""
        return len(self.rank_heads(0, world))

    def rank_layout(self, rank: int, world: int) -> PageLayout:
        """The layout of rank `rank`'s share of these pages (its KV heads only)."""
        return dataclasses.replace(self, num_kv_heads=len(self.rank_heads(rank, world)))

    def layer_shape(self, n: int) -> tuple[int, ...]:
        """The shape of `n` blocks' pages of one layer (K's, then V's), in `dtype`."""
        return (2, n, self.num_kv_heads, *self.page_shape)

    @classmethod
    def of(cls, model_id: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
           cache_dtype: str = "auto", block_size: int | None = None) -> PageLayout:
        """From an engine's per-layer (K, V) caches: `[blocks, kv_heads, block_size,
        head_dim]`, or for a quantized `cache_dtype` `[blocks, kv_heads, block_size *
        (head_dim + 2)]` uint8 pages, whose `block_size` must be given. Raises ValueError
        when the tensors do not hold that format."""
        k = kv_caches[0][0]
        if cache_dtype == "auto" or cache_dtype not in KV_FORMATS:
            if k.dim() != 4:
                raise ValueError(f"a {cache_dtype!r} KV cache is [blocks, kv_heads, "
                                 f"block_size, head_dim], got {tuple(k.shape)}")
            return cls(model_id, len(kv_caches), k.shape[1], k.shape[2], k.shape[3],
                       k.dtype, cache_dtype)
        if block_size is None or block_size < 1:
            raise ValueError(f"a {cache_dtype!r} KV cache's layout needs its block_size")
        if k.dim() != 3 or k.shape[2] % block_size or k.shape[2] // block_size <= SCALE_BYTES:
            raise ValueError(f"a {cache_dtype!r} KV cache of shape {tuple(k.shape)} is not "
                             f"pages of {block_size} rows: it has no head_dim")
        return cls(model_id, len(kv_caches), k.shape[1], block_size,
                   k.shape[2] // block_size - SCALE_BYTES, k.dtype, cache_dtype)


@dataclass(frozen=True)
class ImportPins:
    """Blocks pinned for pages arriving from elsewhere (`KVCacheManager.import_blocks`):
    `blocks` in chain order (the full blocks, then, when asked for, one for the prompt's
    last block); `fresh`: the indexes into `blocks` whose pages must be written (the others
    were cached here already). Both empty when the pool could not supply them all.
    `blocks` is the list `commit_import` updates in place."""

    blocks: list[KVBlock]
    fresh: list[int]

    @property
    def pinned(self) -> bool:
        return bool(self.blocks)


@dataclass(frozen=True)
class ImportCommit:
    """How written pages join the prefix cache (`AsyncLLMEngine.commit_import`): the first
    `len(hashes)` pinned blocks are registered under `hashes` (after `parent_hash`), holding
    `token_ids`; the block after them, when pinned, is staged for `request_id` as the
    prompt's block number `tail_index` holding `tail_token_ids`
    (`KVCacheManager.stage_tail`). `lora_name` / `lora_digest`: the adapter the pages were
    computed with ("": the base model)."""

    request_id: str
    hashes: list[BlockHash]
    parent_hash: BlockHash
    token_ids: list[int]
    tail_index: int
    tail_token_ids: list[int]
    lora_name: str = ""
    lora_digest: str = ""


def layer_page_views(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layer: int,
                     block_ids: list[int]) -> list[memoryview] | None:
    """`engine.kv_cache.pages.gather_layer`'s bytes without the copy: K pages of
    `block_ids`, then V pages, as views into a host-memory cache (None for a device cache).
    Valid while the blocks stay pinned."""
    k, v = kv_caches[layer]
    if k.device.type != "cpu" or not (k.is_contiguous() and v.is_contiguous()):
        return None
    page = k[0].numel() * k.element_size()
    out = []
    for t in (k, v):
        raw = tensor_bytes(t)
        out += [raw[b * page:(b + 1) * page] for b in block_ids]
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
