"""Egress of the pods the operator renders, evaluated with NetworkPolicy semantics
(`tests.operator.netpol`, both ends of every connection): DNS, peers, the router's workers,
Kubernetes API and Redis, the Hub only where an init container downloads, and never a cloud
metadata address on any port (a seeded sweep). The policies validate against the Kubernetes
1.32 schemas."""

from __future__ import annotations

import random

import pytest

from tandem.operator.render import Owner, render_all
from tandem.operator.render.security import OperatorPeer, operator_from_env
from tandem.operator.spec import parse_spec
from tests.operator.lws import validate
from tests.operator.manifests import by_kind
from tests.operator.netpol import Pod, connects, pods_of
from tests.operator.samples import SHA, spec

OPERATOR = OperatorPeer("tandem-system", "tandem", 6379)
HF = {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct", "sha256": SHA},
      "prefill": {"replicas": 1}, "decode": {"replicas": 1},
      "router": {"managedRedis": True, "rateLimits": {"default": {"requestsPerSecond": 5}}}}
PVC = {"model": {"uri": "pvc://models/m.gguf", "sha256": SHA}, "decode": {"replicas": 1}}
METADATA = ("169.254.169.254", "169.254.170.23", "100.100.100.200", "fd00:ec2::254",
            "fe80::a9fe:a9fe")


def outside(ip: str) -> Pod:
    return Pod(f"outside/{ip}", None, {}, ip=ip)


def world() -> tuple[list[dict], dict[str, Pod]]:
    docs = render_all(parse_spec(HF), Owner("alpha", "ml", "u1"), image="t", operator=OPERATOR)
    other = render_all(parse_spec(PVC), Owner("beta", "ml", "u2"), image="t",
                       operator=OPERATOR)
    pods = {p.name: p for p in pods_of(docs, "ml") + pods_of(other, "ml")}
    for i, p in enumerate(pods.values()):
        object.__setattr__(p, "ip", f"10.0.0.{i + 10}")
    pods["redis"] = Pod("tandem-system/tandem-redis", "tandem-system",
                        {"app.kubernetes.io/component": "redis",
                         "app.kubernetes.io/instance": "tandem"}, {"redis": 6379}, "10.0.1.1")
    pods["other-redis"] = Pod("tandem-system/x-redis", "tandem-system",
                              {"app.kubernetes.io/component": "redis",
                               "app.kubernetes.io/instance": "another"}, {}, "10.0.1.2")
    pods["dns"] = Pod("kube-system/coredns", "kube-system", {"k8s-app": "kube-dns"}, {},
                      "10.0.2.1")
    pods["hub"] = outside("18.164.1.2")
    pods["api"] = outside("172.18.0.2")
    return by_kind(docs + other, "NetworkPolicy"), pods


def test_rendered_policies_govern_egress_and_are_valid() -> None:
    policies, _ = world()
    for p in policies:
        assert p["spec"]["policyTypes"] == ["Ingress", "Egress"], p["metadata"]["name"]
        validate(p)


def test_who_reaches_what() -> None:
    policies, pods = world()
    decode, prefill, router = pods["ml/alpha-decode"], pods["ml/alpha-prefill"], pods[
        "ml/alpha-router"]
    beta_worker, beta_router = pods["ml/beta-worker"], pods["ml/beta-router"]
    for pod in (decode, prefill, router, beta_worker, beta_router):
        assert connects(policies, pod, pods["dns"], 53, "UDP"), pod.name
        assert connects(policies, pod, pods["dns"], 53, "TCP"), pod.name
        assert not connects(policies, pod, pods["dns"], 80), pod.name
    assert connects(policies, decode, prefill, 50051)  # KV transfer
    assert not connects(policies, decode, prefill, 8000)
    assert not connects(policies, decode, beta_worker, 50051)  # another InferenceService
    assert connects(policies, router, decode, 8000) and connects(policies, router, prefill,
                                                                 50051)
    assert not connects(policies, router, beta_worker, 8000)
    assert connects(policies, router, pods["api"], 6443)  # EndpointSlice discovery
    assert connects(policies, router, pods["api"], 443)
    assert connects(policies, router, pods["redis"], 6379)  # managedRedis: the chart's
    assert not connects(policies, router, pods["other-redis"], 6379)
    assert not connects(policies, beta_router, pods["redis"], 6379)  # no Redis in its spec
    for worker in (decode, prefill, beta_worker):
        assert not connects(policies, worker, pods["redis"], 6379), worker.name
        assert not connects(policies, worker, pods["api"], 6443), worker.name
    # the hf:// pools' init containers download; the pvc:// pool reaches no Hub
    assert connects(policies, decode, pods["hub"], 443)
    assert not connects(policies, beta_worker, pods["hub"], 443)
    assert not connects(policies, decode, pods["hub"], 80)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_pod_reaches_a_metadata_address_on_any_port(seed: int) -> None:
    policies, pods = world()
    rng = random.Random(seed)
    ours = [p for p in pods.values() if p.namespace == "ml"]
    ports = [80, 443, 6443, 6379, 53, 8000, 50051] + [rng.randint(1, 65535)
                                                      for _ in range(300)]
    for ip in METADATA:
        for port in ports:
            for proto in ("TCP", "UDP"):
                for pod in ours:
                    assert not connects(policies, pod, outside(ip), port, proto), (
                        pod.name, ip, port, proto)


def test_torch_backend_peers_reach_each_other_on_every_port() -> None:
    raw = spec("disaggregated")
    raw["kvTransfer"] = {"backend": "torch"}
    docs = render_all(parse_spec(raw), Owner("alpha", "ml", "u1"), image="t",
                      operator=OPERATOR)
    pods = pods_of(docs, "ml")
    policies = by_kind(docs, "NetworkPolicy")
    decode, prefill = ([p for p in pods if p.name == f"ml/alpha-{n}"][0]
                       for n in ("decode", "prefill"))
    port = random.Random(3).randint(20000, 60000)
    assert connects(policies, decode, prefill, port) and connects(policies, prefill, decode,
                                                                  port)
    # redisUrlSecretRef: the operator cannot read where it points; 6379, not the metadata
    router = [p for p in pods if p.name == "ml/alpha-router"][0]
    assert connects(policies, router, outside("10.9.9.9"), 6379)
    assert not connects(policies, router, outside("169.254.169.254"), 6379)
    assert not connects(policies, router, outside("10.9.9.9"), 6380)


def test_the_redis_port_comes_from_the_charts_address() -> None:
    env = {"TANDEM_OPERATOR_NAMESPACE": "tandem-system", "TANDEM_OPERATOR_RELEASE": "tandem",
           "TANDEM_REDIS_ADDRESS": "tandem-redis.tandem-system.svc:6390"}
    assert operator_from_env(env) == OperatorPeer("tandem-system", "tandem", 6390)
    assert operator_from_env({}) == OperatorPeer(None, None, None)
