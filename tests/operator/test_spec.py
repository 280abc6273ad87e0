"""`parse_spec`: defaults, model URIs, and the cross-field checks that raise `SpecError`
(each message names the field, so the operator's condition can say why)."""

from __future__ import annotations

import pytest

from tandem.operator.model_uri import parse_model_uri
from tandem.operator.spec import (
    MAX_NAME,
    AutoscalingSpec,
    EngineArgs,
    SpecError,
    check_name,
    parse_spec,
    signal_for,
)
from tandem.operator.spec_security import IssuerRef, SecretKeyRef, SecuritySpec
from tests.operator.samples import spec


def test_defaults_of_the_smallest_spec():
    s = parse_spec(spec("aggregated"))
    assert not s.disaggregated
    assert s.prefill.replicas == 0 and s.decode.replicas == 1
    assert s.decode.engine == EngineArgs()
    assert s.router.replicas == 1 and s.router.policy == "cost"
    assert s.router.pd_threshold == 16 and s.router.weights is None
    assert s.router.pd_max_prefill_queue == 0 and s.router.pd_max_local_prefill == 1024
    assert (s.router.pd_decision, s.router.pd_itl_weight) == ("cost", 1.0)
    assert s.router.pd_stall_budget == 0.005
    assert s.kv_transfer.backend == "grpc" and s.kv_transfer.tls_secret is None
    assert s.model.served_name == "SmolLM2-135M-Instruct"
    assert s.model.source.worker_path is None


def test_autoscaling_defaults_and_signals():
    s = parse_spec(spec("autoscaling"))
    assert s.decode.autoscaling == AutoscalingSpec(
        max_replicas=10, target=4.0, min_replicas=2, scale_down_stabilization_seconds=600)
    assert s.prefill.autoscaling.mode == "hpa"
    assert signal_for("tokensPerSecond", "prefill").worker_metric == "vllm:prompt_tokens_total"
    assert signal_for("tokensPerSecond", "decode").worker_metric == (
        "vllm:generation_tokens_total")
    assert signal_for("waitingRequests", "both").worker_metric == "vllm:num_requests_waiting"


@pytest.mark.parametrize(("uri", "kind", "worker_path", "name"), [
    ("pvc://models", "pvc", "/models", "models"),
    ("pvc://models/a/b.gguf", "pvc", "/models/a/b.gguf", "b"),
    ("hf://org/repo", "hf", "/models", "repo"),
    ("hf://org/repo@v1.2/sub/m.gguf", "hf", "/models/sub/m.gguf", "m"),
    ("file:///opt/m/qwen", "file", "/opt/m/qwen", "qwen"),
    ("SmolLM2-135M-Instruct", "bundled", None, "SmolLM2-135M-Instruct"),
])
def test_model_uris(uri, kind, worker_path, name):
    src = parse_model_uri(uri)
    assert (src.kind, src.worker_path, src.default_name) == (kind, worker_path, name)


def test_hf_revision():
    src = parse_model_uri("hf://org/repo@v1.2/sub/m.gguf")
    assert (src.repo, src.revision, src.path) == ("org/repo", "v1.2", "sub/m.gguf")


@pytest.mark.parametrize("uri", ["s3://bucket/m", "pvc://Bad_Claim/x", "pvc://m/../etc",
                                 "hf://justone", "file://relative", "file:///", "llama"])
def test_bad_model_uris(uri):
    with pytest.raises(SpecError, match="model.uri"):
        parse_model_uri(uri)


@pytest.mark.parametrize(("value", "arg"), [("0.5", "0.5"), ("1", "1.0"), ("8Gi", str(8 << 30)),
                                            ("1.5G", "1500000000"), ("123456789", "123456789")])
def test_kv_cache_memory(value, arg):
    raw = spec("aggregated")
    raw["decode"] = {"engine": {"kvCacheMemory": value}}
    assert parse_spec(raw).decode.engine.kv_cache_memory == arg


def _mutate(name: str, path: str, value) -> dict:
    raw = spec(name)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return raw


