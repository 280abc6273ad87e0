"""Model delivery and pod settings in the rendered manifests: the router gets the model's
tokenizer for every source the CRD accepts (and the real router loads what its init
container writes); hf:// downloads are sized, authenticated from a Secret and optionally
shared through a cache PVC; per-pool and router pod settings reach the pods, cannot
override what the operator owns, and every result is a valid Kubernetes object."""

from __future__ import annotations

import argparse
import copy
import random

import kubernetes_validate
import pytest
import yaml

from tandem.operator import fetch
from tandem.operator.model_uri import parse_model_uri
from tandem.operator.render import render_all
from tandem.operator.render.model import TOKENIZER_DIR, cache_key
from tandem.operator.spec import SpecError, parse_spec
from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf
from tandem.protocol.labels import COMPONENT_LABEL, ROLE_LABEL, SERVICE_LABEL
from tests.operator.manifests import K8S, OWNER, by_kind, container, one, render, set_path
from tests.operator.samples import SPECS, resource, spec
from tests.operator.test_crd import _errors, failed_rules

# (uri, tokenizer init command after `fetch tokenizer`, which image: router or worker)
SOURCES = [
    ("SmolLM2-135M-Instruct", ["--bundled"], "worker"),
    ("pvc://models/llama/llama-3-8b.Q8_0.gguf", ["--local", "/models/llama/llama-3-8b.Q8_0.gguf"],
     "router"),
    ("pvc://models", ["--local", "/models"], "router"),
    ("hf://Qwen/Qwen2.5-7B-Instruct", ["--repo", "Qwen/Qwen2.5-7B-Instruct", "--revision", "",
                                       "--path", ""], "router"),
    ("hf://org/repo-GGUF@v2/model.Q4_K_M.gguf", ["--repo", "org/repo-GGUF", "--revision", "v2",
                                                 "--path", "model.Q4_K_M.gguf"], "router"),
    ("file:///opt/models/qwen2-7b", ["--local", "/opt/models/qwen2-7b"], "worker"),
    ("file:///opt/models/m.gguf", ["--local", "/opt/models/m.gguf"], "worker"),
]


def _router(docs: list[dict]) -> tuple[dict, dict]:
    d = one(docs, "Deployment", "demo-router")
    cfg = yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])
    return d, cfg


@pytest.mark.parametrize(("uri", "command", "image"), SOURCES, ids=[s[0] for s in SOURCES])
def test_the_router_gets_the_models_tokenizer_for_every_source(uri, command, image):
    raw = {"model": {"uri": uri}, "decode": {"image": "reg/worker:1"},
           "router": {"image": "reg/control:1"}}
    docs = render(raw)
    d, cfg = _router(docs)
    names = parse_spec(raw).model.served_names  # (hf://: the Hub id too)
    assert cfg["tokenizers"] == dict.fromkeys(names, TOKENIZER_DIR)
    pod = d["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "-m", "tandem.operator.fetch", "tokenizer", *command,
                               "--dest", TOKENIZER_DIR]
    assert init["image"] == {"router": "reg/control:1", "worker": "reg/worker:1"}[image]
    assert {"name": "tokenizer", "mountPath": TOKENIZER_DIR} in init["volumeMounts"]
    assert {"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True} in container(d)[
        "volumeMounts"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "tokenizer"]
    assert vol == {"name": "tokenizer", "emptyDir": {"sizeLimit": "2Gi"}}
    assert container(d)["image"] == "reg/control:1"
    for doc in by_kind(docs, "Deployment"):
        kubernetes_validate.validate(doc, K8S, strict=True)
    assert _errors(resource(raw)) == [] and failed_rules(resource(raw)) == []


