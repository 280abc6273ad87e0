"""Render-to-manifests time of the operator for an InferenceService with 100 worker replicas.

What the operator does on every create/update before it applies anything: parse the CR's
spec (`tandem.operator.spec.parse_spec`), render every child (`render_all`), and serialize
each manifest to the JSON body of a server-side apply request. The worker count only changes
`replicas`, so the cost is per pool, not per replica; the 2-replica run shows it.

    .venv/bin/python bench/operator_render.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from tandem.operator.render import Owner, render_all
from tandem.operator.spec import parse_spec

HERE = Path(__file__).resolve().parent


def cr_spec(prefill: int, decode: int) -> dict:
    """A disaggregated, GPU, TLS, autoscaled, monitored spec: the most children."""
    gpu = {"limits": {"nvidia.com/gpu": 1, "cpu": "8", "memory": "64Gi"}}
    return {
        "model": {"uri": "pvc://models/llama-3-8b.Q8_0.gguf", "sha256": "ab" * 32},
        "router": {"replicas": 3, "weights": {"prefix": 3}, "apiKeysSecret": {"name": "keys"},
                   "rateLimits": {"default": {"requestsPerSecond": 50}},
                   "redisUrlSecretRef": {"name": "tandem-redis"}, "sharedIndex": True},
        "prefill": {"replicas": prefill, "resources": gpu,
                    "autoscaling": {"maxReplicas": 200, "target": 4000,
                                    "signal": "tokensPerSecond"}},
        "decode": {"replicas": decode, "resources": gpu,
                   "autoscaling": {"maxReplicas": 200, "target": 4}},
        "kvTransfer": {"tlsSecret": "kv-tls"},
        "monitoring": {"serviceMonitor": True},
    }


def measure(raw: dict, repeat: int) -> dict:
    owner = Owner("llama", "ml", "0b5c6a9e-1111-4222-8333-444455556666")
    render_ms, total_ms = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        docs = render_all(parse_spec(raw), owner)
        t1 = time.perf_counter()
        bodies = [json.dumps(d) for d in docs]
        t2 = time.perf_counter()
        render_ms.append((t1 - t0) * 1e3)
        total_ms.append((t2 - t0) * 1e3)
    qs = statistics.quantiles
    return {"manifests": len(docs), "bytes": sum(map(len, bodies)),
            "worker_replicas": sum(d["spec"]["replicas"] for d in docs if d["kind"] ==
                                   "Deployment" and not d["metadata"]["name"].endswith("router")),
            "parse_render_ms": {"p50": statistics.median(render_ms),
                                "p99": qs(render_ms, n=100)[98]},
            "parse_render_serialize_ms": {"p50": statistics.median(total_ms),
                                          "p99": qs(total_ms, n=100)[98]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = {"100_replicas": measure(cr_spec(prefill=40, decode=60), args.repeat),
            "2_replicas": measure(cr_spec(prefill=1, decode=1), args.repeat)}
    for name, r in runs.items():
        print(f"{name}: {r['manifests']} manifests ({r['worker_replicas']} worker replicas, "
              f"{r['bytes']} bytes of JSON): parse + render p50 "
              f"{r['parse_render_ms']['p50']:.3f} ms, p99 {r['parse_render_ms']['p99']:.3f} ms;"
              f" + serialize p50 {r['parse_render_serialize_ms']['p50']:.3f} ms")
    result = {"benchmark": "operator_render", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "python": platform.python_version(), "machine": platform.machine(),
              "repeat": args.repeat, "runs": runs}
    out = Path(args.out or HERE / "results" / f"operator_render-{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