@pytest.mark.parametrize(("name", "path", "value", "message"), [
    ("disaggregated", "prefill.engine.blockSize", 32, "blockSize"),
    ("aggregated", "prefill.autoscaling", {"maxReplicas": 2, "target": 1}, "prefill.replicas"),
    ("aggregated", "decode.autoscaling", {"maxReplicas": 2, "minReplicas": 3, "target": 1},
     "minReplicas 3 exceeds maxReplicas 2"),
    ("aggregated", "decode.autoscaling", {"maxReplicas": 2, "target": 1.5,
                                          "signal": "kvUtilization"}, "fraction"),
    ("aggregated", "decode.autoscaling", {"target": 1}, "maxReplicas is required"),
    ("aggregated", "router.sharedIndex", True, "sharedIndex needs router.redisUrlSecretRef"),
    ("aggregated", "router.adminApiKeysSecret", {"name": "admins"},
     "adminApiKeysSecret needs router.apiKeysSecret"),
    ("disaggregated", "router.adminApiKeysSecret", {"key": "k"}, "adminApiKeysSecret.name"),
    ("aggregated", "router.redisUrl", "redis://:pw@redis:6379/0",
     r"router.redisUrl is no longer supported.*router.redisUrlSecretRef"),
    ("aggregated", "router.redisUrlSecretRef", {"key": "url"}, "redisUrlSecretRef.name"),
    ("aggregated", "router.redisUrlSecretRef", {"name": "r", "key": "a/b"},
     "redisUrlSecretRef.key"),
    ("aggregated", "kvTransfer.tlsIssuerRef", {"name": "ca"}, "tlsIssuerRef needs"),
    ("tls", "kvTransfer.tlsIssuerRef", {"name": "ca", "kind": "Vault"},
     "tlsIssuerRef.kind"),
    ("aggregated", "security.workerAuthSecretName", "Bad_Name", "workerAuthSecretName"),
    ("aggregated", "security.networkPolicy", {"enabled": "yes"}, "networkPolicy.enabled"),
    ("aggregated", "router.allowedClients", [{}], r"allowedClients\[0\]"),
    ("aggregated", "router.allowedClients", [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                              "podSelector": {}}], "ipBlock goes alone"),
    ("aggregated", "router.allowedClients", [{"ipBlock": {"cidr": "10.0.0.300/8"}}],
     r"allowedClients\[0\].ipBlock.cidr"),
    ("aggregated", "router.allowedClients", [{"ipBlock": {"cidr": "10.0.0.1"}}], "no /prefix"),
    ("aggregated", "router.allowedClients",
     [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}],
     r"allowedClients\[0\].podSelector.matchExpressions\[0\]: values are required"),
    ("aggregated", "router.allowedClients",
     [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Has"}]}}],
     "operator: 'Has' is not one of"),
    ("aggregated", "router.allowedClients", [{"podSelector": {"matchLabel": {}}}],
     "only matchLabels and matchExpressions"),
    ("aggregated", "router.allowedClients", [{"podSelector": {}}] * 33, "at most 32"),
    ("aggregated", "monitoring.prometheus", {"ipBlock": {"cidr": "10.0.0.0/8"}},
     "monitoring.prometheus: one of namespaceSelector, podSelector"),
    ("aggregated", "router.policy", "fastest", "router.policy"),
    ("aggregated", "router.weights", {"prefix": 1, "latency": 2}, "latency"),
    ("aggregated", "router.replicas", 0, "router.replicas"),
    ("aggregated", "router.pdDecision", "sometimes", "router.pdDecision"),
    ("aggregated", "router.pdItlWeight", 1001,
     r"router\.pdItlWeight: 1001.0 is not in \[0, 1000\]"),
    ("aggregated", "router.pdItlWeight", -1, r"router\.pdItlWeight: -1 is negative"),
    ("aggregated", "router.pdStallBudget", 1, r"router\.pdStallBudget: 1.0 is not in \[0, 1\)"),
    ("aggregated", "router.pdStallBudget", -0.1, r"router\.pdStallBudget: -0.1 is negative"),
    ("disaggregated", "prefill.engine.longPrefillTokenThreshold", -1,
     r"prefill\.engine\.longPrefillTokenThreshold: -1 is not in \[0, "),
    ("aggregated", "decode.replicas", "3", "expected int"),
    ("aggregated", "decode.replicas", True, "expected int"),
    ("aggregated", "decode.resources", {"requests": {"nvidia.com/gpu": 1}}, "nvidia.com/gpu"),
    ("aggregated", "decode.resources", {"limits": {"cpu": "two"}}, "quantity"),
    ("aggregated", "decode.engine.kvCacheMemory", "lots", "kvCacheMemory"),
    ("aggregated", "decode.engine.kvCacheMemory", "1.5", "kvCacheMemory"),
    ("aggregated", "kvTransfer.backend", "rdma", "kvTransfer.backend"),
    ("aggregated", "model.sha256", "ABC", "sha256"),
    ("aggregated", "model.dtype", "int8", "dtype"),
])
def test_spec_errors_name_the_field(name, path, value, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_mutate(name, path, value))


def test_security_fields():
    s = parse_spec(spec("secure"))
    assert s.router.redis_url_secret == SecretKeyRef("redis-auth", "redis-url")
    assert s.kv_transfer.tls_issuer == IssuerRef("tandem-ca", "ClusterIssuer", "cert-manager.io")
    assert s.security == SecuritySpec("secure-signing-key", network_policy=True)
    assert s.router.allowed_clients[1] == {"ipBlock": {"cidr": "10.20.0.0/16",
                                                       "except": ["10.20.9.0/24"]}}
    assert s.prometheus["podSelector"]["matchExpressions"] == [
        {"key": "shard", "operator": "Exists"}]
    d = parse_spec(spec("aggregated"))
    assert d.security == SecuritySpec() and d.security.network_policy
    assert d.router.redis_url_secret is None and d.router.allowed_clients == ()
    assert parse_spec(spec("disaggregated")).router.redis_url_secret == SecretKeyRef(
        "tandem-redis-url", "url")  # the key of the chart's URL Secret by default


def test_missing_model():
    with pytest.raises(SpecError, match="spec.model is required"):
        parse_spec({})
    with pytest.raises(SpecError, match="model.uri is required"):
        parse_spec({"model": {}})


def test_names():
    check_name("a" * MAX_NAME)
    for bad in ("a" * (MAX_NAME + 1), "Demo", "1demo", "demo-", "de.mo"):
        with pytest.raises(SpecError, match="name"):
            check_name(bad)
