"""Keeps the router's view of each worker current: readiness, KV events, load.

Per worker, three loops on the router's event loop:

* readiness: `GET /ready` every `probe_interval_s` (Tandem workers answer with their model,
  role, block size, gRPC port and KV transfer backend; the router probes over its own
  upstream pool, `probe.UpstreamProbe`, and an `httpx.AsyncClient` works too); servers
  without `/ready` (stock vLLM) are probed with `/health` + `/v1/models` and routed in
  approximate mode. A failed probe marks the worker unready at once; it rejoins on the next
  good probe.
* KV events (Tandem workers with a gRPC port): `SubscribeKVEvents` - the snapshot resets the
  worker's entries in the index (device pool, host and disk tiers), live events update them
  in the medium they name (the shared index store mirrors device blocks only); a sequence
  gap or a broken stream drops its entries and resubscribes after a jittered backoff.
* load: gRPC `GetLoad` every `load_interval_s`. A report that the worker is draining
  (`Load.draining`: it got SIGTERM) marks it unready at once, before its next probe.

With the worker auth key (`key`) each call is signed (`protocol.signing`, a fresh signature
per call): a worker with a key serves these RPCs to no one else.

Both gRPC loops share one `PeerChannel` (mutual TLS by identity with `settings.tls`): once the
TLS files change, calls go on a new channel and the old one (its KV stream included, which
then resubscribes) is closed after `retire_grace_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
import httpx

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.kv_events import MEDIA, MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from tandem.protocol.signing import GET_LOAD_RPC, SUBSCRIBE_RPC, WorkerKey, rpc_metadata
from tandem.protocol.tls import TLSFiles
from tandem.protocol.tls_peers import PeerChannel
from tandem.router.index import PrefixIndex
from tandem.router.index_store import IndexEvent, IndexView, KVWrite, RedisIndexStore
from tandem.router.probe import UpstreamProbe
from tandem.router.upstream import UpstreamError
from tandem.router.workers import (
    LoRAReport,
    Worker,
    WorkerLoad,
    bounded_costs,
    bounded_kv_usage,
    bounded_load_costs,
)

logger = logging.getLogger(__name__)
MAX_GRPC_MESSAGE = 64 << 20
SNAPSHOT_SLICE = 20_000  # blocks indexed per event-loop turn (~60 ms here) from a snapshot


@dataclass
class MonitorSettings:
    probe_interval_s: float = 1.0
    load_interval_s: float = 0.2
    probe_timeout_s: float = 2.0
    backoff_max_s: float = 5.0
    # mutual TLS to workers' gRPC (verified against `tls.server_name` when set); the
    # channel is rebuilt once the files changed, the old one closed after `retire_grace_s`
    tls: TLSFiles | None = None
    retire_grace_s: float = 10.0


class WorkerMonitor:
    def __init__(self, worker: Worker, index: PrefixIndex,
                 http: httpx.AsyncClient | UpstreamProbe,
                 settings: MonitorSettings, store: RedisIndexStore | None = None,
                 key: WorkerKey | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.worker = worker
        self.on_change = on_change  # its readiness or load was updated (flow control's kick)
        self.key = key  # signs the gRPC calls
        self.index = index
        self.store = store  # shared index store the events are mirrored to, if any
        self.instance_id = ""  # the worker's event sequence, from its snapshot
        self.seq = -1  # last event applied to `index`
        self.http = http
        self.settings = settings
        self._tasks: list[asyncio.Task] = []
        self._channel: PeerChannel | None = None
        self.connected = asyncio.Event()  # set while the KV stream is live

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._probe_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._channel is not None:
            await self._channel.close()
        self.index.drop(self.worker.id)

    # -- readiness -------------------------------------------------------------------------
    async def probe(self) -> None:
        w = self.worker
        try:
            r = await self.http.get(f"{w.id}/ready", timeout=self.settings.probe_timeout_s)
            w.unreachable_since = None  # it answered (a draining or loading worker too)
            if r.status_code == 404:  # not a Tandem worker: approximate mode
                h = await self.http.get(f"{w.id}/health", timeout=self.settings.probe_timeout_s)
                m = await self.http.get(f"{w.id}/v1/models",
                                        timeout=self.settings.probe_timeout_s)
                w.ready = h.status_code == 200 and m.status_code == 200
                if w.ready:
                    cards = m.json()["data"]
                    card = cards[0]
                    w.model = card["id"]
                    w.aliases = _aliases([c.get("id") for c in cards if isinstance(c, dict)
                                          and not c.get("parent")], w.model)
                    w.max_model_len = _length(card.get("max_model_len")) or w.max_model_len
                return
            info = r.json()
            w.ready = r.status_code == 200
            if (not w.ready and not w.model and isinstance(info, dict)
                    and isinstance(info.get("model"), str)):
                w.model = info["model"]  # a loading worker names its model: its requests
                # are answered 503 "starting", not 404 (`startup`)
            if w.ready:
                w.model = info.get("model") or w.model
                w.aliases = _aliases(info.get("models"), w.model)
                w.role = info.get("role") or w.role
                w.block_size = info.get("block_size") or w.block_size
                w.kv_transfer_backend = info.get("kv_transfer_backend") or w.kv_transfer_backend
                w.kv_cache_dtype = info.get("kv_cache_dtype") or w.kv_cache_dtype
                w.max_model_len = _length(info.get("max_model_len")) or w.max_model_len
                w.prefill_chunk_cap = _count(info.get("long_prefill_token_threshold"),
                                             w.prefill_chunk_cap)
                w.max_batched_tokens = _length(info.get("max_num_batched_tokens")) \
                    or w.max_batched_tokens
                report = LoRAReport.from_json(info.get("lora"),
                                              _length(info.get("max_loras")) or 0,
                                              info.get("lora_adapters"))
                if report is not None:  # unless older than what a load answer told us
                    w.apply_lora_report(report)
                port = info.get("grpc_port")
                if port and w.grpc_target is None:
                    w.grpc_target = f"{urlsplit(w.id).hostname}:{port}"
                    self._start_grpc_loops()
        except (httpx.HTTPError, UpstreamError, ValueError, KeyError, IndexError) as exc:
            if w.ready:
                logger.warning("worker %s failed its probe: %s", w.id, exc)
            w.ready = False
            if isinstance(exc, httpx.TransportError | UpstreamError) \
                    and w.unreachable_since is None:  # no answer at all
                w.unreachable_since = time.monotonic()

    async def _probe_loop(self) -> None:
        while True:
            await self.probe()
            if self.on_change is not None:
                self.on_change()
            await asyncio.sleep(self.settings.probe_interval_s)

    # -- gRPC: KV events and load ----------------------------------------------------------
    def _start_grpc_loops(self) -> None:
        self._channel = PeerChannel(self.worker.grpc_target, self.settings.tls,
                                    [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE)],
                                    self.settings.retire_grace_s)
        self._tasks += [asyncio.create_task(self._events_loop()),
                        asyncio.create_task(self._load_loop())]

    def _stub(self) -> worker_pb2_grpc.WorkerStub:
        """On the channel made with the current TLS files (a renewal replaces it)."""
        return worker_pb2_grpc.WorkerStub(self._channel.get())  # type: ignore[union-attr]

    async def _events_loop(self) -> None:
        w, delay = self.worker, 0.1
        while True:
            try:
                await self._consume(self._stub())
            except grpc.aio.AioRpcError as exc:
                refused = exc.code() == grpc.StatusCode.PERMISSION_DENIED  # a key mismatch
                logger.log(logging.WARNING if refused else logging.INFO,
                           "KV event stream of %s ended: %s%s", w.id, exc.code(),
                           f" ({exc.details()})" if refused else "")
            except _SequenceGap as exc:
                logger.warning("KV event stream of %s: %s; resubscribing", w.id, exc)
            w.events_connected = False
            self.connected.clear()
            self.index.drop(w.id)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.settings.backoff_max_s)

    async def _consume(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        w = self.worker
        self.seq = -1
        req = worker_pb2.SubscribeKVEventsRequest()
        async for batch in stub.SubscribeKVEvents(
                req, metadata=rpc_metadata(self.key, req, SUBSCRIBE_RPC)):
            if batch.HasField("snapshot"):
                snap = batch.snapshot
                hashes = snap.block_hashes
                self.index.reset(w.id, hashes[:SNAPSHOT_SLICE])
                for i in range(SNAPSHOT_SLICE, len(hashes), SNAPSHOT_SLICE):
                    await asyncio.sleep(0)  # other requests route between slices
                    self.index.stored(w.id, hashes[i:i + SNAPSHOT_SLICE])
                for medium, tier in ((MEDIUM_HOST, snap.host_block_hashes),
                                     (MEDIUM_DISK, snap.disk_block_hashes)):
                    for i in range(0, len(tier), SNAPSHOT_SLICE):
                        await asyncio.sleep(0)
                        self.index.stored(w.id, tier[i:i + SNAPSHOT_SLICE], medium)
                self.instance_id, self.seq = snap.instance_id, snap.seq
                w.block_size = batch.block_size or w.block_size
                w.events_connected = True
                self.connected.set()
                if self.store is not None:
                    self.store.publish(KVWrite(w.id, self.instance_id, self.seq,
                                               snapshot=list(snap.block_hashes)))
            mirror = self.store is not None
            applied: list[IndexEvent] = []
            for ev in batch.events:
                if self.seq < 0 or ev.seq != self.seq + 1:
                    raise _SequenceGap(f"expected seq {self.seq + 1 if self.seq >= 0 else None}"
                                       f", got {ev.seq}")
                self.seq = ev.seq
                kind = ev.WhichOneof("event")
                hashes = (ev.stored.block_hashes if kind == "stored"
                          else ev.removed.block_hashes if kind == "removed" else ())
                medium = (ev.stored.medium if kind == "stored"
                          else ev.removed.medium if kind == "removed" else "")
                if medium not in MEDIA and medium:
                    raise _SequenceGap(f"event {ev.seq}: unknown KV medium {medium[:32]!r}")
                if kind == "stored":
                    self.index.stored(w.id, hashes, medium)
                elif kind == "removed":
                    self.index.removed(w.id, hashes, medium)
                elif kind == "cleared":
                    self.index.cleared(w.id)
                if mirror and medium in ("", MEDIUM_DEVICE):  # the store holds device
                    # blocks only; copies only when a shared store wants them
                    applied.append(IndexEvent(ev.seq, kind, list(hashes)))
                elif mirror:  # a tier event: the store's seq still advances past it
                    applied.append(IndexEvent(ev.seq, "stored", []))
            if applied:
                self.store.publish(KVWrite(w.id, self.instance_id, self.seq, events=applied))

    def index_view(self) -> IndexView | None:
        """The worker as the in-memory index holds it now; None while its stream is down."""
        if not self.worker.events_connected or self.seq < 0:
            return None
        return IndexView(self.instance_id, self.seq, self.index.keys(self.worker.id))

    async def _load_loop(self) -> None:
        while True:
            try:
                req = worker_pb2.GetLoadRequest()
                load = await self._stub().GetLoad(
                    req, timeout=self.settings.probe_timeout_s,
                    metadata=rpc_metadata(self.key, req, GET_LOAD_RPC))
                if load.draining and self.worker.ready:  # its /ready says so too, later
                    logger.info("worker %s is draining: no longer routed to", self.worker.id)
                    self.worker.ready = False
                self.worker.load = WorkerLoad(
                    num_running=load.num_running, num_waiting=load.num_waiting,
                    num_free_blocks=load.num_free_blocks,
                    num_total_blocks=load.num_total_blocks,
                    kv_cache_usage=bounded_kv_usage(load.kv_cache_usage),
                    in_flight_tokens=load.in_flight_tokens,
                    running_loras=frozenset(load.running_loras),
                    waiting_loras=frozenset(load.waiting_loras),
                    resident_loras=frozenset(load.resident_loras), max_loras=load.max_loras)
                (self.worker.load.prefill_s_per_token, self.worker.load.decode_step_s,
                 self.worker.load.pending_prefill_tokens) = bounded_costs(
                    load.prefill_s_per_token, load.decode_step_s, load.pending_prefill_tokens)
                (self.worker.load.host_load_s_per_block,
                 self.worker.load.disk_load_s_per_block,
                 self.worker.load.peer_pull_s_per_block,
                 self.worker.load.kv_block_bytes) = bounded_load_costs(
                    load.host_load_s_per_block, load.disk_load_s_per_block,
                    load.peer_pull_s_per_block, load.kv_block_bytes)
                if load.max_loras:  # applied unless older than the set held
                    versioned = bool(load.lora_instance)
                    self.worker.apply_lora_report(LoRAReport.reported(
                        load.lora_digests if versioned
                        else dict.fromkeys(load.lora_adapters, ""), load.max_loras,
                        load.lora_instance, load.lora_version if versioned else None))
            except grpc.aio.AioRpcError:
                pass  # the probe loop owns readiness
            else:
                if self.on_change is not None:
                    self.on_change()
            await asyncio.sleep(self.settings.load_interval_s)


class _SequenceGap(Exception):
    pass


def _length(value: object) -> int | None:
    """A context length a worker reported, if it is a positive int."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _count(value: object, held: int | None) -> int | None:
    """A non-negative int a worker reported, else `held`."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31
    return value if ok else held  # type: ignore[return-value]


MAX_SERVED_NAMES = 64  # served names taken from one readiness report


def _aliases(names: object, model: str) -> frozenset[str]:
    """A readiness report's `models` (every served name) but the primary `model`."""
    if not isinstance(names, list):
        return frozenset()
    return frozenset(n for n in names[:MAX_SERVED_NAMES]
                     if isinstance(n, str) and n and n != model)
