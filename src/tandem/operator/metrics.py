"""Where the autoscaler's numbers come from: a `MetricsSource` answers, per ready pod of a
pool, the samples of its `/metrics`; `per_replica` turns them into the signal's value per
replica (gauges as they are, `_total` counters as rates between two scrapes).

`HttpMetricsSource` lists the pool Service's EndpointSlices (what the routers watch too) and
scrapes each ready address's `http` port in parallel; tests use a fake source instead.

A pool on `signal: demand` scales on the router's own answer instead: a `ScalingSource`
reads `GET /scaling?model=&role=` (`render.keda.scaling_url`, the URL KEDA's trigger reads)
into a `Scaling`; `HttpScalingSource` over HTTP, without a key, as KEDA does (the routers'
metrics port asks for none; their NetworkPolicy admits the operator there), from every
router replica behind the URL's headless Service (each counts only its own queue).
"""

from __future__ import annotations

import json
import logging
import math
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.operator.render.common import HTTP_PORT_NAME
from tandem.operator.spec import Signal

logger = logging.getLogger(__name__)

Samples = dict[str, dict[str, float]]  # pod address -> sample name -> value (label sets summed)


class MetricsSource(Protocol):
    def scrape(self, namespace: str, service: str) -> Samples:
        """The samples of every ready endpoint of `service` (a pool's headless Service)."""
        ...


def parse(text: str) -> dict[str, float]:
    """Prometheus text → sample name -> value, summed over label sets (e.g. model_name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


class HttpMetricsSource:
    """Scrapes `/metrics` of the ready addresses in the Service's EndpointSlices."""

    def __init__(self, api_client: object, timeout_s: float = 2.0, parallel: int = 16) -> None:
        from kubernetes.client import DiscoveryV1Api

        self.api = DiscoveryV1Api(api_client)
        self.timeout_s, self.parallel = timeout_s, parallel

    def endpoints(self, namespace: str, service: str) -> list[str]:
        resp = self.api.list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={service}",
            _preload_content=False, _request_timeout=10)
        urls = []
        for sl in json.loads(resp.data).get("items", []):
            ports = [p["port"] for p in sl.get("ports") or [] if p.get("name") == HTTP_PORT_NAME]
            for ep in sl.get("endpoints") or [] if ports else []:
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                for addr in ep.get("addresses") or []:
                    host = f"[{addr}]" if ":" in addr else addr
                    urls.append(f"http://{host}:{ports[0]}/metrics")
        return urls

    def _get(self, url: str) -> dict[str, float] | None:
        try:
            resp = httpx.get(url, timeout=self.timeout_s)
            resp.raise_for_status()
            return parse(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            logger.info("scrape %s failed: %s", url, exc)
            return None

    def scrape(self, namespace: str, service: str) -> Samples:
        urls = self.endpoints(namespace, service)
        if not urls:
            return {}
        with ThreadPoolExecutor(min(self.parallel, len(urls))) as pool:
            got = dict(zip(urls, pool.map(self._get, urls), strict=True))
        return {u.split("/")[2]: s for u, s in got.items() if s is not None}


def per_replica(signal: Signal, samples: Samples, replicas: int, now: float,
                previous: Mapping[str, tuple[float, float]]) -> float | None:
    """The signal summed over the pods that answered, divided by the pool's replicas (a pod
    still starting carries no load yet); None without data (no pod, or a rate's first
    scrape). `previous` is pod -> (time, counter) of the last scrape, for rates."""
    values = []
    for pod, metrics in samples.items():
        value = metrics.get(signal.worker_metric)
        if value is None:
            continue
        if signal.rate:
            if pod not in previous or now <= previous[pod][0]:
                continue
            t0, c0 = previous[pod]
            value = (value - c0 if value >= c0 else value) / (now - t0)  # a reset restarts
        values.append(value)
    if not values:
        return None
    return sum(values) / max(replicas, len(values), 1)


def counters(signal: Signal, samples: Samples, now: float) -> dict[str, tuple[float, float]]:
    """What `per_replica` needs as `previous` on the next tick."""
    if not signal.rate:
        return {}
    return {pod: (now, m[signal.worker_metric]) for pod, m in samples.items()
            if signal.worker_metric in m}


# ---- the router's /scaling ---------------------------------------------------------------

MAX_SCALING_BYTES = 1 << 16  # a /scaling answer is a few hundred bytes; more is refused
MAX_ROUTERS = 128  # router replicas read per answer (the CRD allows 100)


class ScalingError(Exception):
    """The router's `/scaling` could not be read or made no sense (the message says why)."""


@dataclass(frozen=True)
class Scaling:
    """The router's `/scaling` answer for one model and role (`router.flowcontrol.scaling`):
    requests queued in its flow control (in total and per band), running and waiting on the
    role's workers, `demand` their sum; the role's mean KV use and its routable workers."""

    demand: float
    queued: int = 0
    running: int = 0
    waiting: int = 0
    kv_utilization: float = 0.0
    ready_workers: int = 0
    queued_by_band: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any) -> Scaling:
        """`ScalingError` unless `body` is an object with a finite, non-negative `demand`."""
        if not isinstance(body, dict):
            raise ScalingError(f"not a JSON object: {str(body)[:80]!r}")
        demand = body.get("demand")
        if (not isinstance(demand, int | float) or isinstance(demand, bool)
                or not math.isfinite(demand) or demand < 0):
            raise ScalingError(f"demand {demand!r}: not a number >= 0")

        def count(key: str) -> int:
            v = body.get(key, 0)
            return v if isinstance(v, int) and not isinstance(v, bool) else 0

        bands, kv = body.get("queued_by_band"), body.get("kv_utilization")
        kv = float(kv) if isinstance(kv, int | float) and not isinstance(kv, bool) else 0.0
        return cls(float(demand), count("queued"), count("running"), count("waiting"),
                   kv, count("ready_workers"),
                   {str(k): v for k, v in bands.items() if isinstance(v, int)}
                   if isinstance(bands, dict) else {})


