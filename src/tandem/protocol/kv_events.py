"""KV-cache events a worker publishes so routers can mirror which blocks it holds."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became reusable from the prefix cache, in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash  # hash before block_hashes[0] (a root hash for a first block)
    # len == block_size * len(block_hashes): the prompt's text, for in-process consumers
    # only; never serialized (grpc_server.event_to_proto sends hashes, the proto reserves it)
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""  # the LoRA adapter that computed them; "": none
    lora_digest: str = ""  # that adapter's weight digest: what their hashes key it by


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted and can no longer be hit."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
