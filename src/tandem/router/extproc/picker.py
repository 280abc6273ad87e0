"""One gateway request's decision, through the HTTP router's own stages (`router.stages`).

`decide` runs authenticate -> parse_body -> admit -> charge -> flow control -> shared_matches
-> `Routing.pick` (the same scheduler, index, scorers and P/D decision as the HTTP front
door), restricted to the gateway's subset hint, then ranks up to `fallbacks` more endpoints
by the same policy without keeping their speculative blocks or churn charge (they are
retracted at once: only a served endpoint is charged). Every stop is an `APIError`: 503 when
no endpoint fits (the subset empty of candidates included), flow control's 429 / 503, the
stages' own answers. The `Pick` holds what the response phase settles: the rate-limit charge,
the flow ticket, the worker's in-flight count, and the served endpoint's bookkeeping.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.protocol.migration import RESUME_HEADER, TOKENS_HEADER
from tandem.protocol.signing import SIGNATURE_HEADER
from tandem.protocol.web import (
    PEER_BLOCKS_HEADER,
    PEER_HEADER,
    PREFILL_HEADER,
    APIError,
    forward_target,
    plain_request_id,
)
from tandem.router import responses, stages, usage
from tandem.router.extproc.encode import endpoint, in_subset
from tandem.router.extproc.settings import (
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    REWRITE_HEADER,
    ExtProcSettings,
    FairnessIds,
)
from tandem.router.flowcontrol.base import FlowRequest, FlowTicket
from tandem.router.pd import Route
from tandem.router.proxy import Attempt
from tandem.router.scorers.session import SESSION_HEADER
from tandem.router.workers import Worker

if TYPE_CHECKING:
    from tandem.router.routes import RouterApp

logger = logging.getLogger("tandem.router.extproc")
KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
         "/v1/responses": "responses"}
# request headers the upstream must not get from the client: the router's own (signed) ones,
# the migration ones (token ids, resume: the endpoint picker does not migrate), and the
# client's API key (a worker never sees it, as behind the HTTP router)
STRIPPED = (PREFILL_HEADER, PEER_HEADER, PEER_BLOCKS_HEADER, TOKENS_HEADER, RESUME_HEADER,
            SIGNATURE_HEADER, "authorization")
# response headers Envoy sets on an answer it made itself without reaching the worker: its own
# circuit breaker or overload manager (503), its local rate limit (429)
GATEWAY_LOCAL = ("x-envoy-overloaded", "x-envoy-ratelimited")


@dataclass
class Pick:
    """A routed request: the endpoints (pick first, then fallbacks), the headers the upstream
    request gets and its body, and what the answer settles."""

    rid: str
    endpoints: list[str]
    headers: dict[str, str]
    body: bytes
    route: Route
    routing: stages.Routing
    by_endpoint: dict[str, Route] = field(default_factory=dict)
    bill: stages.Charge | None = None
    ticket: FlowTicket | None = None
    stream: bool = False
    tenant: str | None = None
    track: bool = False  # a stored Responses API answer: remember the worker holding it
    in_flight: object = None  # the worker whose local_in_flight this request holds
    attempted: Worker | None = None  # the worker whose breaker counts this request sent
    judged: bool = False  # its breaker was given the outcome (or the trial given up)

    def hold(self, route: Route) -> None:
        """Count the request in flight on `route`'s worker (moved when another serves)."""
        self.drop()
        route.worker.local_in_flight += 1
        self.in_flight = route.worker

    def drop(self) -> None:
        w, self.in_flight = self.in_flight, None
        if w is not None:
            w.local_in_flight -= 1  # type: ignore[attr-defined]


def band(ra: RouterApp, settings: ExtProcSettings, headers: dict[str, str],
         data: dict) -> int:
    """The flow-control band: the named InferenceObjective's priority (higher first; a
    watched one wins over router.yaml `objectives`), else the tenant's (`-priority`: a lower
    vLLM priority is more urgent)."""
    objective = headers.get(OBJECTIVE_HEADER)
    if objective is not None and (known := settings.priority(objective)) is not None:
        return known
    p = data.get("priority", 0)
    return -p if isinstance(p, int) and not isinstance(p, bool) else 0


