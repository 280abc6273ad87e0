"""Where the autoscaler's numbers come from: a `MetricsSource` answers, per ready pod of a
pool, the samples of its `/metrics`; `per_replica` turns them into the signal's value per
replica (gauges as they are, `_total` counters as rates between two scrapes).

`HttpMetricsSource` lists the pool Service's EndpointSlices (what the routers watch too) and
scrapes each ready address's `http` port in parallel; tests use a fake source instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

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
