"""KV-cache events a worker publishes so routers can mirror which blocks it holds."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol.block_hash import BlockHash

# where a worker holds a block: its device pool (a hit costs nothing to load), its host-memory
# tier or its disk tier (a hit loads the pages first); a block may be held in several
MEDIUM_DEVICE = "device"
MEDIUM_HOST = "host"
MEDIUM_DISK = "disk"
MEDIA = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)


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
    medium: str = MEDIUM_DEVICE  # where they are now stored (one of MEDIA)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted and can no longer be hit."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_DEVICE  # the medium they left (one of MEDIA)


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
