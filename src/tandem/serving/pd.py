"""The decode side of P/D inside the worker's HTTP server.

A request carrying `x-tandem-prefill: host:port` (set and signed by the router; the
signature is checked by `worker_auth` before this module sees the target) first imports each
prompt's missing KV pages from that prefill worker (`kvtransfer.client.RemotePrefill`), then
runs as usual, computing only the prompt's last token. The imports stay pinned until the
request's own block references hold them (its first output) or it ends; `unpin` drops them,
and a partial block the request never took over, on the engine thread. On a failed fetch
the `recompute` policy serves the prompt locally and `fail` answers 502. A request naming a
KV peer instead (`x-tandem-kv-peer`) pulls the blocks that peer holds (`peer_pull`); naming
both, P/D wins and the peer is ignored (counted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.kvtransfer.client import (
    Imported,
    NoRoomForImport,
    RemotePrefill,
    RemotePrefillSettings,
)
from tandem.kvtransfer.pages import KVTransferError
from tandem.protocol.web import PEER_HEADER, PREFILL_HEADER
from tandem.serving.errors import APIError
from tandem.serving.metrics import ServerMetrics
from tandem.serving.peer_pull import PeerPulls

logger = logging.getLogger(__name__)


def valid_target(target: str) -> bool:
    """host:port, bounded."""
    host, _, port = target.rpartition(":")
    return 0 < len(host) <= 253 and port.isdigit() and 0 < int(port) < 65536


class PrefillImports:
    def __init__(self, get_remote: Callable[[], RemotePrefill | None],
                 settings: RemotePrefillSettings, metrics: ServerMetrics,
                 model_name: str) -> None:
        self.get_remote = get_remote
        self.settings = settings
        self.metrics = metrics
        self.model_name = model_name
        self.peer = PeerPulls(get_remote, metrics, model_name)

    def unpin(self, imported: list[Imported]) -> None:
        """Drop the import pins (scheduled on the engine thread, not awaited); idempotent."""
        remote = self.get_remote()
        if imported and remote is not None:
            for imp in imported:
                asyncio.ensure_future(remote.unpin(imp))
        imported.clear()

    async def fetch(self, headers: Mapping[str, str], engine: AsyncLLMEngine, rid: str,
                    prompts: list[list[int]], salt: str, lora_name: str | None = None
                    ) -> list[Imported]:
        """Import every prompt's missing pages (prompts as token ids) when the request names
        a prefill worker; [] when it does not. Raises APIError (400 bad header, 502 under
        `fail`). Naming a KV peer and no prefill worker: that peer's blocks are pulled."""
        target = headers.get(PREFILL_HEADER)
        remote = self.get_remote()
        if not target and headers.get(PEER_HEADER):
            return await self.peer.fetch(headers, rid, prompts, salt, lora_name)
        if not target or remote is None:
            return []
        if headers.get(PEER_HEADER):
            self.peer.count("ignored")
        if not valid_target(target):
            raise APIError(400, f"{PREFILL_HEADER} must be host:port", PREFILL_HEADER)
        imported: list[Imported] = []
        try:
            for i, ids in enumerate(prompts):
                imp = await self._fetch_one(remote, target, f"{rid}-{i}", ids, salt, lora_name)
                if imp is not None:
                    imported.append(imp)
        except BaseException:  # cancelled (client gone) or failed: drop what was pinned
            self.unpin(imported)
            raise
        return imported

    async def _fetch_one(self, remote: RemotePrefill, target: str, sub_id: str,
                         ids: list[int], salt: str, lora_name: str | None) -> Imported | None:
        backend = self.settings.backend
        t0 = time.monotonic()
        try:
            with self.metrics.kv_receiving.track_inprogress():
                imp = await remote.fetch(target, sub_id, ids, salt, lora_name)
        except NoRoomForImport as exc:  # memory pressure here, not a failed transfer
            self.metrics.kv_fetches.labels(self.model_name, exc.reason, backend).inc()
            logger.info("%s; computing the prompt here", exc)
            return None
        except KVTransferError as exc:
            self.metrics.kv_fetches.labels(self.model_name, exc.reason, backend).inc()
            if self.settings.policy == "fail":
                raise APIError(502, f"remote prefill failed: {exc}",
                               type_="server_error") from exc
            logger.warning("[%s] remote prefill from %s failed (%s); computing locally",
                           sub_id, target, exc)
            return None
        self.metrics.kv_fetches.labels(self.model_name, "ok", backend).inc()
        self.metrics.kv_fetch_seconds.observe(time.monotonic() - t0)
        if imp is not None:
            self.metrics.kv_fetched_bytes.inc(imp.bytes)
            logger.info("[%s] imported %d blocks%s from %s in %.1f ms", sub_id,
                        imp.num_transferred,
                        f" + a {imp.tail_tokens}-token tail" if imp.tail_tokens else "",
                        target, (time.monotonic() - t0) * 1e3)
        return imp
