"""Rendered content: probes, drain timing and hardening of every pod, the model and TLS
mounts, GPU resources, the router's config and RBAC, flags that the real `tandem worker` /
`tandem router` parsers accept, the config hash (replicas vs model/engine changes), and
autoscaling (operator mode clamps, HPA mode leaves replicas to the HPA)."""

from __future__ import annotations

import argparse

import pytest
import yaml

from tandem.operator.render import render_all
from tandem.operator.render.common import CONFIG_HASH
from tandem.operator.spec import parse_spec
from tandem.protocol.labels import ROUTER_GROUP_LABEL
from tests.operator.manifests import OWNER, arg, by_kind, container, one, render
from tests.operator.samples import SHA, SPECS, spec


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pods_probes_drain_and_hardening(name):
    raw = parse_spec(spec(name))
    for d in by_kind(render(name), "Deployment"):
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        for cc in [c, *pod.get("initContainers", [])]:
            sc = cc["securityContext"]
            assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                          "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
            mounted = {m["mountPath"] for m in cc["volumeMounts"]}
            assert {"/tmp", "/cache"} <= mounted  # writable scratch on a read-only root
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        # the router's /metrics is on its own port (no API key there), a worker's on http
        assert annotations["prometheus.io/port"] == (
            "9090" if d["metadata"]["name"] == "demo-router" else "8000")
        assert len(annotations[CONFIG_HASH]) == 16
        if d["metadata"]["name"] == "demo-router":
            assert pod["serviceAccountName"] == "demo-router"
            continue
        assert pod["automountServiceAccountToken"] is False  # workers never call the API
        drain = int(arg(c["args"], "--drain-timeout"))
        pool = raw.decode if "decode" in d["metadata"]["name"] or not raw.disaggregated \
            else raw.prefill
        assert drain == pool.engine.drain_timeout_seconds
        assert pod["terminationGracePeriodSeconds"] >= (
            drain + c["lifecycle"]["preStop"]["sleep"]["seconds"] + 5)
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"  # digest mismatch


def test_model_volume_is_read_only_and_digest_is_passed():
    docs = render("disaggregated")
    for name in ("demo-prefill", "demo-decode"):
        d = one(docs, "Deployment", name)
        pod = d["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        (mount,) = [m for m in container(d)["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        args = container(d)["args"]
        assert arg(args, "--model") == "/models/llama/llama-3-8b.Q8_0.gguf"
        assert arg(args, "--model-sha256") == SHA
        assert arg(args, "--served-model-name") == "llama-3-8b"
    router_cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"][
        "router.yaml"])  # the router reads the tokenizer its init container took from the claim
    assert router_cfg["tokenizers"] == {"llama-3-8b": "/tokenizer"}
    router = one(docs, "Deployment", "demo-router")["spec"]["template"]["spec"]
    (init,) = router["initContainers"]
    assert init["command"][3:] == ["tokenizer", "--local", "/models/llama/llama-3-8b.Q8_0.gguf",
                                   "--dest", "/tokenizer"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in init["volumeMounts"]
    assert all(m["name"] != "model" for m in container(
        one(docs, "Deployment", "demo-router"))["volumeMounts"])  # weights stay out of it


def test_hf_model_is_fetched_by_an_init_container_then_mounted_read_only():
    d = one(render("tls"), "Deployment", "demo-decode")
    pod = d["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "-m", "tandem.operator.fetch", "model",
                               "--repo", "HuggingFaceTB/SmolLM2-135M-Instruct",
                               "--revision", "main", "--path", "", "--dest", "/models"]
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(d)[
        "volumeMounts"]
    assert arg(container(d)["args"], "--served-model-name") == "SmolLM2-135M-Instruct"


def test_tls_secret_is_mounted_for_grpc_tls_dir_and_torch_backend_advertises_pod_ip():
    docs = render("tls")
    for name in ("demo-prefill", "demo-decode", "demo-router"):  # the router: KV events
        d = one(docs, "Deployment", name)
        c = container(d)
        tls_dir = arg(c["args"], "--grpc-tls-dir")
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "grpc-tls"]
        assert mount == {"name": "grpc-tls", "mountPath": tls_dir, "readOnly": True}
        (vol,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "grpc-tls"]
        assert vol["secret"]["secretName"] == "tandem-kv-tls"
    decode = container(one(docs, "Deployment", "demo-decode"))["args"]
    assert arg(decode, "--kv-transfer-backend") == "torch"
    assert arg(decode, "--kv-transfer-policy") == "fail"
    assert arg(decode, "--kv-transfer-timeout") == "12.5"
    assert arg(decode, "--kv-transfer-host") == "$(POD_IP)"
    prefill = container(one(docs, "Deployment", "demo-prefill"))["args"]
    assert "--kv-transfer-backend" not in prefill
    # streamLayers: the prefill side sends layer by layer; decode workers serve no Prefill
    assert "--kv-stream-layers" in prefill and "--kv-stream-layers" not in decode
    for name in ("demo-decode", "demo-router"):
        no_tls = container(one(render("disaggregated"), "Deployment", name))
        assert "--grpc-tls-dir" not in no_tls["args"]
    assert "--kv-stream-layers" not in container(one(render("disaggregated"), "Deployment",
                                                     "demo-prefill"))["args"]


