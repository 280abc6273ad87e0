"""The router's side of the Responses API: which worker holds a stored response.

A stored response (`store: true`) lives on the worker that answered it (its
`serving/response_store.py`), so a request continuing it (`previous_response_id`) and
`GET` / `DELETE /v1/responses/{id}` must reach that worker. The router remembers, for the
responses it relayed, (tenant, response id) -> worker (`ResponseLocations`, bounded, least
recently used out first). An id it does not know (another router replica relayed it, this
router restarted, or it was forgotten) is looked for on every ready worker (a signed `GET`
naming the tenant, in parallel, `LOCATE_TIMEOUT_S`; at most `MAX_SEARCHES` such searches at
once, a 429 beyond them, so unknown ids cannot multiply load on the workers), and
remembered when found; one not
shaped as a worker issues them (`resp_` + 32 hex digits) is looked for nowhere. A request
whose response is found nowhere, or whose worker is no longer routable, is routed as usual
(and answered 404 by its worker, as an unknown id); a `GET` or `DELETE` is answered 404 by
the router. Responses are read and deleted only in the caller's tenant: the router names
it in `x-tandem-tenant`, signed with the worker auth key.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tandem.protocol.responses_api import TENANT_HEADER, tenant_target
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey
from tandem.protocol.web import APIError
from tandem.router.workers import Worker

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

logger = logging.getLogger(__name__)
MAX_TRACKED = 100_000  # (tenant, response id) -> worker entries kept
LOCATE_TIMEOUT_S = 2.0
MAX_SEARCHES = 16  # searches of the workers for unknown ids running at once
SCAN_BYTES = 64 << 10  # a stream's response id is looked for in its first bytes only
_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]{32})"')
RESPONSE_ID = _ID  # a response id in an answer's first bytes (the endpoint picker reads it)
_ISSUED = re.compile(r"resp_[0-9a-f]{32}")  # the ids workers issue (`serving.responses_api`)


class ResponseLocations:
    """(tenant, response id) -> the worker id that stored it; at most `capacity`.
    `searching`: searches of the workers running now (at most `max_searches`)."""

    def __init__(self, capacity: int = MAX_TRACKED, max_searches: int = MAX_SEARCHES) -> None:
        self.capacity = capacity
        self.max_searches = max_searches
        self.searching = 0
        self._where: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def record(self, tenant: str | None, response_id: str, worker_id: str) -> None:
        key = (tenant or "", response_id)
        self._where[key] = worker_id
        self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def get(self, tenant: str | None, response_id: str) -> str | None:
        key = (tenant or "", response_id)
        found = self._where.get(key)
        if found is not None:
            self._where.move_to_end(key)
        return found

    def forget(self, tenant: str | None, response_id: str) -> None:
        self._where.pop((tenant or "", response_id), None)


def tenant_headers(key: WorkerKey | None, tenant: str | None) -> dict[str, str]:
    """A GET or DELETE's headers naming `tenant`, signed (the worker honours the name only
    signed)."""
    headers = {TENANT_HEADER: tenant} if tenant else {}
    if key is not None:
        headers[SIGNATURE_HEADER] = key.sign(b"", tenant_target(tenant) if tenant else None)
    return headers


def _candidates(ra: RouterApp) -> list[Worker]:
    return [w for w in ra.router.workers.values() if w.role != "prefill" and w.ready]


async def locate(ra: RouterApp, tenant: str | None, response_id: str) -> Worker | None:
    """The worker holding the tenant's response (module doc), or None."""
    workers = ra.router.workers
    if not _ISSUED.fullmatch(response_id):  # no worker issues such an id: ask none
        return None
    known = ra.locations.get(tenant, response_id)
    if known is not None and known in workers:
        return workers[known]
    candidates = _candidates(ra)
    if not candidates:
        return None
    where = ra.locations
    if where.searching >= where.max_searches:
        raise APIError(429, "too many lookups of unknown response ids in flight; retry later",
                       "previous_response_id", headers={"Retry-After": "1"})
    key, http = ra.settings.worker_key, ra.client()

    async def ask(w: Worker) -> Worker | None:
        try:
            r = await http.get(f"{w.id}/v1/responses/{response_id}",
                               headers=tenant_headers(key, tenant), timeout=LOCATE_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return w if r.status_code == 200 else None

    where.searching += 1
    try:
        results = await asyncio.gather(*(ask(w) for w in candidates))
    finally:
        where.searching -= 1
    for found in results:
        if found is not None:
            where.record(tenant, response_id, found.id)
            return found
    return None


async def by_id(ra: RouterApp, request: Request, response_id: str, method: str) -> Response:
    """`GET` / `DELETE /v1/responses/{id}`: relayed to the worker holding it (404 when
    none does)."""
    from tandem.router.stages import authenticate

    tenant = authenticate(ra, request.headers.get("authorization"))
    w = await locate(ra, tenant, response_id)
    if w is None:
        raise APIError(404, f"no response with id {response_id!r}", "response_id")
    try:
        r = await ra.client().request(method, f"{w.id}/v1/responses/{response_id}",
                                      headers=tenant_headers(ra.settings.worker_key, tenant))
    except httpx.HTTPError as exc:
        raise APIError(502, f"the worker could not be reached ({type(exc).__name__})",
                       type_="server_error") from exc
    if method == "DELETE" and r.status_code in (200, 404):
        ra.locations.forget(tenant, response_id)
    return Response(r.content, status_code=r.status_code,
                    media_type=r.headers.get("content-type", "application/json"))


def track(ra: RouterApp, tenant: str | None, response: Response,
          worker: Callable[[], str | None]) -> Response:
    """Remember where `response` (a relayed `POST /v1/responses` answer) is stored: its id,
    read from the body (a stream: its first events), -> `worker()`, the worker that
    answered."""
    def found(body: bytes) -> bool:
        m = _ID.search(body)
        wid = worker()
        if m is not None and wid is not None:
            ra.locations.record(tenant, m.group(1).decode(), wid)
        return m is not None

    if isinstance(response, StreamingResponse):
        response.body_iterator = _scan(response.body_iterator, found)
    elif response.status_code == 200:
        found(bytes(response.body))
    return response


async def _scan(chunks: AsyncIterator[bytes | str],
                found: Callable[[bytes], bool]) -> AsyncIterator[bytes | str]:
    seen = b""
    looking = True
    async for chunk in chunks:
        if looking:
            seen += chunk.encode() if isinstance(chunk, str) else chunk
            looking = not found(seen) and len(seen) < SCAN_BYTES
        yield chunk
