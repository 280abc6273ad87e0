"""One KV block's pages as a self-describing, verifiable record (the host and disk tiers'
unit).

A record is `MAGIC`, a 4-byte little-endian header length, a JSON header, then the payload:
every layer's pages of the block (`[L, 2, 1, KVH, bs, row]` in the cache's storage dtype,
contiguous), compressed by `compression`. The header names the block hash, its parent hash,
the adapter digest, the layout (shape and dtype) and the compression, and carries the XXH3-64
digest of the header's other fields and the stored payload: `decode` refuses a record whose
digest, block hash, layout, dtype or adapter digest is not the one expected (`CorruptBlock`),
so a torn, flipped or misplaced record is never served.

Compressions: "none"; "zlib" (lossless: the payload's bytes shuffled by position in their
element, so the exponent bytes of a float cache sit together, then zlib level 1; stdlib and
numpy only). An int8 / fp8 cache's pages are stored as they are (codes + scales).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tandem.protocol.engine_flags import KV_OFFLOAD_COMPRESSIONS as COMPRESSIONS

MAGIC = b"TKVB1\n"
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


class CorruptBlock(ValueError):
    """A record that does not verify (torn, altered, or not the block expected)."""


@dataclass(frozen=True)
class BlockMeta:
    """What a record is of: its chain position and the adapter that computed it."""

    block_hash: bytes
    parent_hash: bytes = b""
    lora_digest: str = ""


def _shuffle(raw: bytes, width: int) -> bytes:
    if width == 1:
        return raw
    return np.frombuffer(raw, np.uint8).reshape(-1, width).T.tobytes()


def _unshuffle(raw: bytes, width: int) -> bytes:
    if width == 1:
        return raw
    return np.frombuffer(raw, np.uint8).reshape(width, -1).T.tobytes()


def _digest(fields: dict, payload: bytes) -> str:
    h = xxhash.xxh3_64(json.dumps(fields, sort_keys=True).encode())
    h.update(payload)
    return h.hexdigest()


def encode(pages: torch.Tensor, meta: BlockMeta, compression: str = "none") -> bytes:
    """`pages`: one block's layers, `[L, 2, 1, KVH, bs, row]` on the host."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    pages = pages.contiguous()
    width = pages.element_size()
    raw = pages.view(torch.uint8).numpy().tobytes()
    payload = raw if compression == "none" else zlib.compress(_shuffle(raw, width), 1)
    fields = {"hash": meta.block_hash.hex(), "parent": meta.parent_hash.hex(),
              "lora": meta.lora_digest, "shape": list(pages.shape),
              "dtype": str(pages.dtype).removeprefix("torch."), "comp": compression,
              "raw": len(raw)}
    header = json.dumps({**fields, "digest": _digest(fields, payload)}).encode()
    return MAGIC + _LEN.pack(len(header)) + header + payload


def read_header(record: bytes) -> tuple[dict, bytes]:
    """The header's fields and the payload; CorruptBlock if the framing is torn."""
    if not record.startswith(MAGIC) or len(record) < len(MAGIC) + _LEN.size:
        raise CorruptBlock("not a KV block record")
    (n,) = _LEN.unpack_from(record, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if n > MAX_HEADER or len(record) < start + n:
        raise CorruptBlock("torn record header")
    try:
        fields = json.loads(record[start:start + n])
        digest = fields.pop("digest")
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise CorruptBlock(f"unreadable record header: {exc}") from None
    payload = record[start + n:]
    if not isinstance(digest, str) or _digest(fields, payload) != digest:
        raise CorruptBlock("record digest mismatch")
    return fields, payload


def verify(record: bytes) -> bytes:
    """The block hash of a record whose digest checks (a disk tier's rebuild)."""
    fields, _ = read_header(record)
    try:
        return bytes.fromhex(fields["hash"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptBlock(f"bad block hash in header: {exc}") from None


def decode(record: bytes, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype,
           lora_digest: str) -> torch.Tensor:
    """The pages of a record that is the block `block_hash` of this layout and adapter;
    CorruptBlock naming what differs otherwise."""
    fields, payload = read_header(record)
    want_dtype = str(dtype).removeprefix("torch.")
    for name, got, want in (("block hash", fields.get("hash"), block_hash.hex()),
                            ("layout", fields.get("shape"), list(shape)),
                            ("dtype", fields.get("dtype"), want_dtype),
                            ("adapter digest", fields.get("lora"), lora_digest)):
        if got != want:
            raise CorruptBlock(f"{name} {got!r} is not the expected {want!r}")
    width = dtype.itemsize
    try:
        raw = payload if fields["comp"] == "none" else _unshuffle(
            zlib.decompress(payload), width)
    except (KeyError, zlib.error, ValueError) as exc:
        raise CorruptBlock(f"payload does not decompress: {exc}") from None
    if len(raw) != fields.get("raw") or len(raw) != int(np.prod(shape)) * width:
        raise CorruptBlock("payload size does not match its layout")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
