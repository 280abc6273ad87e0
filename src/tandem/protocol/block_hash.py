"""Prefix-cache block hashing shared by the engine and the router (torch-free).

Every full KV block is named by a SHA-256 digest chained from its parent block, so two
requests share a block only if they share every token before it *and* the same extra keys.

Byte layout (all integers little-endian):

* root (the "parent" of block 0)::

      sha256(b"tandem-kv-root-v1" || field(model_id) || field(adapter_id) || field(cache_salt))

  where ``field(s) = u32(len(utf8(s))) || utf8(s)`` and an absent value is the empty string.
* block ``i``::

      sha256(b"tandem-kv-block-v1" || parent(32 bytes) || u32(n) || u32(token_0) .. u32(token_n-1))

The extra keys therefore reach every block through the chain: a per-tenant ``cache_salt``
or another LoRA adapter yields a disjoint hash space, and SHA-256 keeps collisions from
being constructible (predictable hashes let one request poison another's cache).

A LoRA adapter enters as the hex digest of its effective weights
(`engine.lora.peft.adapter_digest`), never its name: a different adapter loaded under a
name used before never matches the old one's blocks, and the same files loaded again do.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 32-byte SHA-256 digest
_ROOT_TAG = b"tandem-kv-root-v1"
_BLOCK_TAG = b"tandem-kv-block-v1"
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class HashKeys:
    """Keys that partition the prefix cache besides the tokens themselves."""

    model_id: str = ""
    adapter_id: str = ""  # the LoRA adapter's weight digest (hex); "" = base model
    cache_salt: str = ""  # per-tenant salt from the request; "" = shared cache


def request_hash_keys(model_id: str, adapter_digest: str | None = None,
                      cache_salt: str | None = None) -> HashKeys:
    """The keys of a request for `model_id` (the base model's served name) run with the
    LoRA adapter whose weights have digest `adapter_digest` (None: the base model) and
    `cache_salt`: every place that hashes a prompt (engine, prefill service, decode-side
    client, router) derives them here, so two adapters' weights, or an adapter and its base
    model, never share a block."""
    return HashKeys(model_id, adapter_digest or "", cache_salt or "")


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U32.pack(len(raw)) + raw


@functools.lru_cache(maxsize=4096)  # few distinct (model, adapter, salt) keys; hot per request
def root_hash(keys: HashKeys) -> BlockHash:
    """The parent hash of a request's first block."""
    h = hashlib.sha256(_ROOT_TAG)
    h.update(_field(keys.model_id))
    h.update(_field(keys.adapter_id))
    h.update(_field(keys.cache_salt))
    return h.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    if type(token_ids) is list:  # fromlist: the same checks, ~1.5-2x faster than array(, list)
        arr = array("I")
        arr.fromlist(token_ids)
    else:
        arr = array("I", token_ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one block of token ids given its parent's hash (see module docstring)."""
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent)
    h.update(_U32.pack(len(token_ids)))
    h.update(_token_bytes(token_ids))
    return h.digest()


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    keys: HashKeys = HashKeys(),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`; a trailing partial block is not hashed.

    `parent` continues an existing chain (the hash of the block before `token_ids[0]`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = root_hash(keys) if parent is None else parent
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    return hash_block_bytes(token_bytes(token_ids[: n_full * block_size]), block_size, prev)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the chain hashes them: u32 little-endian each."""
    return _token_bytes(token_ids)


def hash_block_bytes(data: bytes, block_size: int, parent: BlockHash) -> list[BlockHash]:
    """The chain over `data` (`token_bytes` of whole blocks) continuing from `parent`:
    the same bytes as hash_block, one concatenation and one C call per block."""
    head, step, sha = _BLOCK_TAG, block_size * 4, hashlib.sha256
    size = _U32.pack(block_size)
    out: list[BlockHash] = []
    prev = parent
    for off in range(0, len(data) - step + 1, step):
        prev = sha(head + prev + size + data[off : off + step]).digest()
        out.append(prev)
    return out
