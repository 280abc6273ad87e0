"""The KV page format shared by every transfer backend, and its validation.

A transfer moves `n` blocks of every layer: full blocks of the prompt, named by their hashes,
and optionally the prompt's partial last block after them (`tail_tokens`: the tokens up to
the prompt's last one, so the receiver computes only that token). Per layer the payload is
one tensor `[2, n, num_kv_heads, *page]` (K of the n blocks, then V; `PageLayout.layer_shape`),
contiguous, in the cache's storage dtype: `layer_bytes = 2 * n * num_kv_heads * page_bytes`.
With `kv_cache_dtype` "auto" a page is `[block_size, head_dim]` in the engine's float dtype.
With "fp8" or "int8" the cache is uint8 and a page is `block_size * (head_dim + 2)` bytes:
the block's rows' `head_dim` code bytes each (e4m3fn or signed int8 two's complement), then
their scales as float16 little-endian (row o's codes at byte `o * head_dim`, its scale at
`block_size * head_dim + 2 * o`; the value is `code * scale`), so the pages carry their
codes and scales together and no scale travels apart. The header names that format
(`kv_page_format` 1); quantized pages of an older sender (0: rows with their scale inline)
are refused. Layers go in order 0..num_layers-1. Each layer's bytes have an XXH3-64 digest
(seed 0, `PageChecksum`); the trailer's checksum is XXH3-64 over those digests, 8 bytes
little-endian each, in layer order (`transfer_digest`). Each layer's digest travels right
after its bytes (`PageLayerEnd`), so a receiver validates the layer at once and can write it
while the next one arrives. The block ids are each side's own; only hashes cross the wire.

`PageLayout` is what both ends must agree on (model, shapes, storage dtype, KV cache dtype;
the header's `head_dim` is the model's, whatever the row format); `check_header` checks a
received header against the receiver's layout and the hashes it asked for, before any byte
touches its cache. A header without `kv_cache_dtype` (an older sender) means "auto".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import xxhash

# the engine's, imported from here too
from tandem.engine.kv_pages import PageLayout as PageLayout
from tandem.engine.kv_pages import layer_page_views as layer_page_views
from tandem.engine.kv_pages import tensor_bytes as tensor_bytes
from tandem.protocol import worker_pb2
from tandem.protocol.block_hash import BlockHash

MAX_DATA_CHUNK = 4 << 20  # bytes per PageData message (gRPC's default limit is 4 MiB)
SEND_CHUNK = 1 << 20  # what senders use


# a receiver's consumer of validated pages: (layer, [2, n, kvh, bs, row] pages) -> awaited;
# the tensor is valid only until the awaitable completes (the backend reuses its buffer)
LayerSink = Callable[[int, torch.Tensor], Awaitable[None]]


@runtime_checkable
class HashingSink(Protocol):
    """A `LayerSink` that can also write a layer while hashing it, so the bytes cross memory
    once (an import's `_PageWriter`). `write_hashed(layer, pages)` writes the pages and
    returns the XXH3-64 of all of them as read (blocks it skips included), or None when it
    cannot (nothing written: the backend checks the digest, then calls the sink). Its
    writes go only into blocks nothing reads before the transfer succeeds (an import's
    pinned fresh blocks): a digest that then differs fails the transfer, and the caller
    frees those blocks uncached."""

    def __call__(self, layer: int, pages: torch.Tensor) -> Awaitable[None]: ...

    def write_hashed(self, layer: int, pages: torch.Tensor) -> Awaitable[int | None]: ...


class KVTransferError(Exception):
    """A transfer failed or was refused; `reason` is a short machine-readable cause."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def engine_layout(model_id: str, engine: Any) -> PageLayout:
    """The wire layout of an engine's KV pages (`LLMEngine.page_layout`; an `LLMEngine` or
    an `AsyncLLMEngine`)."""
    return engine.page_layout(model_id)


class PageChecksum:
    """XXH3-64 over a transfer's bytes, fed in order (any split gives the same digest).

    Chosen over zlib.crc32 for speed: ~24 GB/s against ~3 on this project's CPUs, with the
    GIL released while it hashes. Feed pieces of ~1 MiB or more: a call made from a worker
    thread may wait for the GIL on the way back.
    """

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | bytearray | memoryview) -> PageChecksum:
        self._h.update(data)
        return self

    def digest(self) -> int:
        """The unsigned 64-bit value the trailer carries."""
        return self._h.intdigest()


