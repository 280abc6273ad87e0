"""The endpoint picker's decision as a gateway sees it: ext_proc round trip per request.

    .venv/bin/python bench/extproc_overhead.py [--requests N] [--workers N] [--out PATH]

Starts `--workers` stub workers (`bench/stub_worker.py`: real /ready and gRPC KV-event
stream, the bundled model's name, so the router tokenizes with the bundled tokenizer) and a
real `tandem router --ext-proc-port` process in front of them. One client plays Envoy
(FULL_DUPLEX_STREAMED, Envoy's published protos): per request it streams the headers and a
~100-token chat body (one chunk, unique user turn), times until the picker's
request-headers answer (the pick) arrives, reads the streamed body back, then feeds a small
200 JSON response through the stream and closes it. Sequential, after `--warmup` requests.

Reports the round trip's percentiles (ms), the router's own `tandem_router_routing_seconds`
(parse + tokenize + hash + pick) over the same requests from /metrics, and writes
`bench/results/extproc_overhead-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tandem.protocol.bundled import BUNDLED_NAME

BENCH = Path(__file__).resolve().parent
ANSWER = (b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":'
          b'{"role":"assistant","content":"a"},"finish_reason":"length"}],'
          b'"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101}}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headers(items: dict[str, str], eos: bool) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]),
        end_of_stream=eos)


def one(stub: pb_grpc.ExternalProcessorStub, body: bytes) -> float:
    """One exchange; seconds from the body's last chunk sent to the pick received."""
    out: queue.Queue = queue.Queue()
    out.put(pb.ProcessingRequest(request_headers=headers(
        {":method": "POST", ":path": "/v1/chat/completions",
         "content-type": "application/json"}, eos=False)))
    answers = stub.Process(iter(out.get, None), timeout=30)
    t0 = time.perf_counter()
    out.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    first = next(answers)
    took = time.perf_counter() - t0
    assert first.WhichOneof("response") == "request_headers", first
    while not next(answers).request_body.response.body_mutation.streamed_response \
            .end_of_stream:
        pass
    out.put(pb.ProcessingRequest(response_headers=headers(
        {":status": "200", "content-type": "application/json"}, eos=False)))
    next(answers)
    out.put(pb.ProcessingRequest(response_body=pb.HttpBody(body=ANSWER, end_of_stream=True)))
    next(answers)
    out.put(None)
    for _ in answers:
        pass
    return took


def routing_histogram(port: int) -> tuple[float, float]:
    """(sum, count) of tandem_router_routing_seconds now."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total = float(re.search(r"^tandem_router_routing_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^tandem_router_routing_seconds_count (\S+)", text, re.M).group(1))
    return total, count


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    procs = []
    try:
        urls = []
        for _ in range(args.workers):
            port, grpc_port = free_port(), free_port()
            procs.append(subprocess.Popen(
                [sys.executable, str(BENCH / "stub_worker.py"), "--port", str(port),
                 "--grpc-port", str(grpc_port)], stdout=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        http_port, epp_port = free_port(), free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "router", "--port", str(http_port),
             "--ext-proc-port", str(epp_port), "--workers", ",".join(urls),
             "--log-level", "WARNING"], stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        while True:
            try:
                ready = httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=2).json()
                if ready.get("ready_workers") == args.workers:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "the router did not become ready"
            time.sleep(0.2)
        channel = grpc.insecure_channel(f"127.0.0.1:{epp_port}")
        stub = pb_grpc.ExternalProcessorStub(channel)
        words = "the quick brown fox jumps over the lazy dog and " * 9

        def body(i: int) -> bytes:
            return json.dumps({"model": BUNDLED_NAME, "max_tokens": 1, "messages": [
                {"role": "user", "content": f"request {i}: {words}"}]}).encode()

        for i in range(args.warmup):
            one(stub, body(i))
        s0, c0 = routing_histogram(http_port)
        times = [one(stub, body(args.warmup + i)) for i in range(args.requests)]
        s1, c1 = routing_histogram(http_port)
        channel.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    ms = [t * 1000 for t in times]
    result = {
        "bench": "extproc_overhead", "date": dt.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "workers": args.workers, "requests": args.requests, "prompt": "~100-token chat",
        "pick_round_trip_ms": {"p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99),
                               "mean": sum(ms) / len(ms)},
        "router_routing_ms_mean": (s1 - s0) / max(c1 - c0, 1) * 1000,
        "routed": c1 - c0,
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out) if args.out else \
        BENCH / "results" / f"extproc_overhead-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