def flow_id(tenant: str | None, headers: dict[str, str],
            known: FairnessIds | None = None) -> str:
    """The flow a request is queued fairly in: its tenant (API keys), else the gateway's
    `x-gateway-inference-fairness-id` (short and plain; beyond `known`'s bound of distinct
    ids, "other"), else "anonymous"."""
    if tenant is not None:
        return tenant
    fairness_id = plain_request_id(headers.get(FAIRNESS_HEADER))
    if not fairness_id:
        return "anonymous"
    return fairness_id if known is None else known.flow(fairness_id)


async def decide(ra: RouterApp, settings: ExtProcSettings, kind: str,
                 headers: dict[str, str], body: bytes, subset: list[str] | None) -> Pick:
    """Route one request (module doc); APIError to answer it instead."""
    rid = stages.request_id(headers.get("x-request-id"))
    tenant = stages.authenticate(ra, headers.get("authorization"))
    if REWRITE_HEADER in headers:  # a model rewrite would be silently lost: refused
        ra.metrics.child(ra.metrics.rejected, "400").inc()
        raise APIError(400, f"{REWRITE_HEADER} is not supported: the body's model is routed "
                            "as sent", REWRITE_HEADER)
    t0 = time.perf_counter()
    req = await stages.parse_body(ra, kind, body, headers.get("content-type"), tenant, rid)
    stages.admit(ra, req)
    bill = await stages.charge(ra, kind, req)
    ticket = None
    try:
        flow = ra.settings.flow_control
        if flow is not None and req.parsed.stream and kind != "responses":
            stages.ask_usage(req)  # its usage chunk settles the flow ticket
        req.data["model"] = req.model
        payload = json.dumps(req.data).encode() if req.changed else req.raw
        if flow is not None:
            tokens = len(req.parsed.token_ids) if req.parsed.token_ids is not None \
                else len(req.parsed.text.encode()) + 2
            cost = usage.worst_case(kind, req.data, tokens,
                                    ra.router.max_model_len(req.model))[0]
            ticket = await flow.acquire(FlowRequest(
                rid, flow_id(tenant, headers, settings.fairness_ids), req.model,
                band(ra, settings, headers, req.data), cost, len(payload)))
        hashes, external = await stages.shared_matches(ra, req.parsed, req.model)
        routing = stages.Routing(ra, rid, req, t0, hashes, external)
        routing.session = stages.session_tokens(ra).worker(headers.get(SESSION_HEADER),
                                                           ra.router.workers)
        previous = req.data.get("previous_response_id") if kind == "responses" else None
        if isinstance(previous, str):
            holder = await responses.locate(ra, tenant, previous)
            routing.pinned = holder.id if holder is not None else None
        excluded = ({w.id for w in ra.router.workers.values()
                     if not in_subset(endpoint(w.id), subset)} if subset is not None else set())
        route = routing.pick(excluded)
        if route is None:
            ra.metrics.child(ra.metrics.rejected, "503").inc()
            raise APIError(503, "no ready endpoint serves this model" +
                           (" among the gateway's subset" if subset is not None else "") +
                           "; retry later", headers={"Retry-After": "1"})
        pick = Pick(rid, [endpoint(route.worker.id)], {}, payload, route, routing,
                    bill=bill, ticket=ticket, stream=req.parsed.stream, tenant=tenant,
                    track=kind == "responses" and req.data.get("store") is not False)
        pick.by_endpoint[pick.endpoints[0]] = route
        tried = excluded | {route.worker.id}
        for _ in range(settings.fallbacks):  # ranked by the same policy, not charged
            extra, _ctx = routing.plan(tried)
            if extra is None:
                break
            ra.router.retract(extra.decision, time.monotonic())
            tried.add(extra.worker.id)
            pick.endpoints.append(endpoint(extra.worker.id))
            pick.by_endpoint[pick.endpoints[-1]] = extra
    except BaseException:
        if ticket is not None:
            ticket.release()
        if bill is not None:
            bill.bill.settle()  # not routed: nothing was generated
        raise
    pick.headers = upstream_headers(ra, pick)
    pick.hold(route)
    route.worker.breaker.on_attempt(time.monotonic())  # past its cooldown: the trial
    pick.attempted = route.worker
    return pick