def test_the_router_loads_what_its_init_container_writes(tmp_path):
    """The bundled model with a custom served name (once approximate): the init container's
    command, run here, writes a directory the real router resolves for that name."""
    from tandem.router.main import add_router_args, build

    if find_bundled_gguf() is None:
        pytest.skip("the bundled model is not installed")
    docs = render({"model": {"uri": BUNDLED_NAME, "name": "chat"}})
    d, cfg = _router(docs)
    (init,) = d["spec"]["template"]["spec"]["initContainers"]
    argv = [str(tmp_path / "tok") if a == TOKENIZER_DIR else a for a in init["command"][3:]]
    assert fetch.main(argv) == 0
    cfg["tokenizers"] = {"chat": str(tmp_path / "tok")}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(cfg))
    p = argparse.ArgumentParser()
    add_router_args(p)
    _, router, _ = build(p.parse_args(["--workers", "http://127.0.0.1:1",
                                       "--config", str(tmp_path / "router.yaml")]))
    tok = router.tokenizer_for("chat")
    assert tok is not None and tok.encode("Hello") == router.tokenizer_for(BUNDLED_NAME).encode(
        "Hello")


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def test_hf_download_is_sized_and_authenticated_from_a_secret():
    docs = render("hf-gguf")
    d = one(docs, "Deployment", "demo-worker")
    pod = d["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert _env(init)["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf-token", "key": "token"}}}
    rendered = yaml.safe_dump(docs)
    assert "HF_TOKEN" not in " ".join(init["command"])
    assert all("hf-token" not in c["data"]["router.yaml"] for c in by_kind(docs, "ConfigMap"))
    assert rendered.count("secretKeyRef") == 2  # the worker's fetch and the router's
    (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert vol == {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}}
    # the pool set its own ephemeral-storage request: kept, nothing added
    assert container(d)["resources"] == {"requests": {"ephemeral-storage": "30Gi"}}
    router_init = one(docs, "Deployment", "demo-router")["spec"]["template"]["spec"][
        "initContainers"][0]
    assert _env(router_init)["HF_TOKEN"] == _env(init)["HF_TOKEN"]
    raw = spec("hf-gguf")
    del raw["decode"]["resources"]
    c = container(one(render(raw), "Deployment", "demo-worker"))
    assert c["resources"] == {"requests": {"ephemeral-storage": "20Gi"},
                              "limits": {"ephemeral-storage": f"{20 * 1024 + 4096}Mi"}}
    raw["model"].pop("storage")  # unset: the default size
    pod = one(render(raw), "Deployment", "demo-worker")["spec"]["template"]["spec"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "50Gi"}} in pod["volumes"]


