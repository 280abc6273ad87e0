"""Open-loop load generator for any OpenAI-compatible `/v1/completions` endpoint.

Requests are sent at Poisson arrival times (exponential gaps with mean ``1/rate`` seconds,
drawn from a seeded generator, so every server sees the same schedule) and streamed with
``stream_options.include_usage``. Per request it records, in seconds on the client's
monotonic clock:

* ``ttft``: send -> first streamed chunk that carries a token;
* ``itl``: gaps between consecutive token-carrying chunks;
* ``e2e``: send -> the stream's end (``data: [DONE]``);
* ``output_tokens``: the server's ``usage.completion_tokens``.

A request counts as failed on an HTTP error, an error event in the stream, a missing
``[DONE]``, or fewer tokens than asked for (the workload sets ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from workload import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    sent_at: float  # seconds since the run started
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for 1-token outputs)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.25


@dataclass
class RateSummary:
    """Aggregates of one run at one request rate (latencies in seconds)."""

    rate: float  # requested arrivals per second (inf = all at once)
    num_requests: int
    completed: int
    failed: int
    duration_s: float  # first send -> last completion
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    goodput: float  # requests / s that met the SLO
    slo: SLO
    ttft: dict[str, float]
    tpot: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    errors: list[str]

    def to_json(self) -> dict:
        d = asdict(self)
        d["rate"] = "inf" if math.isinf(self.rate) else self.rate
        return d


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of `values` (linear interpolation); NaN when empty."""
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99")}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of `n` Poisson arrivals at `rate` per second; all zero for rate=inf."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("rate must be > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps).tolist()


def summarize(rate: float, results: Sequence[RequestResult], slo: SLO) -> RateSummary:
    ok = [r for r in results if r.ok]
    if ok:
        start = min(r.sent_at for r in results)
        end = max(r.sent_at + r.e2e for r in ok)
        duration = max(end - start, 1e-9)
    else:
        duration = math.nan
    good = [r for r in ok if r.ttft <= slo.ttft_s and (r.tpot is None or r.tpot <= slo.tpot_s)]
    return RateSummary(
        rate=rate, num_requests=len(results), completed=len(ok),
        failed=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        goodput=len(good) / duration, slo=slo,
        ttft=percentiles([r.ttft for r in ok]),
        tpot=percentiles([t for r in ok if (t := r.tpot) is not None]),
        itl=percentiles([g for r in ok for g in r.itl]),
        e2e=percentiles([r.e2e for r in ok]),
        errors=sorted({r.error for r in results if r.error})[:10],
    )


class StreamError(Exception):
    """A streamed answer that failed: its HTTP status, an error chunk or no `[DONE]`."""


async def sse_chunks(client: httpx.AsyncClient, url: str,
                     body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST `body` to `url` and yield each `data:` chunk of the event stream up to `[DONE]`;
    StreamError for a status other than 200, an error chunk or a stream ending early."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise StreamError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                text = err.get("message", "") if isinstance(err, dict) else str(err)
                raise StreamError(f"stream error: {text[:200]}")
            yield chunk
    raise StreamError("stream ended without [DONE]")


# what a request's stream can fail with (stream_error words it for a result's `error`)
STREAM_ERRORS = (StreamError, httpx.HTTPError, json.JSONDecodeError)


def stream_error(exc: Exception) -> str:
    return str(exc) if isinstance(exc, StreamError) else f"{type(exc).__name__}: {exc}"[:200]


def bench_client(timeout_s: float) -> httpx.AsyncClient:
    """The client a run's concurrent streams share (no cap on connections)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                   t0: float, extra: Mapping[str, Any] | None = None) -> RequestResult:
    """Stream one greedy completion of exactly `req.max_tokens` tokens; `extra` adds body
    fields (e.g. a `cache_salt`, so a rerun of the same prompts starts cold)."""
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.monotonic()
    res = RequestResult(ok=False, sent_at=start - t0, prompt_tokens=len(req.prompt_token_ids),
                        max_tokens=req.max_tokens)
    last: float | None = None
    try:
        async for chunk in sse_chunks(client, f"{url}/v1/completions", body):
            now = time.monotonic()
            if chunk.get("choices"):
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
            if chunk.get("usage"):
                res.output_tokens = int(chunk["usage"]["completion_tokens"])
    except STREAM_ERRORS as exc:
        res.error = stream_error(exc)
        return res
    res.e2e = time.monotonic() - start
    if res.ttft is None:
        res.error = "no token chunk"
    elif res.output_tokens != req.max_tokens:
        res.error = f"got {res.output_tokens} tokens, asked for {req.max_tokens}"
    else:
        res.ok = True
    return res


async def run_rate(url: str, model: str, requests: Sequence[BenchRequest], rate: float,
                   seed: int, timeout_s: float = 600.0,
                   extra: Mapping[str, Any] | None = None,
                   offsets: Sequence[float] | None = None) -> list[RequestResult]:
    """Send `requests` open-loop at Poisson `rate` (or at the given arrival `offsets`, in
    seconds); return results in request order."""
    if offsets is None:
        offsets = arrival_times(len(requests), rate, seed)
    async with bench_client(timeout_s) as client:
        t0 = time.monotonic()

        async def later(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            return await send_one(client, url, model, req, t0, extra)

        return list(await asyncio.gather(*(later(r, at)
                                           for r, at in zip(requests, offsets, strict=True))))


@dataclass
class OneTokenLatency:
    """Sequential 1-token completions of one cached prompt (seconds per request).

    `client` is the wall time seen by a minimal stdlib HTTP client on a kept-alive
    connection; `engine` is the server's own `Server-Timing: engine;dur=` (Tandem's
    worker sends it: engine arrival to finished output) and `overhead` = client - engine
    per request: everything the server and the loopback add around the model."""

    client: dict[str, float]
    engine: dict[str, float] | None
    overhead: dict[str, float] | None


def one_token_latency(url: str, model: str, prompt_token_ids: list[int],
                      repeats: int) -> OneTokenLatency:
    """The first request fills the prefix cache and is not counted."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = json.dumps({"model": model, "prompt": prompt_token_ids, "max_tokens": 1,
                       "temperature": 0.0}).encode()
    client, engine = [], []
    try:
        for i in range(repeats + 1):
            t = time.monotonic()
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            dt = time.monotonic() - t
            if resp.status != 200:
                raise RuntimeError(f"1-token request failed: HTTP {resp.status}")
            timing = _server_timing(resp.getheader("server-timing") or "")
            if i:
                client.append(dt)
                if "engine" in timing:
                    engine.append(timing["engine"])
    finally:
        conn.close()
    if len(engine) != len(client):
        return OneTokenLatency(percentiles(client), None, None)
    return OneTokenLatency(percentiles(client), percentiles(engine),
                           percentiles([c - e for c, e in zip(client, engine, strict=True)]))


def _server_timing(header: str) -> dict[str, float]:
    """`name;dur=ms, ...` -> {name: seconds} (RFC: W3C Server Timing)."""
    out = {}
    for item in header.split(","):
        name, _, rest = item.strip().partition(";")
        for param in rest.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = float(value) / 1e3
    return out


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as client:
        resp = await client.get(f"{url}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