def upstream_headers(ra: RouterApp, pick: Pick) -> dict[str, str]:
    """What the upstream request carries beyond the client's headers: its request id, the
    body's length, the P/D target or KV peer and the router's signature, as `proxy.forward`
    signs."""
    out = {"x-request-id": pick.rid, "content-length": str(len(pick.body)),
           **pick.route.headers()}
    signer = ra.settings.worker_key
    if signer is not None:
        out[SIGNATURE_HEADER] = signer.sign(
            pick.body, forward_target(out.get(PREFILL_HEADER), out.get(PEER_HEADER)))
    return out


def served(ra: RouterApp, pick: Pick, ep: str | None, status: int | None) -> str:
    """Book the endpoint the gateway says served `pick` (`ep`; None: not reported, the pick
    assumed): count it, and when it is not the pick, retract the pick's speculative blocks
    and churn charge and record them on the worker that served. Returns the outcome label."""
    metrics, router = ra.metrics, ra.router
    primary = pick.endpoints[0]
    if ep is None:
        outcome = "unreported"
    elif ep == primary:
        outcome = "pick"
    elif ep in pick.by_endpoint:
        outcome = "fallback"
    else:
        outcome = "other"
    metrics.child(metrics.extproc_served, outcome).inc()
    chosen = pick.route if outcome in ("pick", "unreported") else None
    if outcome in ("fallback", "other"):
        now = time.monotonic()
        router.retract(pick.route.decision, now)
        by_ep = {endpoint(w.id): w for w in router.workers.values()}
        w = by_ep.get(ep)  # type: ignore[arg-type]
        if w is not None:  # record its blocks (and churn) on the worker that served
            others = {wid for wid in router.workers if wid != w.id}
            route, _ctx = pick.routing.plan(others)
            if route is not None:
                pick.hold(route)
                chosen = route
            else:
                pick.drop()
        else:
            pick.drop()
        logger.info("[%s] served by %s, not the pick %s", pick.rid, ep, primary)
    if chosen is not None:  # requests by worker and status, aggregated / disaggregated
        pick.routing.on_attempt(Attempt(chosen, status=status, final=True))
    return outcome


def judge(pick: Pick, status: int | None, headers: dict[str, str]) -> None:
    """Feed the circuit breaker of the worker that served `pick` (`pick.in_flight` once
    `served` booked it) from the answer's status, as the HTTP front door does per attempt: a
    5xx is a failure (the worker's own, or the one Envoy answers for it: 503 for a refused or
    reset connection, 504 for a timeout), any other status a success. An answer Envoy made
    without reaching the worker (`GATEWAY_LOCAL`), an unknown status or an endpoint that is
    not one of ours judges nothing; a breaker whose half-open trial went elsewhere or was not
    judged is freed for the next one (`CircuitBreaker.on_abandon`). Once per pick."""
    if pick.judged:
        return
    pick.judged = True
    now = time.monotonic()
    served = pick.in_flight if isinstance(pick.in_flight, Worker) else None
    if pick.attempted is not None and pick.attempted is not served:
        pick.attempted.breaker.on_abandon()
    if served is None or status is None or any(h in headers for h in GATEWAY_LOCAL):
        if served is not None:
            served.breaker.on_abandon()
        return
    if status >= 500:
        served.breaker.on_failure(now)
        logger.info("[%s] %s answered %d through the gateway: a breaker failure", pick.rid,
                    served.id, status)
    else:
        served.breaker.on_success()


def abandon(pick: Pick) -> None:
    """The stream ended with no answer seen: nothing to judge, the trial (if any) freed."""
    if not pick.judged:
        pick.judged = True
        if pick.attempted is not None:
            pick.attempted.breaker.on_abandon()
