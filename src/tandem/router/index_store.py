"""The prefix index in Redis (`--index redis://...`), shared by active-active router replicas.

Every replica still subscribes to every worker and keeps its own in-memory `PrefixIndex`;
each also writes what it hears into Redis, so a replica that just started (or restarted)
routes on the full index at once instead of waiting for its snapshots.

Layout under `prefix` (block keys are `index.block_key` values as 16 hex digits)::

    {p}b:<key>  SET of worker ids holding the block
    {p}w:<id>   SET of the worker's block keys (to clear or replace them)
    {p}seq      HASH worker id -> "<instance_id>:<seq>", the last event applied

Replicas hear the same event sequence but write it at different times, so every write is a
Lua script that applies only events newer than `{p}seq` for that worker: writes are
idempotent and a slow replica can never roll the index back. A write that finds a gap, or
a worker instance it does not know, is answered "snapshot needed" and the writer replaces
the worker's entries from its own in-memory index (which is current to a later seq).

Redis down or slow never stops routing: a lookup that has no answer within
`lookup_timeout_s` (milliseconds) returns None and the caller uses the in-memory index; after
a failure Redis is skipped for `retry_after_s`. Writes go through a bounded queue on a
background task; whatever is dropped marks the worker for a snapshot rewrite.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tandem.protocol.block_hash import BlockHash
from tandem.router.index import block_key

logger = logging.getLogger(__name__)

_APPLY = """
local p, w, inst, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local last = tonumber(ARGV[5])
local cur = redis.call('HGET', p .. 'seq', w)
local cur_inst, cur_seq = '', -1
if cur then
  local i = string.find(cur, ':', 1, true)
  cur_inst, cur_seq = string.sub(cur, 1, i - 1), tonumber(string.sub(cur, i + 1))
end
local wkey = p .. 'w:' .. w
if mode == 'snapshot' then
  if cur_inst == inst and cur_seq >= last then return 0 end
  for _, k in ipairs(redis.call('SMEMBERS', wkey)) do redis.call('SREM', p .. 'b:' .. k, w) end
  redis.call('DEL', wkey)
  for i = 6, #ARGV do
    redis.call('SADD', p .. 'b:' .. ARGV[i], w)
    redis.call('SADD', wkey, ARGV[i])
  end
  redis.call('HSET', p .. 'seq', w, inst .. ':' .. last)
  return 1
end
if cur_inst ~= inst then return -1 end
if cur_seq >= last then return 0 end
-- events: '@<seq>' starts an event, '+' / '-' / '!' set stored / removed / cleared
local seq, op, skip = 0, '+', true
for i = 6, #ARGV do
  local a = ARGV[i]
  local c = string.sub(a, 1, 1)
  if c == '@' then
    seq = tonumber(string.sub(a, 2))
    if seq > cur_seq + 1 and skip then return -1 end
    skip = seq <= cur_seq
  elseif c == '+' or c == '-' then
    op = c
  elseif c == '!' then
    if not skip then
      for _, k in ipairs(redis.call('SMEMBERS', wkey)) do
        redis.call('SREM', p .. 'b:' .. k, w)
      end
      redis.call('DEL', wkey)
    end
  elseif not skip then
    if op == '+' then
      redis.call('SADD', p .. 'b:' .. a, w)
      redis.call('SADD', wkey, a)
    else
      redis.call('SREM', p .. 'b:' .. a, w)
      redis.call('SREM', wkey, a)
    end
  end
