"""Receiver side of a peer pull: fetch the leading prompt blocks another worker already holds.

`PeerPull.pull(target, request_id, token_ids, cache_salt, lora_name, hint)`:
1. hash the prompt as the engine does (`RemotePrefill.plan`) and count the leading full
   blocks this worker holds; the full blocks after them, up to the last one before the
   prompt's last token, are asked for (a router's `hint` of how many the holder has that is
   no more than the local hit skips the call). The local run is pinned meanwhile;
2. call `KVTransfer.Prefill` on the holder with `cached_only` (it computes nothing,
   `pull_service`): its header names the leading run of the asked blocks it holds, checked
   against this worker's layout and hash chain (`check_header`, as P/D); none ends the
   pull (`none_held`); fewer than asked is fine (`partial`);
3. pin blocks for the offered ones, all or none (reusing any cached meanwhile; no room:
   `NoRoomForImport`), receive each validated layer through the same backend and page
   writer as P/D, register the blocks in the prefix cache (KV events: `BlockStored`), and
   acknowledge the holder's lease.

The request then runs as usual: its prefix lookup hits the local and pulled blocks (counted
in `cached_tokens`, as vLLM counts tokens a connector loaded) and it computes the rest of the
prompt here. Failures raise `KVTransferError` (reasons as P/D's: timeout, unavailable, rpc,
invalid, incomplete, no_room) after dropping every pin; the caller computes the prompt.
Everything is bounded by the transfer settings' `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from tandem.engine.kv_pages import ImportCommit
from tandem.kvtransfer.client import (
    Imported,
    NoRoomForImport,
    RemotePrefill,
    _PageWriter,
    raise_transfer_error,
)
from tandem.protocol import worker_pb2
from tandem.protocol.block_hash import request_hash_keys, root_hash

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pulled:
    """A pull's outcome: `asked` full blocks were missing here, of which the holder was
    `expected` to have the first ones (all without a router hint); it sent `got` of them
    (`imported` holds their pins, None when it held none)."""

    asked: int
    got: int
    imported: Imported | None
    expected: int = 0  # 0: all `asked`

    @property
    def result(self) -> str:
        """The `tandem_kv_peer_pulls_total` label: none_held, pulled (at least what was
        expected) or partial."""
        if self.got == 0:
            return "none_held"
        return "pulled" if self.got >= (self.expected or self.asked) else "partial"


class PeerPull:
    """Pulls over `remote`'s channels, backend, writer thread and signing key."""

    def __init__(self, remote: RemotePrefill) -> None:
        self.remote = remote

    async def pull(self, target: str, request_id: str, token_ids: list[int],
                   cache_salt: str = "", lora_name: str | None = None,
                   hint: int | None = None) -> Pulled | None:
        """Pull the missing leading blocks from `target` (the holder's gRPC host:port) for
        engine request `request_id`; None when there is nothing to pull (no prefix cache,
        no missing full block, an adapter not loaded here, or `hint` blocks held there are
        no more than here). Raises KVTransferError."""
        remote = self.remote
        kv, layout, settings = remote.kv, remote.layout, remote.settings
        if not kv.prefix_caching:
            return None
        digest = remote.lora_digest(lora_name)
        if lora_name and digest is None:
            return None
        plan = remote.plan(token_ids, cache_salt, digest)
        chain, first = plan.chain, plan.first
        if plan.num <= 0 or (hint is not None and hint <= first):
            return None
        # every missing block is asked for (the holder may have more than the router
        # knows); the hint only sets what counts as a full pull
        expected = plan.num if hint is None else min(plan.num, hint - first)
        local_pin = asyncio.ensure_future(kv.pin_cached(chain[:first]))
        req = worker_pb2.PrefillRequest(
            request_id=request_id, model_id=remote.model_id, token_ids=token_ids,
            cache_salt=cache_salt, block_size=layout.block_size, first_block=first,
            num_blocks=plan.num, backend=remote._backend.name, lease_s=settings.lease_s,
            kv_cache_dtype=layout.cache_dtype, lora_name=lora_name or "",
            lora_digest=digest or "", cached_only=True)
        writer: _PageWriter | None = None  # set once the holder offers blocks
        header: worker_pb2.PageHeader | None = None
        try:
            async with asyncio.timeout(settings.timeout_s):
                async with remote._prefill_call(req, target) as it:
                    header, offer = await remote._header(it, chain[first:], first, 0,
                                                         "holder", none_ok=True)
                    if offer.num_full:
                        local = await remote.pin_local(local_pin, request_id, first)
                        hashes = chain[first:first + offer.num_full]
                        writer = _PageWriter(remote._writer_pool, offer)
                        await writer.pin(kv, hashes, tail=False)
                        if not writer.pins.pinned:
                            raise NoRoomForImport(request_id, offer.num_blocks)
                        await remote.receive(req, header, offer, it, writer)
                if writer is None:
                    remote._release_later(local_pin)
                    return Pulled(plan.num, 0, None, expected)
                await writer.flush()
                n = offer.num_full
                parent = chain[first - 1] if first else root_hash(
                    request_hash_keys(remote.model_id, digest, cache_salt))
                bs = layout.block_size
                writer.committed = True  # once sent, the commit runs even if we are cancelled
                full = await kv.commit_import(writer.pins, ImportCommit(
                    request_id, hashes[:n], parent, token_ids[first * bs:(first + n) * bs],
                    first + n, [], lora_name or "", digest or ""))
        except BaseException as exc:
            if writer is not None:
                writer.release(kv, remote._releases, request_id)
            remote._release_later(local_pin)
            if header is not None:  # its pages may all be sent: the lease is not waited out
                remote._ack_later(target, header.lease_id)
            raise_transfer_error(exc, f"peer pull from {target}", settings.timeout_s)
            raise
        remote._ack_later(target, header.lease_id)
        return Pulled(plan.num, n, Imported(
            request_id, full, local, n, 0, 0,
            n * layout.num_layers * layout.block_layer_bytes), expected)