def transfer_digest(layer_digests: Sequence[int]) -> int:
    """The trailer's checksum: XXH3-64 over the layers' digests (8 bytes little-endian
    each, layer order)."""
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in layer_digests))


def layer_buffer(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """An uninitialised byte tensor (no zero-fill pass) and a writable view of it."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t, memoryview(t.numpy()).cast("B")


def header_for(layout: PageLayout, first_block: int, hashes: list[BlockHash], lease_id: str,
               first_token: int, tail_tokens: int = 0) -> worker_pb2.PageHeader:
    """The header of a transfer of the full blocks `hashes`, plus the prompt's partial block
    after them when `tail_tokens` > 0."""
    n = Offer(len(hashes), tail_tokens).num_blocks
    return worker_pb2.PageHeader(
        model_id=layout.model_id, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, block_size=layout.block_size,
        head_dim=layout.head_dim, dtype=layout.dtype_name, first_block=first_block,
        block_hashes=hashes, layer_bytes=n * layout.block_layer_bytes,
        lease_id=lease_id, first_token=first_token, tail_tokens=tail_tokens,
        kv_cache_dtype=layout.cache_dtype, kv_page_format=layout.page_format)


@dataclass(frozen=True)
class Offer:
    """What a checked header offers: `num_full` hashed blocks (a prefix of those asked
    for), then the partial block when `tail_tokens` > 0."""

    num_full: int
    tail_tokens: int

    @property
    def num_blocks(self) -> int:
        """Blocks in each layer's pages."""
        return self.num_full + (1 if self.tail_tokens else 0)


def check_header(header: worker_pb2.PageHeader, layout: PageLayout, first_block: int,
                 expected: list[BlockHash], tail_tokens: int = 0) -> Offer:
    """Validate a received header against the receiver's `layout` and what it asked for
    (`expected`: hashes of blocks first_block..; `tail_tokens`: the partial block's tokens,
    0 for none). The sender may offer fewer blocks, and the partial block only after every
    full one. A KV cache dtype other than the receiver's is refused first, by name (""
    from an older sender is "auto"). Raises KVTransferError("invalid")."""

    def bad(msg: str) -> KVTransferError:
        return KVTransferError("invalid", f"page header rejected: {msg}")

    theirs_kv = header.kv_cache_dtype or "auto"
    if theirs_kv != layout.cache_dtype:
        raise bad(f"kv cache dtype {theirs_kv[:32]} on the sender, {layout.cache_dtype} here")
    if header.kv_page_format != layout.page_format:
        raise bad(f"{layout.cache_dtype} pages in format {header.kv_page_format} on the sender "
                  f"(0: rows with their scale inline, an older version), {layout.page_format} "
                  "here")

    mine = (layout.model_id, layout.num_layers, layout.num_kv_heads, layout.block_size,
            layout.head_dim, layout.dtype_name)
    theirs = (header.model_id, header.num_layers, header.num_kv_heads, header.block_size,
              header.head_dim, header.dtype)
    if theirs != mine:
        raise bad(f"geometry {theirs} does not match this worker's {mine}")
    if header.first_block != first_block:
        raise bad(f"first block {header.first_block}, asked for {first_block}")
    n = len(header.block_hashes)
    if n > len(expected) or list(header.block_hashes) != expected[:n]:
        raise bad("block hashes differ from this worker's hash chain of the prompt")
    tail = header.tail_tokens
    if tail and (tail != tail_tokens or n != len(expected)):
        raise bad(f"a partial block of {tail} tokens after {n} blocks; asked for "
                  f"{tail_tokens} after {len(expected)}")
    offer = Offer(n, tail)
    if header.layer_bytes != offer.num_blocks * layout.block_layer_bytes:
        raise bad(f"layer size {header.layer_bytes} bytes, expected "
                  f"{offer.num_blocks * layout.block_layer_bytes}")
    return offer