end
redis.call('HSET', p .. 'seq', w, inst .. ':' .. last)
return 1
"""

_MATCH = """
local p, nw = ARGV[1], tonumber(ARGV[2])
local alive = {}
for i = 3, 2 + nw do alive[ARGV[i]] = true end
local out, n = {}, 0
for i = 3 + nw, #ARGV do
  local kept, any = {}, false
  for _, m in ipairs(redis.call('SMEMBERS', p .. 'b:' .. ARGV[i])) do
    if alive[m] then kept[m] = true; any = true end
  end
  if n > 0 then
    for m, _ in pairs(alive) do
      if not kept[m] then out[#out + 1] = m; out[#out + 1] = n end
    end
  end
  if not any then return out end
  alive, n = kept, n + 1
end
for m, _ in pairs(alive) do out[#out + 1] = m; out[#out + 1] = n end
return out
"""


@dataclass(frozen=True)
class IndexEvent:
    """One applied KV event of a worker's stream."""

    seq: int
    kind: str  # "stored" | "removed" | "cleared"
    hashes: Sequence[BlockHash] = ()


@dataclass
class KVWrite:
    """One batch of a worker's event stream (`events`, the last with seq `seq`), or a
    snapshot (`snapshot` set) valid at `seq`."""

    worker: str
    instance_id: str
    seq: int  # the seq after this write
    snapshot: Sequence[BlockHash] | None = None
    events: list[IndexEvent] = field(default_factory=list)


@dataclass(frozen=True)
class IndexView:
    """A worker as the in-memory index holds it now: its event sequence and block keys."""

    instance_id: str
    seq: int
    keys: set[int]


SnapshotSource = Callable[[str], IndexView | None]  # worker -> view; None if unknown


class RedisIndexStore:
    def __init__(self, url: str, prefix: str = "tandem:kv:", lookup_timeout_s: float = 0.005,
                 write_timeout_s: float = 2.0, retry_after_s: float = 2.0,
                 max_queue: int = 10_000) -> None:
        import redis.asyncio as aioredis

        self.prefix = prefix
        self.lookup_timeout_s = lookup_timeout_s
        self.retry_after_s = retry_after_s
        self._redis = aioredis.from_url(url, socket_timeout=write_timeout_s,
                                        socket_connect_timeout=write_timeout_s)
        self._apply = self._redis.register_script(_APPLY)
        self._match = self._redis.register_script(_MATCH)
        self._queue: asyncio.Queue[KVWrite] = asyncio.Queue(max_queue)
        self._dirty: set[str] = set()  # workers whose Redis entries need a snapshot rewrite
        self._down_until = 0.0
        self._writer: asyncio.Task | None = None
        self.snapshot_source: SnapshotSource | None = None
        self.stats = {"lookups": 0, "lookup_fallbacks": 0, "writes": 0, "rewrites": 0,
                      "dropped": 0}

    # -- writes --------------------------------------------------------------------------------
    def start(self, snapshot_source: SnapshotSource) -> None:
        self.snapshot_source = snapshot_source
        self._writer = asyncio.create_task(self._write_loop())

    def publish(self, write: KVWrite) -> None:
        """Queue a write (never blocks); a full queue marks the worker for a rewrite."""
        try:
            self._queue.put_nowait(write)
        except asyncio.QueueFull:
            self.stats["dropped"] += 1
            self._dirty.add(write.worker)

    async def _write_loop(self) -> None:
        while True:
            try:
                write = await asyncio.wait_for(self._queue.get(), self.retry_after_s)
            except TimeoutError:  # idle: repair workers whose writes were lost
                for worker in list(self._dirty):
                    if not await self._guarded(self._rewrite(worker), worker):
                        break
                continue
            try:
                if write.worker in self._dirty:
                    await self._guarded(self._rewrite(write.worker), write.worker)
                else:
                    await self._guarded(self._write(write), write.worker)
            finally:
                self._queue.task_done()

    async def _guarded(self, op: Awaitable[int | None], worker: str) -> bool:
        """Run one write; on Redis trouble mark `worker` for a rewrite and back off."""
        try:
            if await op == -1:  # a gap or an unknown instance: replace from memory
                await self._rewrite(worker)
            self.stats["writes"] += 1
            return True
        except Exception as exc:  # noqa: BLE001 - any Redis trouble: rewrite once it is back
            self._dirty.add(worker)
            self._down_until = time.monotonic() + self.retry_after_s
            logger.warning("index store: write failed (%s); retrying in %.0fs",
                           type(exc).__name__, self.retry_after_s)
            await asyncio.sleep(self.retry_after_s)
            return False

    async def _write(self, write: KVWrite) -> int:
        head = [self.prefix, write.worker, write.instance_id]
        if write.snapshot is not None:
            args = [*head, "snapshot", write.seq, *(_hex(h) for h in write.snapshot)]
        else:
            args = [*head, "events", write.seq]
            for ev in write.events:
                args.append(f"@{ev.seq}")
                if ev.kind == "cleared":
                    args.append("!")
                else:
                    args.append("+" if ev.kind == "stored" else "-")
                    args.extend(_hex(h) for h in ev.hashes)
        return int(await self._apply(args=args))

    async def _rewrite(self, worker: str) -> None:
        """Replace the worker's Redis entries with the in-memory index's current view."""
        view = self.snapshot_source(worker) if self.snapshot_source else None
        if view is None:
            self._dirty.discard(worker)
            return
        args = [self.prefix, worker, view.instance_id, "snapshot", view.seq,
                *(_key_hex(k) for k in view.keys)]
        await self._apply(args=args)
        self._dirty.discard(worker)
        self.stats["rewrites"] += 1

    # -- lookups -------------------------------------------------------------------------------
    async def match(self, hashes: Sequence[BlockHash], workers: Sequence[str]
                    ) -> dict[str, int] | None:
        """Leading blocks of `hashes` held per worker (only `workers`), or None when Redis
        has no answer in time (the caller falls back to its in-memory index)."""
        if not hashes or not workers:
            return {}
        now = time.monotonic()
        self.stats["lookups"] += 1
        if now < self._down_until:
            self.stats["lookup_fallbacks"] += 1
            return None
        args = [self.prefix, len(workers), *workers, *(_hex(h) for h in hashes)]
        try:
            flat = await asyncio.wait_for(self._match(args=args), self.lookup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - timeout or Redis trouble: fall back
            self.stats["lookup_fallbacks"] += 1
            self._down_until = now + self.retry_after_s
            logger.warning("index store: lookup failed (%s); in-memory index for %.0fs",
                           type(exc).__name__, self.retry_after_s)
            return None
        return {_str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued write has been tried (tests, shutdown)."""
        await asyncio.wait_for(self._queue.join(), timeout_s)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)  # its call ends first
        await self._redis.aclose()


def _key_hex(key: int) -> str:
    """A block key as stored in Redis: 16 hex digits."""
    return f"{key:016x}"


def _hex(h: BlockHash) -> str:
    return _key_hex(block_key(h))


def _str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
