"""Peer pulls inside the worker's HTTP server.

A request carrying `x-tandem-kv-peer: host:port` (set and signed by the router, which names a
worker holding the prompt's prefix; `worker_auth` checks the signature before this module
sees it) first pulls each prompt's missing leading blocks from that worker
(`kvtransfer.pull.PeerPull`), then runs as usual, computing the rest of the prompt here. The
optional `x-tandem-kv-peer-blocks: N` (how many leading blocks the router believes the peer
holds) only skips a pull that could not gain anything; the holder's answer is what counts. A
pull never fails the request: on any error the prompt is computed here. A request that also
names a prefill worker is P/D's; its peer header is ignored (counted `ignored`).

The pulled blocks stay pinned until the request's own references hold them or it ends
(`PrefillImports.unpin`, as P/D's imports). `PullCosts` keeps the measured seconds per
pulled block (every layer; the whole pull: header, validation, import) for `Load`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.engine.step_costs import ALPHA, MAX_STEP_S
from tandem.kvtransfer.client import Imported, RemotePrefill
from tandem.kvtransfer.pages import KVTransferError
from tandem.kvtransfer.pull import PeerPull
from tandem.protocol.web import PEER_BLOCKS_HEADER, PEER_HEADER
from tandem.serving.errors import APIError
from tandem.serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)
_FAILURES = {"timeout": "timeout", "no_room": "no_room"}  # any other reason: "failed"


@dataclass
class PullCosts:
    """EWMA of the seconds a pull took per block it brought (0.0: none measured yet)."""

    s_per_block: float = 0.0

    def observe(self, seconds: float, blocks: int) -> None:
        if blocks <= 0 or not 0.0 < seconds <= MAX_STEP_S:
            return
        sample = seconds / blocks
        old = self.s_per_block
        self.s_per_block = sample if old <= 0.0 else old + ALPHA * (sample - old)


def peer_hint(headers: Mapping[str, str]) -> int | None:
    """`x-tandem-kv-peer-blocks` as a count, None when absent or not a plain number."""
    raw = headers.get(PEER_BLOCKS_HEADER)
    return int(raw) if raw is not None and raw.isdigit() and len(raw) <= 9 else None


class PeerPulls:
    def __init__(self, get_remote: Callable[[], RemotePrefill | None],
                 metrics: ServerMetrics, model_name: str) -> None:
        self.get_remote = get_remote
        self.metrics = metrics
        self.model_name = model_name
        self.costs = PullCosts()
        self._pull: PeerPull | None = None

    def count(self, result: str) -> None:
        self.metrics.kv_peer_pulls.labels(self.model_name, result).inc()

    async def fetch(self, headers: Mapping[str, str], rid: str, prompts: list[list[int]],
                    salt: str, lora_name: str | None = None) -> list[Imported]:
        """Pull every prompt's missing blocks when the request names a peer; [] otherwise
        (and whatever failed). Raises APIError(400) for a malformed peer header. The caller
        unpins what is returned, also when cancelled later."""
        from tandem.serving.pd import valid_target  # one rule for both headers

        target = headers.get(PEER_HEADER)
        remote = self.get_remote()
        if not target or remote is None:
            return []
        if not valid_target(target):
            raise APIError(400, f"{PEER_HEADER} must be host:port", PEER_HEADER)
        if self._pull is None or self._pull.remote is not remote:
            self._pull = PeerPull(remote)
        hint = peer_hint(headers)
        imported: list[Imported] = []
        try:
            for i, ids in enumerate(prompts):
                imp = await self._one(self._pull, target, f"{rid}-{i}", ids, salt, lora_name,
                                      hint)
                if imp is not None:
                    imported.append(imp)
        except BaseException:  # cancelled (client gone): drop what was pinned
            for imp in imported:
                await remote.unpin(imp)
            raise
        return imported

    async def _one(self, pull: PeerPull, target: str, sub_id: str, ids: list[int], salt: str,
                   lora_name: str | None, hint: int | None) -> Imported | None:
        t0 = time.monotonic()
        try:
            got = await pull.pull(target, sub_id, ids, salt, lora_name, hint)
        except KVTransferError as exc:
            self.count(_FAILURES.get(exc.reason, "failed"))
            logger.warning("[%s] peer pull from %s failed (%s: %s); computing locally",
                           sub_id, target, exc.reason, exc)
            return None
        if got is None:
            return None
        seconds = time.monotonic() - t0
        self.count(got.result)
        if got.imported is None:
            logger.info("[%s] peer %s held none of the %d missing blocks", sub_id, target,
                        got.asked)
            return None
        self.costs.observe(seconds, got.got)
        self.metrics.kv_peer_pulled_blocks.inc(got.got)
        logger.info("[%s] pulled %d of %d missing blocks from peer %s in %.1f ms", sub_id,
                    got.got, got.asked, target, seconds * 1e3)
        return got.imported
