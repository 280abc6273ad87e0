"""One fair queue for every router replica: the fairness ledger and the band counts in Redis.

Each replica keeps its own waiting requests (their sockets are its own) but decides in the
order the shared state says, through Lua scripts that read and write it atomically:

* `{prefix}fc:replicas`: a sorted set of live replicas by last heartbeat (Redis clock); one
  silent for `lease_s` is pruned, and its keys expire, so a replica that dies leaks nothing;
* `{prefix}fc:r:{replica}`: what that replica has queued, per band (requests, bytes) and per
  (band, model, tenant), kept by the scripts below; its heartbeat renews it every
  `heartbeat_s`, and rewrites it whole after Redis failed to take a write;
* `{prefix}fc:vt:{band}\\x1f{model}`: each tenant's virtual time (`policies`), shared.

`enqueue` admits a request only while its band holds fewer than `max_requests` requests and
`max_bytes` bytes across all live replicas (fleet-wide bounds), and starts a newly backlogged
tenant at the least virtual time of the tenants backlogged anywhere. `dispatch` picks, among
this replica's backlogged tenants, the least virtual time, and lets it go only while it is
less than one request's charge ahead of the least backlogged tenant fleet-wide (so a tenant
queued on another replica is not overtaken), charging it atomically.

When Redis does not answer within `timeout_s`, the replica logs it once, sets
`tandem_router_flow_shared` to 0 and decides alone (`policies.LocalLedger`) for
`retry_after_s`; once Redis answers again it rewrites its counts and shares again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.router.flowcontrol.settings import BandLimits

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_COMMON = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local p, me, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = now()
redis.call('ZADD', p .. 'fc:replicas', t, me)
redis.call('ZREMRANGEBYSCORE', p .. 'fc:replicas', '-inf', t - lease)
local reps = redis.call('ZRANGE', p .. 'fc:replicas', 0, -1)
local rk = p .. 'fc:r:' .. me
local function fleet(band, model)
  local pre = 'f\\31' .. band .. '\\31' .. model .. '\\31'
  local counts = {}
  for _, r in ipairs(reps) do
    local kv = redis.call('HGETALL', p .. 'fc:r:' .. r)
    for i = 1, #kv, 2 do
      if string.sub(kv[i], 1, #pre) == pre then
        local tn = string.sub(kv[i], #pre + 1)
        counts[tn] = (counts[tn] or 0) + tonumber(kv[i + 1])
      end
    end
  end
  return counts
end
local function floor_of(vtk, counts, skip)
  local floor = nil
  for tn, c in pairs(counts) do
    if c > 0 and tn ~= skip then
      local v = tonumber(redis.call('HGET', vtk, tn)) or 0
      if floor == nil or v < floor then floor = v end
    end
  end
  return floor
end
"""

# ARGV: prefix, replica, lease, band, model, tenant, size, max_requests, max_bytes -> 1 | 0
_ENQUEUE = _COMMON + """
local band, model, tenant, size = ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
local n, b = 0, 0
for _, r in ipairs(reps) do
  local v = redis.call('HMGET', p .. 'fc:r:' .. r, 'n\\31' .. band, 'b\\31' .. band)
  n = n + math.max(tonumber(v[1]) or 0, 0)
  b = b + math.max(tonumber(v[2]) or 0, 0)
end
if n + 1 > tonumber(ARGV[8]) or b + size > tonumber(ARGV[9]) then return 0 end
local counts = fleet(band, model)
local vtk = p .. 'fc:vt:' .. band .. '\\31' .. model
if (counts[tenant] or 0) <= 0 then
  local floor = floor_of(vtk, counts, tenant)
  if floor == nil then
    redis.call('DEL', vtk)
  else
    local mine = tonumber(redis.call('HGET', vtk, tenant)) or 0
    if mine < floor then redis.call('HSET', vtk, tenant, tostring(floor)) end
    redis.call('EXPIRE', vtk, 3600)
  end
end
redis.call('HINCRBY', rk, 'n\\31' .. band, 1)
redis.call('HINCRBY', rk, 'b\\31' .. band, size)
redis.call('HINCRBY', rk, 'f\\31' .. band .. '\\31' .. model .. '\\31' .. tenant, 1)
redis.call('EXPIRE', rk, math.ceil(lease * 2))
return 1
"""