def test_gpu_resources_node_selector_and_tolerations_pass_through():
    docs = render("gpu")
    prefill = one(docs, "Deployment", "demo-prefill")
    c = container(prefill)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1  # requests equal limits
    assert c["image"] == "registry.example/tandem:dev"
    pod = prefill["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert arg(c["args"], "--num-threads") == "8"  # the CPU limit, not every host core
    decode = container(one(docs, "Deployment", "demo-decode"))["args"]
    assert arg(decode, "--num-threads") == "4"  # 3500m rounded up
    assert arg(decode, "--kv-cache-memory") == str(60 << 30)
    assert arg(decode, "--dtype") == "bfloat16"
    assert arg(decode, "--model") == "/opt/models/qwen2-7b"
    assert "--no-prefix-caching" in decode
    assert not any(v["name"] == "model" for v in pod["volumes"])  # file:// is in the image
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"},
                                       {"port": "metrics", "path": "/metrics",
                                        "interval": "15s"}]


def test_router_deployment_config_and_least_privilege_rbac():
    docs = render("disaggregated")
    d = one(docs, "Deployment", "demo-router")
    args = container(d)["args"]
    assert args[:1] == ["router"]
    assert arg(args, "--discovery") == "kubernetes"
    # its router group: its own workers' Services and those of InferenceServices attached
    assert arg(args, "--label-selector") == ("app.kubernetes.io/component=worker,"
                                             "tandem.dev/router-group=demo")
    assert "--inference-service" not in args
    assert arg(args, "--worker-port-name") == "http"
    assert arg(args, "--api-keys") == "/etc/tandem/auth/api-keys"
    assert arg(args, "--admin-api-keys") == "/etc/tandem/admin-auth/admin-api-keys"
    admin = next(v for v in d["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == "admin-api-keys")
    assert admin["secret"]["secretName"] == "tandem-admin-keys"
    assert admin["secret"]["items"] == [{"key": "admin-api-keys", "path": "admin-api-keys"}]
    assert d["spec"]["replicas"] == 2
    assert one(docs, "Service", "demo-router")["spec"]["type"] == "LoadBalancer"
    cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
    assert cfg["pd_threshold"] == 64 and cfg["pd_max_prefill_queue"] == 3
    assert cfg["pd_max_local_prefill"] == 2048
    assert cfg["pd_decision"] == "cost" and cfg["pd_itl_weight"] == 0.5
    assert cfg["pd_stall_budget"] == 0.01
    assert cfg["weights"] == {"prefix": 3.0, "queue": 1.0, "kv_usage": 0.5,
                              "inflight_tokens": 0.5, "cache_churn": 1.0, "lora_affinity": 1.0,
                              "cost": 0.0, "session_affinity": 1.0}
    assert cfg["rate_limits"]["default"] == {"requests_per_s": 10.0, "burst_requests": 20.0,
                                             "tokens_per_min": 0.0}
    assert cfg["index"] == cfg["redis"] == "env:TANDEM_REDIS_URL"  # from the URL Secret
    role = one(docs, "Role", "demo-router")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    binding = one(docs, "RoleBinding", "demo-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router",
                                    "namespace": "ml"}]
    assert not by_kind(docs, "ClusterRole")


def test_rendered_router_config_and_flags_are_accepted_by_the_router(tmp_path, monkeypatch):
    """The real `tandem router` parser and config loader take what the operator renders (the
    Redis URL from the env var the Secret fills, the worker-auth key file)."""
    from tandem.router.main import add_router_args, build

    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://:s3cret@127.0.0.1:1/0")
    (tmp_path / "key").write_bytes(b"k" * 32)
    docs = render("disaggregated")
    (tmp_path / "router.yaml").write_text(
        one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
    (tmp_path / "keys").write_text("sk-test alice\n")
    (tmp_path / "admins").write_text("sk-admin ops\n")
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = container(one(docs, "Deployment", "demo-router"))["args"][1:]
    args = [str(tmp_path / "router.yaml") if a.endswith("router.yaml") else
            str(tmp_path / "keys") if a.endswith("/api-keys") else
            str(tmp_path / "admins") if a.endswith("/admin-api-keys") else
            str(tmp_path / "key") if a.endswith("/worker-auth/key") else
            "ml" if a == "$(POD_NAMESPACE)" else a for a in args]
    parsed = p.parse_args(args)
    _, router, server = build(parsed)
    assert router.settings.pd_threshold == 64
    assert router.settings.pd_max_prefill_queue == 3
    assert router.settings.pd_max_local_prefill == 2048
    assert (router.settings.pd_decision, router.settings.pd_itl_weight) == ("cost", 0.5)
    assert router.settings.pd_stall_budget == 0.01
    assert server.discovery.name == "kubernetes"
    assert server.admin_keys is not None and server.admin_keys.tenant("Bearer sk-admin") == "ops"
    assert server.discovery.label_selector.endswith(f"{ROUTER_GROUP_LABEL}=demo")
    assert server.rate_limiter is not None
    assert server.rate_limiter.shared  # the Redis URL reached it, through the env var
    assert server.rate_limiter._redis.connection_pool.connection_kwargs["password"] == "s3cret"


def worker_parser() -> argparse.ArgumentParser:
    """`tandem worker`'s own argument parser."""
    from tandem.serving.worker import add_engine_args, add_server_args

    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    add_server_args(p)
    return p


@pytest.mark.parametrize("name", sorted(SPECS))
def test_worker_flags_are_accepted_by_tandem_worker(name):
    from tandem.serving.worker import engine_config

    p = worker_parser()
    for d in by_kind(render(name), "Deployment"):
        args = container(d)["args"]
        if args[0] != "worker":
            continue
        parsed = p.parse_args(args[1:])
        engine_config(parsed, serving=True)  # the engine's own validation


def test_engine_fields_reach_each_pools_engine():
    from tandem.serving.worker import PREFILL_ROLE_CHUNK_CAP, engine_config

    def configs(raw: dict) -> dict:
        p = worker_parser()
        return {d["metadata"]["name"]: engine_config(p.parse_args(container(d)["args"][1:]),
                                                     serving=True)
                for d in by_kind(render(raw), "Deployment") if container(d)["args"][0] == "worker"}

    got = configs(spec("disaggregated"))
    assert got["demo-prefill"].max_num_batched_tokens == 8192
    assert got["demo-prefill"].long_prefill_token_threshold == 1024
    assert got["demo-decode"].long_prefill_token_threshold == 0  # the decode role's default
    assert got["demo-decode"].max_num_seqs == 256
    plain = spec("disaggregated")
    del plain["prefill"]["engine"]["longPrefillTokenThreshold"]
    from tandem.engine.devices import device_type

    default = PREFILL_ROLE_CHUNK_CAP if device_type("auto") == "cpu" else 0
    assert configs(plain)["demo-prefill"].long_prefill_token_threshold == default


def test_replicas_change_keeps_the_pod_template_while_model_or_engine_change_rolls_it():
    def templates(raw: dict) -> dict[str, dict]:
        return {d["metadata"]["name"]: d["spec"]["template"] for d in
                by_kind(render(raw), "Deployment")}

    base = spec("disaggregated")
    scaled = spec("disaggregated")
    scaled["decode"]["replicas"] = 7
    scaled["prefill"]["replicas"] = 5
    scaled["router"]["replicas"] = 3
    assert templates(scaled) == templates(base)  # a replicas change patches only the count
    new_model = spec("disaggregated")
    new_model["model"]["sha256"] = "f" * 64
    engine = spec("disaggregated")
    engine["decode"]["engine"]["maxNumSeqs"] = 64
    for changed, rolled in ((new_model, {"demo-prefill", "demo-decode"}),
                            (engine, {"demo-decode"})):
        before, after = templates(base), templates(changed)
        differ = {n for n in before
                  if before[n]["metadata"]["annotations"][CONFIG_HASH]
                  != after[n]["metadata"]["annotations"][CONFIG_HASH]}
        assert differ == rolled
    router = spec("disaggregated")
    router["router"]["pdThreshold"] = 8  # router.yaml changes: the routers roll
    assert (templates(router)["demo-router"]["metadata"]["annotations"][CONFIG_HASH]
            != templates(base)["demo-router"]["metadata"]["annotations"][CONFIG_HASH])


def test_autoscaling_operator_mode_clamps_and_hpa_mode_leaves_replicas_to_the_hpa():
    docs = render("autoscaling")
    decode = one(docs, "Deployment", "demo-decode")
    assert decode["spec"]["replicas"] == 2
    assert "replicas" not in one(docs, "Deployment", "demo-prefill")["spec"]
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["metadata"]["name"] == "demo-prefill"
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 4
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_prompt_tokens_per_second"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "2000"}
    # an autoscaler's decision (by pool name) is rendered, within min/max
    scaled = render("autoscaling", replicas={"decode": 50})
    assert one(scaled, "Deployment", "demo-decode")["spec"]["replicas"] == 10
    scaled = render("autoscaling", replicas={"decode": 5})
    assert one(scaled, "Deployment", "demo-decode")["spec"]["replicas"] == 5
    kv = render("tls")
    (hpa,) = by_kind(kv, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "800m"


def test_rendering_is_pure_and_outputs_share_no_objects():
    parsed = parse_spec(spec("gpu"))
    a = render_all(parsed, OWNER)
    b = render_all(parsed, OWNER)
    assert a == b
    container(by_kind(a, "Deployment")[1])["resources"]["limits"]["cpu"] = "1"
    by_kind(a, "Deployment")[1]["metadata"]["labels"]["x"] = "y"
    assert render_all(parsed, OWNER) == b  # mutating one rendering leaks nowhere
    assert "x" not in by_kind(a, "Deployment")[1]["spec"]["template"]["metadata"]["labels"]


def test_image_and_pull_policy_from_the_operators_environment():
    from tandem.operator.render import DEFAULT_IMAGE, image_from_env

    assert image_from_env({}) == (DEFAULT_IMAGE, None)
    image, policy = image_from_env({"TANDEM_IMAGE": "reg/tandem:1", "TANDEM_IMAGE_PULL_POLICY":
                                    "Always"})
    docs = render_all(parse_spec(spec("tls")), OWNER, image=image, image_pull_policy=policy)
    pods = [d["spec"]["template"]["spec"] for d in by_kind(docs, "Deployment")]
    containers = [c for p in pods for c in p["containers"] + p.get("initContainers", [])]
    assert len(containers) == 6  # router (+ tokenizer), prefill (+ fetch), decode (+ fetch)
    assert {(c["image"], c["imagePullPolicy"]) for c in containers} == {("reg/tandem:1", "Always")}
    gpu = render("gpu")  # spec.image wins over the operator's default
    assert {container(d)["image"] for d in by_kind(gpu, "Deployment")} == {
        "registry.example/tandem:dev"}