class ScalingSource(Protocol):
    def read(self, url: str) -> Scaling:
        """The answer at `url` (a `render.keda.scaling_url`); `ScalingError` on failure."""
        ...


def combine(answers: Sequence[Scaling]) -> Scaling:
    """One answer for a fleet of router replicas, each of which counts only its own queue
    while all see the same workers' load: the queued shares (demand - running - waiting)
    and the bands summed, running + waiting of the replica that sees the most."""
    if len(answers) == 1:
        return answers[0]
    busiest = max(answers, key=lambda a: a.running + a.waiting)
    held = sum(max(a.demand - a.running - a.waiting, 0.0) for a in answers)
    bands: dict[str, int] = {}
    for a in answers:
        for band, n in a.queued_by_band.items():
            bands[band] = bands.get(band, 0) + n
    return Scaling(held + busiest.running + busiest.waiting, sum(a.queued for a in answers),
                   busiest.running, busiest.waiting,
                   max(a.kv_utilization for a in answers),
                   max(a.ready_workers for a in answers), bands)


def dns_endpoints(url: str) -> list[str]:
    """scheme://address:port for every address `url`'s host resolves to: through a headless
    Service (the routers' NAME-metrics), every ready router replica."""
    parts = urlsplit(url)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ScalingError(f"{parts.hostname}: {exc}") from exc
    addresses = sorted({str(info[4][0]) for info in infos})[:MAX_ROUTERS]
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{parts.port}" for a in addresses]


class HttpScalingSource:
    """Reads `/scaling` over HTTP from every router replica (`endpoints`: the base URLs a
    URL's host stands for, `dns_endpoints` by default) in parallel and `combine`s their
    answers; any replica unread fails the read. `base`: one scheme://host:port to send
    every request to instead (the operator run outside the cluster, e.g. through
    `kubectl port-forward`)."""

    def __init__(self, timeout_s: float = 2.0, base: str | None = None,
                 endpoints: Callable[[str], list[str]] = dns_endpoints) -> None:
        self.timeout_s = timeout_s
        self.endpoints = endpoints if base is None else (lambda _url: [base])

    def read(self, url: str) -> Scaling:
        parts = urlsplit(url)
        urls = [f"{b.rstrip('/')}{parts.path}?{parts.query}" for b in self.endpoints(url)]
        if not urls:
            raise ScalingError(f"{url}: no router answers there")
        if len(urls) == 1:
            return self._read_one(urls[0])
        with ThreadPoolExecutor(min(16, len(urls))) as pool:
            return combine(list(pool.map(self._read_one, urls)))

    def _read_one(self, url: str) -> Scaling:
        try:
            with httpx.stream("GET", url, timeout=self.timeout_s) as resp:
                resp.raise_for_status()
                body = b""
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > MAX_SCALING_BYTES:
                        raise ScalingError(f"{url}: answer over {MAX_SCALING_BYTES} bytes")
            return Scaling.from_json(json.loads(body))
        except httpx.HTTPError as exc:
            raise ScalingError(f"{url}: {exc}") from exc
        except ValueError as exc:
            raise ScalingError(f"{url}: not JSON ({exc})") from exc