# ARGV: prefix, replica, lease, band, model, then (tenant, charge, size) per candidate, in
# tie-break order -> the tenant dispatched, or "" (wait: another replica's tenant is due)
_DISPATCH = _COMMON + """
local band, model = ARGV[4], ARGV[5]
local vtk = p .. 'fc:vt:' .. band .. '\\31' .. model
local floor = floor_of(vtk, fleet(band, model), nil)
local best, bv, bc, bs = nil, 0, 0, 0
for i = 6, #ARGV, 3 do
  local v = tonumber(redis.call('HGET', vtk, ARGV[i])) or 0
  if best == nil or v < bv then
    best, bv, bc, bs = ARGV[i], v, tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  end
end
if best == nil then return '' end
if floor ~= nil and bv >= floor + bc and bv > floor then return '' end
redis.call('HINCRBY', rk, 'n\\31' .. band, -1)
redis.call('HINCRBY', rk, 'b\\31' .. band, -bs)
redis.call('HINCRBY', rk, 'f\\31' .. band .. '\\31' .. model .. '\\31' .. best, -1)
redis.call('HINCRBYFLOAT', vtk, best, bc)
redis.call('EXPIRE', vtk, 3600)
return best
"""

# ARGV: prefix, replica, lease, band, model, tenant, size: a queued request left undispatched
_LEFT = _COMMON + """
local band, model, tenant, size = ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
redis.call('HINCRBY', rk, 'n\\31' .. band, -1)
redis.call('HINCRBY', rk, 'b\\31' .. band, -size)
redis.call('HINCRBY', rk, 'f\\31' .. band .. '\\31' .. model .. '\\31' .. tenant, -1)
return 1
"""

# ARGV: prefix, replica, lease, band, model, tenant, delta: a release's settlement
_SETTLE = _COMMON + """
local vtk = p .. 'fc:vt:' .. ARGV[4] .. '\\31' .. ARGV[5]
if redis.call('HEXISTS', vtk, ARGV[6]) == 1 then
  redis.call('HINCRBYFLOAT', vtk, ARGV[6], ARGV[7])
end
return 1
"""

# ARGV: prefix, replica, lease, rewrite (1: the counts follow, replacing what Redis holds;
# 0: only the lease is renewed), then (band, model, tenant, requests, bytes) per flow
_HEARTBEAT = _COMMON + """
if ARGV[4] == '0' then
  redis.call('EXPIRE', rk, math.ceil(lease * 2))
  return 1
end
redis.call('DEL', rk)
local n, b = {}, {}
for i = 5, #ARGV, 5 do
  local band = ARGV[i]
  n[band] = (n[band] or 0) + tonumber(ARGV[i + 3])
  b[band] = (b[band] or 0) + tonumber(ARGV[i + 4])
  redis.call('HINCRBY', rk, 'f\\31' .. band .. '\\31' .. ARGV[i + 1] .. '\\31' .. ARGV[i + 2],
             ARGV[i + 3])
end
for band, v in pairs(n) do
  redis.call('HSET', rk, 'n\\31' .. band, v, 'b\\31' .. band, b[band])
end
redis.call('EXPIRE', rk, math.ceil(lease * 2))
return 1
"""

Snapshot = Callable[[], list[tuple[int, str, str, int, int]]]