def test_hf_shared_cache_pvc_is_filled_by_init_and_mounted_read_only_by_subpath():
    docs = render("pods")
    src = parse_model_uri(spec("pods")["model"]["uri"])
    key = cache_key(src)
    assert key == "hf--meta-llama--Llama-3.1-8B-Instruct--0e9e39f249a16976918f6564b8830bc894c89659"
    for name in ("demo-prefill", "demo-decode"):
        d = one(docs, "Deployment", name)
        pod = d["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert vol == {"name": "model", "persistentVolumeClaim": {"claimName": "model-cache"}}
        (init,) = pod["initContainers"]
        assert init["command"][3:] == ["model", "--repo", src.repo, "--revision", src.revision,
                                       "--path", "", "--dest", f"/model-cache/{key}",
                                       "--shared"]
        assert {"name": "model", "mountPath": "/model-cache"} in init["volumeMounts"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True,
                "subPath": key} in container(d)["volumeMounts"]
        assert "ephemeral-storage" not in str(container(d).get("resources"))
    # a file of the repository gets its own key: a whole-repo entry never stands in for it
    assert cache_key(parse_model_uri("hf://a/b/x.gguf")) != cache_key(parse_model_uri("hf://a/b"))


def test_pod_settings_reach_every_pool_and_the_router():
    docs = render_all(parse_spec(spec("pods")), OWNER, image="tandem:test",
                      image_pull_secrets=("operator-pull",))
    router = one(docs, "Deployment", "demo-router")
    prefill = one(docs, "Deployment", "demo-prefill")
    decode = one(docs, "Deployment", "demo-decode")
    rp, pp, dp = (d["spec"]["template"]["spec"] for d in (router, prefill, decode))
    assert container(router)["image"] == "registry.example/tandem-control:1"
    assert container(prefill)["image"] == "tandem:test"
    assert {c["image"] for c in [*dp["containers"], *dp["initContainers"]]} == {
        "registry.example/tandem:cu128"}
    assert rp["nodeSelector"] == {"node-pool": "cpu"}
    assert rp["tolerations"][0]["key"] == "dedicated"
    assert rp["priorityClassName"] == "serving-critical"
    assert rp["topologySpreadConstraints"] == [{
        "labelSelector": {"matchLabels": router["spec"]["selector"]["matchLabels"]},
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway"}]
    assert router["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert pp["runtimeClassName"] == "nvidia"
    for c in [*pp["containers"], *pp["initContainers"]]:  # the fetch gets the proxy too
        assert _env(c)["HTTPS_PROXY"]["value"] == "http://proxy.internal:3128"
        assert c["envFrom"] == [{"configMapRef": {"name": "tandem-extra-env"}}]
    assert dp["affinity"]["podAntiAffinity"]
    assert rp["imagePullSecrets"] == pp["imagePullSecrets"] == [{"name": "operator-pull"}]
    assert dp["imagePullSecrets"] == [{"name": "operator-pull"}, {"name": "regcred"}]
    assert {"name": "nccl-conf", "configMap": {"name": "nccl"}} in dp["volumes"]
    assert container(decode)["volumeMounts"][-1] == {"name": "nccl-conf",
                                                     "mountPath": "/etc/nccl", "readOnly": True}
    assert all(m["name"] != "nccl-conf" for m in dp["initContainers"][0]["volumeMounts"])
    assert decode["spec"]["template"]["metadata"]["annotations"][
        "cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert _env(container(decode))["TEAM_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "team"
    strategies = {d["metadata"]["name"]: d["spec"]["strategy"]["rollingUpdate"]
                  for d in (router, prefill, decode)}
    assert strategies == {"demo-router": {"maxSurge": "25%", "maxUnavailable": 0},
                          "demo-prefill": {"maxSurge": 0, "maxUnavailable": 1},
                          "demo-decode": {"maxSurge": 0, "maxUnavailable": "50%"}}
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, K8S, strict=True)


@pytest.mark.parametrize("name", sorted(set(SPECS) - {"pods"}))
def test_default_strategy_surges_one_on_cpu_and_replaces_one_at_a_time_on_gpus(name):
    for d in by_kind(render(name), "Deployment"):
        limits = container(d).get("resources", {}).get("limits", {})
        want = ({"maxSurge": 0, "maxUnavailable": 1} if "nvidia.com/gpu" in limits
                else {"maxSurge": 1, "maxUnavailable": 0})
        assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": want}
        assert "imagePullSecrets" not in d["spec"]["template"]["spec"]


REFUSED = [  # (spec field, value, message): what the operator owns cannot be overridden
    ("decode.env", [{"name": "HF_HOME", "value": "/x"}], "decode.env[0].name: 'HF_HOME' is an env"),
    ("decode.env", [{"name": "POD_IP", "value": "1.2.3.4"}], "decode.env[0].name: 'POD_IP'"),
    ("router.env", [{"name": "TANDEM_CACHE_DIR", "value": "/x"}], "router.env[0].name"),
    ("decode.volumes", [{"name": "cache", "emptyDir": {}}], "decode.volumes[0].name: 'cache'"),
    ("router.volumes", [{"name": "tokenizer", "emptyDir": {}}], "router.volumes[0].name"),
    ("decode.podLabels", {COMPONENT_LABEL: "router"}, "decode.podLabels: 'app.kubernetes.io/comp"),
    ("decode.podLabels", {"app.kubernetes.io/instance": "other"}, "is a label the operator"),
    ("router.podAnnotations", {"prometheus.io/port": "9"}, "router.podAnnotations"),
]



@pytest.mark.parametrize(("path", "value", "message"), REFUSED, ids=[r[2] for r in REFUSED])
def test_user_settings_cannot_override_what_the_operator_owns(path, value, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        render(set_path(spec("aggregated"), path, value))


@pytest.mark.parametrize("mount", ["/models", "/tmp", "/tmp/x", "/etc/tandem", "/etc"])
def test_user_mounts_cannot_shadow_or_nest_in_the_operators(mount):
    raw = set_path(spec("disaggregated"), "decode.volumes", [{"name": "x", "emptyDir": {}}])
    raw["decode"]["volumeMounts"] = [{"name": "x", "mountPath": mount}]
    with pytest.raises(SpecError, match=r"decode.volumeMounts\[0\].mountPath"):
        render(raw)


SPEC_ERRORS = [  # (spec field, value, message; CEL/schema reject them too: tested below)
    ("decode.strategy", {"maxSurge": 0, "maxUnavailable": 0}, "cannot both be 0"),
    ("decode.strategy", {"maxSurge": "0%", "maxUnavailable": 0}, "cannot both be 0"),
    ("router.strategy", {"maxSurge": "lots"}, "router.strategy.maxSurge"),
    ("decode.env", [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {}}}],
     "exclusive"),
    ("decode.envFrom", [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}],
     r"decode.envFrom\[0\]"),
    ("decode.volumeMounts", [{"name": "nope", "mountPath": "/x"}], "is not one of decode.volumes"),
    ("decode.affinity", {"nodeAffinty": {}}, "decode.affinity: only"),
    ("prefill.topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "zone"}],
     "whenUnsatisfiable"),
    ("decode.podLabels", {"tandem.dev/role": "prefill"}, "keys under tandem.dev/"),
    ("model.storage", "20Gi", "hf:// models only"),
    ("model.cache", {"pvc": "c"}, "hf:// models only"),
]


@pytest.mark.parametrize(("path", "value", "message"), SPEC_ERRORS,
                         ids=[f"{e[0]}:{e[2]}" for e in SPEC_ERRORS])
def test_bad_pod_and_model_settings_are_spec_errors_and_the_crd_refuses_them(path, value,
                                                                            message):
    raw = set_path(spec("aggregated"), path, value)
    with pytest.raises(SpecError, match=message):
        parse_spec(raw)
    assert _errors(resource(raw)) or failed_rules(resource(raw)), "the CRD lets it through"


def test_hf_storage_and_cache_are_exclusive_everywhere():
    raw = spec("hf-gguf")
    raw["model"]["cache"] = {"pvc": "c"}
    with pytest.raises(SpecError, match="with model.cache"):
        parse_spec(raw)
    assert any("model.cache" in m for m in failed_rules(resource(raw)))


def test_random_pod_settings_render_valid_pods_with_the_operators_selectors_intact():
    """Random env / labels / annotations / volumes: each spec is either a SpecError or
    renders pods that pass strict validation, keep every selector label and contain each
    user setting once."""
    rng = random.Random(20)
    pool = ["A", "HF_HOME", "POD_IP", "LOG", "team", "model", "cache", "data",
            SERVICE_LABEL, ROLE_LABEL, "app.kubernetes.io/part-of", "example.com/x"]
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(60):
        raw = spec("disaggregated")
        pick = lambda n: rng.sample(pool, rng.randint(0, n))  # noqa: E731
        raw["decode"]["env"] = [{"name": n.replace("/", "_").replace(".", "_"), "value": "v"}
                                for n in pick(3)]
        raw["decode"]["podLabels"] = {k: "v" for k in pick(2)}
        raw["decode"]["volumes"] = [{"name": n, "emptyDir": {}} for n in pick(2)
                                    if n.isalpha() and n.islower()]
        try:
            docs = render(copy.deepcopy(raw))
        except SpecError:
            outcomes["refused"] += 1
            continue
        outcomes["ok"] += 1
        d = one(docs, "Deployment", "demo-decode")
        kubernetes_validate.validate(d, K8S, strict=True)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert {k: labels[k] for k in d["spec"]["selector"]["matchLabels"]} == (
            d["spec"]["selector"]["matchLabels"])
        names = [e["name"] for e in container(d)["env"]]
        assert len(names) == len(set(names))
        vols = [v["name"] for v in d["spec"]["template"]["spec"]["volumes"]]
        assert len(vols) == len(set(vols))
    assert outcomes["ok"] > 5 and outcomes["refused"] > 5, outcomes
