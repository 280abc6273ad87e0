"""InferenceService specs the operator tests share, and the CRD as a dict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"
SHA = "0123456789abcdef" * 4

SPECS: dict[str, dict[str, Any]] = {
    # the smallest spec: the bundled model, one aggregated worker
    "aggregated": {"model": {"uri": "SmolLM2-135M-Instruct"}},
    "disaggregated": {
        "model": {"uri": "pvc://models/llama/llama-3-8b.Q8_0.gguf", "sha256": SHA,
                  "name": "llama-3-8b"},
        "router": {"replicas": 2, "policy": "cache-aware", "weights": {"prefix": 3.0},
                   "pdThreshold": 64, "pdMaxPrefillQueue": 3,
                   "pdMaxLocalPrefill": 2048, "pdDecision": "cost", "pdItlWeight": 0.5,
                   "pdStallBudget": 0.01,
                   "apiKeysSecret": {"name": "tandem-keys"},
                   "adminApiKeysSecret": {"name": "tandem-admin-keys"},
                   "rateLimits": {"default": {"requestsPerSecond": 10, "burstRequests": 20},
                                  "tenants": {"gold": {"tokensPerMinute": 100000}}},
                   "redisUrlSecretRef": {"name": "tandem-redis-url"}, "sharedIndex": True,
                   "serviceType": "LoadBalancer"},
        "prefill": {"replicas": 2, "engine": {"maxNumBatchedTokens": 8192,
                                                "longPrefillTokenThreshold": 1024}},
        "decode": {"replicas": 3, "engine": {"maxNumSeqs": 256, "kvCacheMemory": "0.5",
                                             "speculative": {"method": "ngram",
                                                             "num_speculative_tokens": 3}}},
    },
    "autoscaling": {
        "model": {"uri": "pvc://models", "sha256": SHA},
        "prefill": {"replicas": 1, "autoscaling": {
            "mode": "hpa", "minReplicas": 1, "maxReplicas": 4, "signal": "tokensPerSecond",
            "target": 2000}},
        "decode": {"replicas": 2, "autoscaling": {
            "minReplicas": 2, "maxReplicas": 10, "signal": "waitingRequests", "target": 4,
            "scaleDownStabilizationSeconds": 600}},
    },
    "tls": {
        "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1, "autoscaling": {
            "mode": "hpa", "maxReplicas": 3, "signal": "kvUtilization", "target": 0.8}},
        "kvTransfer": {"backend": "torch", "tlsSecret": "tandem-kv-tls", "policy": "fail",
                       "timeoutSeconds": 12.5, "streamLayers": True},
    },
    # every security field: cert-manager TLS, the caller's key Secret, NetworkPolicy peers
    "secure": {
        "model": {"uri": "pvc://models/m.gguf"},
        "router": {"redisUrlSecretRef": {"name": "redis-auth", "key": "redis-url"},
                   "allowedClients": [
                       {"namespaceSelector": {"matchLabels": {"team": "web"}},
                        "podSelector": {"matchExpressions": [
                            {"key": "app", "operator": "In", "values": ["gateway", "ui"]}]}},
                       {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"]}}]},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "kvTransfer": {"tlsSecret": "secure-grpc-tls",
                       "tlsIssuerRef": {"name": "tandem-ca", "kind": "ClusterIssuer"}},
        "monitoring": {"prometheus": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"},
                            "matchExpressions": [{"key": "shard", "operator": "Exists"}]}}},
        "security": {"workerAuthSecretName": "secure-signing-key"},
    },
    "gpu": {
        "image": "registry.example/tandem:dev",
        "model": {"uri": "file:///opt/models/qwen2-7b", "dtype": "bfloat16", "sha256": SHA},
        "prefill": {"replicas": 2, "resources": {
            "requests": {"cpu": "4", "memory": "32Gi"},
            "limits": {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": 1}},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}]},
        "decode": {"replicas": 4, "resources": {"limits": {"nvidia.com/gpu": 1,
                                                           "cpu": "3500m"}},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                    "effect": "NoSchedule"}],
                   "engine": {"blockSize": 16, "maxModelLen": 32768, "kvCacheMemory": "60Gi",
                              "numKvBlocks": 100000, "maxWaiting": 1024,
                              "enablePrefixCaching": False, "drainTimeoutSeconds": 120}},
        "monitoring": {"serviceMonitor": True, "interval": "15s",
                       "labels": {"release": "kube-prometheus-stack"}},
    },
    # pod settings on every pool and the router; an hf:// model through a shared cache
    "pods": {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659",
                  "hfTokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN"},
                  "cache": {"pvc": "model-cache"}},
        "router": {"replicas": 2, "image": "registry.example/tandem-control:1",
                   "nodeSelector": {"node-pool": "cpu"},
                   "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "serving",
                                    "effect": "NoSchedule"}],
                   "priorityClassName": "serving-critical", "podLabels": {"team": "ml"},
                   "topologySpreadConstraints": [{
                       "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                       "whenUnsatisfiable": "ScheduleAnyway"}],
                   "strategy": {"maxSurge": "25%", "maxUnavailable": 0}},
        "prefill": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}},
                    "runtimeClassName": "nvidia",
                    "strategy": {"maxSurge": 0, "maxUnavailable": 1},
                    "env": [{"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"}],
                    "envFrom": [{"configMapRef": {"name": "tandem-extra-env"}}]},
        "decode": {"replicas": 2, "image": "registry.example/tandem:cu128",
                   "resources": {"limits": {"nvidia.com/gpu": 1}},
                   "affinity": {"podAntiAffinity": {
                       "preferredDuringSchedulingIgnoredDuringExecution": [{
                           "weight": 100, "podAffinityTerm": {
                               "topologyKey": "kubernetes.io/hostname",
                               "labelSelector": {"matchLabels": {"tandem.dev/role": "decode"}}}}]}},
                   "imagePullSecrets": [{"name": "regcred"}],
                   "volumes": [{"name": "nccl-conf", "configMap": {"name": "nccl"}}],
                   "volumeMounts": [{"name": "nccl-conf", "mountPath": "/etc/nccl",
                                     "readOnly": True}],
                   "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
                   "env": [{"name": "NCCL_DEBUG", "value": "WARN"},
                           {"name": "TEAM_TOKEN", "valueFrom": {"secretKeyRef": {
                               "name": "team", "key": "token"}}}],
                   "strategy": {"maxSurge": 0, "maxUnavailable": "50%"}},
    },
    # P/D scaling to zero and back through KEDA, with the router's flow control in full
    "keda": {
        "model": {"uri": "pvc://models/llama", "sha256": SHA, "name": "Acme/llama:v2"},
        "router": {"flowControl": {"fairness": "round-robin", "ordering": "edf",
                                   "ttlSeconds": 45, "saturation": {"waiting": 2, "kv": 0.85},
                                   "bands": {"default": {"maxRequests": 512},
                                             "10": {"maxRequests": 64, "maxBytes": 1048576}},
                                   "tenantWeights": {"gold": 4}, "shared": True,
                                   "startTimeoutSeconds": 240},
                   "redisUrlSecretRef": {"name": "tandem-redis-url"}},
        "prefill": {"replicas": 1, "autoscaling": {
            "mode": "keda", "minReplicas": 0, "maxReplicas": 4, "target": 2}},
        "decode": {"replicas": 2, "autoscaling": {
            "mode": "keda", "minReplicas": 0, "maxReplicas": 10, "target": 16,
            "keda": {"kvUtilizationTarget": 0.85, "bandTargets": {"1": 8}}}},
    },
    # multi-LoRA on P/D pools: adapters on the model's claim, on another claim (pinned), on
    # the Hub (one pinned, one in a folder of a repository) and in the image
    "lora": {
        "model": {"uri": "pvc://models/llama-3-8b", "name": "llama-3-8b"},
        "lora": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 4, "storage": "2Gi",
                 "hfTokenSecretRef": {"name": "hf-token"},
                 "adapters": [
                     {"name": "sql", "uri": "pvc://models/adapters/sql"},
                     {"name": "Acme/support:v2", "uri": "pvc://adapters/support", "sha256": SHA},
                     {"name": "chat-es", "uri": "hf://org/llama-3-8b-es-lora@v1",
                      "sha256": SHA[::-1]},
                     {"name": "summarize", "uri": "hf://org/adapters/summarize"},
                     {"name": "tone", "uri": "file:///opt/adapters/tone"}]},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
    },
    # one GGUF file of a gated Hub repository, downloaded into a sized emptyDir
    # KV tiers under every worker's device pool (an emptyDir for the disk tier)
    "kv-tiers": {
        "model": {"uri": "pvc://models", "sha256": SHA},
        "kvCache": {"offload": {"hostBytes": "8Gi", "diskBytes": "20Gi"},
                    "peerPull": {"enabled": True}},
    },
    # the router's guardrails: every type, both layers, policies per tenant, a classifier
    # whose API key comes from a Secret
    "guardrails": {
        "model": {"uri": "SmolLM2-135M-Instruct"},
        "router": {"apiKeysSecret": {"name": "tandem-keys"}, "guardrails": {
            "input": [
                {"name": "no-injection", "type": "regex",
                 "pattern": "(?i)ignore (all )?previous instructions", "action": "refuse"},
                {"name": "pii-in", "type": "pii", "kinds": ["email", "ssn"],
                 "action": "redact"},
                {"name": "heuristics", "type": "injection", "threshold": 2, "action": "flag"},
                {"name": "size", "type": "limits", "maxChars": 20000, "maxMessages": 50,
                 "maxMessageChars": 8000, "maxTools": 16, "action": "refuse"},
                {"name": "mod", "type": "classifier",
                 "url": "http://moderation:8080/v1/moderations", "timeoutSeconds": 0.5,
                 "onError": "allow", "threshold": 0.8, "categories": ["violence"],
                 "maxChars": 16384, "model": "omni-moderation-latest",
                 "apiKeySecretRef": {"name": "moderation", "key": "token"},
                 "action": "refuse"}],
            "output": [
                {"name": "no-ssn", "type": "regex", "pattern": r"\b\d{3}-\d{2}-\d{4}\b",
                 "action": "redact", "replacement": "[redacted]", "lookBehind": 64},
                {"name": "words", "type": "blocklist", "terms": ["secret plan", "codeword"],
                 "caseSensitive": False, "wholeWords": True, "action": "stop"},
                {"name": "pii-out", "type": "pii", "action": "flag"}],
            "policies": {
                "default": {"models": ["SmolLM2-135M-Instruct"], "maxContext": 4096,
                            "maxTokens": 512, "guardrails": ["no-injection", "size"]},
                "tenants": {"acme_corp.eu": {"maxTokens": 1024, "adapters": ["sql"]}}},
            "audit": {"includeMatch": False, "logPasses": True}}},
    },
    "hf-gguf": {
        "model": {"uri": "hf://bartowski/Meta-Llama-3.1-8B-Instruct-GGUF@main/"
                         "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
                  "hfTokenSecretRef": {"name": "hf-token"}, "storage": "20Gi"},
        "decode": {"replicas": 2, "resources": {"requests": {"ephemeral-storage": "30Gi"}}},
    },
}


def spec(name: str) -> dict[str, Any]:
    return copy.deepcopy(SPECS[name])


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def resource(spec_: dict[str, Any], name: str = "demo") -> dict[str, Any]:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ml"}, "spec": spec_}


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: top-down, a defaulted `{}` gets its
    own properties' defaults in turn."""
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(node["items"], v) for v in value]
    return value


def unknown_fields(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the structural schema does not declare (the API server would prune them)."""
    if node.get("x-kubernetes-preserve-unknown-fields") or not isinstance(value, dict):
        if isinstance(value, list) and isinstance(node.get("items"), dict):
            return [u for i, v in enumerate(value)
                    for u in unknown_fields(node["items"], v, f"{path}[{i}]")]
        return []
    props = node.get("properties")
    extra = node.get("additionalProperties")
    out = []
    for key, sub_value in value.items():
        if props is not None and key in props:
            out += unknown_fields(props[key], sub_value, f"{path}.{key}")
        elif isinstance(extra, dict):
            out += unknown_fields(extra, sub_value, f"{path}.{key}")
        elif props is not None and path != ".metadata":
            out.append(f"{path}.{key}")
    return out