class RedisLedger:
    """The shared state's client (module doc). Methods return None (or False for
    `dispatch`) when Redis is unavailable: the caller decides locally."""

    def __init__(self, url: str, prefix: str = "tandem:", replica: str | None = None,
                 timeout_s: float = 0.05, retry_after_s: float = 2.0, lease_s: float = 5.0,
                 heartbeat_s: float = 1.0, metrics: RouterMetrics | None = None) -> None:
        import redis.asyncio as aioredis

        self.prefix, self.replica = prefix, replica or uuid.uuid4().hex[:12]
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        self.metrics = metrics
        self.redis = aioredis.from_url(url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s)
        self._scripts = {name: self.redis.register_script(src) for name, src in (
            ("enqueue", _ENQUEUE), ("dispatch", _DISPATCH), ("left", _LEFT),
            ("settle", _SETTLE), ("heartbeat", _HEARTBEAT))}
        self.down_until = 0.0
        self.down = False
        self._pending: set[asyncio.Task] = set()
        self._beat: asyncio.Task | None = None
        self._snapshot: Snapshot | None = None
        self._gauge(1)

    def start(self, snapshot: Snapshot) -> None:
        """Heartbeats from now on, with this replica's queued counts from `snapshot`."""
        self._snapshot = snapshot
        if self._beat is None:
            self._beat = asyncio.create_task(self._heartbeats())

    async def enqueue(self, band: int, model: str, tenant: str, size: int,
                      limits: BandLimits) -> bool | None:
        got = await self._call("enqueue", band, model, tenant, size, limits.max_requests,
                               limits.max_bytes)
        return None if got is None else bool(int(got))

    async def dispatch(self, band: int, model: str,
                       candidates: list[tuple[str, float, int]]) -> str | None | bool:
        """The tenant to dispatch (charged), None to wait, False: Redis is unavailable."""
        got = await self._call("dispatch", band, model,
                               *[x for c in candidates for x in (c[0], repr(c[1]), c[2])])
        if got is None:
            return False
        tenant = got.decode() if isinstance(got, bytes) else str(got)
        return tenant or None

    def left(self, band: int, model: str, tenant: str, size: int) -> None:
        self._background("left", band, model, tenant, size)

    def settle(self, band: int, model: str, tenant: str, delta: float) -> None:
        self._background("settle", band, model, tenant, repr(delta))

    async def heartbeat(self, rewrite: bool = False) -> bool:
        """Renew this replica's lease; with `rewrite` (or when Redis is back after a
        failure) replace its counts there by what it holds. True when Redis answered."""
        if self.down:
            rewrite = True  # what changed meanwhile never reached Redis
        flows = self._snapshot() if rewrite and self._snapshot is not None else []
        return await self._call("heartbeat", int(rewrite), *[x for f in flows for x in f],
                                force=True) is not None

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        pending = list(self._pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # none left unawaited
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.redis.delete(f"{self.prefix}fc:r:{self.replica}"),
                                   self.timeout_s)
        await self.redis.aclose()

    # -- plumbing ----------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await self.heartbeat()
            await asyncio.sleep(self.heartbeat_s)

    async def _call(self, name: str, *args: Any, force: bool = False) -> Any:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now < self.down_until and not force:
            return None
        try:
            got = await asyncio.wait_for(self._scripts[name](
                keys=[], args=[self.prefix, self.replica, self.lease_s, *args]),
                self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any Redis trouble: decide locally
            self.down_until = now + self.retry_after_s
            if not self.down:
                self.down = True
                self._gauge(0)
                logger.warning("flow control: Redis unavailable (%s); this replica queues "
                               "on its own until it answers", type(exc).__name__)
            return None
        self.down_until = 0.0
        if self.down:
            self.down = False
            self._gauge(1)
            logger.info("flow control: Redis answers again; the queue is shared again")
            if name != "heartbeat":
                self._pending_task(self.heartbeat(rewrite=True))
        return got

    def _background(self, name: str, *args: Any) -> None:
        self._pending_task(self._call(name, *args))

    def _pending_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _gauge(self, value: int) -> None:
        if self.metrics is not None:
            self.metrics.flow_shared.set(value)
