"""InferenceService `spec.lora` (multi-LoRA adapters): the operator's parser accepts and refuses
what the engine and the CRD (schema + CEL) do, with messages naming the field; every pool's
workers get `--enable-lora ... --lora-modules NAME=PATH ... --lora-dir /adapters` (read back
by the worker's own parser); adapters are mounted read-only, fetched and sha256-checked by
one init container (run here, against local files); renders are valid and deterministic."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.lora.request import MAX_NAME_LEN as ENGINE_MAX_NAME_LEN
from tandem.engine.lora.request import check_name
from tandem.operator import fetch
from tandem.operator.render.common import config_hash
from tandem.operator.render.lora import adapter_dir
from tandem.operator.render.workers import Pool, pool_config_hash, pools
from tandem.operator.spec import SpecError, parse_spec
from tandem.operator.spec_lora import (
    MAX_ADAPTERS,
    MAX_NAME_LEN,
    MAX_RANK,
    MAX_SLOTS,
    AdapterSpec,
    LoRASpec,
    check_adapter_name,
)
from tandem.operator.spec_security import SecretKeyRef
from tests.operator.manifests import K8S, arg, by_kind, container, one, render, set_path
from tests.operator.samples import SHA, resource, schema, spec
from tests.operator.test_crd import _errors, failed_rules
from tests.operator.test_spec_quant import worker_configs

ROOT = Path(__file__).resolve().parents[2]
MODULES = {"sql": "/adapters/0-sql", "Acme/support:v2": "/adapters/1-acme-support-v2",
           "chat-es": "/adapters/2-chat-es", "summarize": "/adapters/3-summarize/summarize",
           "tone": "/opt/adapters/tone"}


def with_lora(lora: dict, name: str = "aggregated") -> dict:
    return set_path(spec(name), "lora", lora)


def _node() -> dict:
    return schema()["properties"]["spec"]["properties"]["lora"]


def pod(d: dict) -> dict:
    return d["spec"]["template"]["spec"]


def workers(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")
            if container(d)["args"][0] == "worker"}


# ---- the spec ------------------------------------------------------------------------------

def test_bounds_and_defaults_are_the_engines_and_the_crds():
    props = _node()["properties"]
    assert MAX_NAME_LEN == ENGINE_MAX_NAME_LEN
    assert props["adapters"]["items"]["properties"]["name"]["maxLength"] == MAX_NAME_LEN
    assert props["adapters"]["maxItems"] == MAX_ADAPTERS
    assert props["maxLoraRank"]["maximum"] == MAX_RANK
    assert props["maxLoras"]["maximum"] == props["maxCpuLoras"]["maximum"] == MAX_SLOTS
    engine, ours = EngineConfig(), LoRASpec()
    assert (props["maxLoras"]["default"], props["maxLoraRank"]["default"]) == (
        ours.max_loras, ours.max_lora_rank) == (engine.max_loras, engine.max_lora_rank)
    EngineConfig(enable_lora=True, max_loras=MAX_SLOTS, max_cpu_loras=MAX_SLOTS,
                 max_lora_rank=MAX_RANK)  # the engine takes the CRD's largest values


def test_the_sample_parses_to_typed_adapters():
    lora = parse_spec(spec("lora")).lora
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.storage) == (
        2, 64, 4, "2Gi")
    assert lora.hf_token == SecretKeyRef("hf-token", "token")
    assert [(a.name, a.source.kind, a.sha256) for a in lora.adapters] == [
        ("sql", "pvc", None), ("Acme/support:v2", "pvc", SHA), ("chat-es", "hf", SHA[::-1]),
        ("summarize", "hf", None), ("tone", "file", None)]
    hf = lora.adapters[3].source
    assert (hf.repo, hf.revision, hf.path) == ("org/adapters", "", "summarize")
    assert isinstance(lora.adapters[0], AdapterSpec) and lora.fetched
    assert parse_spec(with_lora({})).lora == LoRASpec()  # LoRA on, adapters loaded later
    assert parse_spec(spec("aggregated")).lora is None


NAMES = ["sql", "Acme/support:v2", "a" * 128, "日本語", "x.y_z@1", "sql-lora/v1.2"]
BAD_NAMES = ["", "a" * 129, "has space", "tab\tx", "nbsp\u00a0x", "zw\u200bx", "bell\x07",
             "a=b", "-x", None, 7]


def test_names_are_the_engines_less_what_name_eq_path_cannot_carry():
    for name in NAMES:
        assert check_adapter_name(name, "n") == check_name(name)
    for name in BAD_NAMES:
        with pytest.raises(SpecError):
            check_adapter_name(name, "n")
        engine_ok = True
        try:
            check_name(name)
        except ValueError:
            engine_ok = False
        assert engine_ok == (name in ("a=b", "-x")), name  # the worker's flag syntax only


W = "lora"
A0 = f"{W}.adapters[0]"
PVC = "pvc://adapters/a"


def _one(**adapter) -> dict:
    return {"adapters": [{"name": "a", "uri": PVC, **adapter}]}


# (spec.lora, the parser's message, what the CRD says: (validator, path) of the schema (a list
# for several), a CEL rule's message, or None where only the parser refuses it: the API server
# prunes unknown keys, refuses duplicate names as list-map keys, and its RE2 `\s` is ASCII
# whitespace, so the pattern leaves Unicode spaces and unprintables to the parser)
ERRORS = [
    ({"maxLoras": 0}, f"{W}.maxLoras: 0 is not in [1, 4096]", ("minimum", "spec.lora.maxLoras")),
    ({"maxLoras": "2"}, f"{W}.maxLoras: expected int, got '2'", ("type", "spec.lora.maxLoras")),
    ({"maxLoraRank": 513}, f"{W}.maxLoraRank: 513 is not in [1, 512]",
     ("maximum", "spec.lora.maxLoraRank")),
    ({"maxLoras": 4, "maxCpuLoras": 2}, f"{W}.maxCpuLoras 2 is below maxLoras 4",
     "lora.maxCpuLoras must be at least lora.maxLoras"),
    ({"maxLora": 2}, f"{W}: unknown keys ['maxLora']", None),  # the API server prunes it
    ({"adapters": {"a": PVC}}, f"{W}.adapters: expected list", ("type", "spec.lora.adapters")),
    ({"adapters": [{"name": "a", "uri": f"pvc://c/{i}"} for i in range(65)]},
     f"{W}.adapters: 65 adapters, at most 64", ("maxItems", "spec.lora.adapters")),
    ({"adapters": [{"name": "a", "uri": PVC}, {"name": "a", "uri": "pvc://c/b"}]},
     f"{W}.adapters[1].name 'a': another adapter has this name", None),  # list-map keys
    (_one(name="has space"), f"{A0}.name 'has space': whitespace",
     ("pattern", "spec.lora.adapters.0.name")),
    (_one(name="zw\u200bx"), f"{A0}.name 'zw\\u200bx': whitespace or unprintable", None),
    (_one(name="a=b"), f"{A0}.name 'a=b': no '=' and no leading '-'",
     ("pattern", "spec.lora.adapters.0.name")),
    (_one(name="-x"), f"{A0}.name '-x': no '='", ("pattern", "spec.lora.adapters.0.name")),
    (_one(name="a" * 129), f"{A0}.name: 1 to 128 characters",
     ("maxLength", "spec.lora.adapters.0.name")),
    (_one(name=""), f"{A0}.name: 1 to 128 characters",
     [("minLength", "spec.lora.adapters.0.name"), ("pattern", "spec.lora.adapters.0.name")]),
    ({"adapters": [{"name": "a"}]}, f"{A0}.uri is required (pvc://CLAIM[/PATH]",
     ("required", "spec.lora.adapters.0")),
    (_one(uri="s3://b/a"), f"{A0}.uri 's3://b/a': expected pvc://",
     ("pattern", "spec.lora.adapters.0.uri")),
    (_one(uri="SmolLM2-135M-Instruct"), f"{A0}.uri 'SmolLM2-135M-Instruct': an adapter's "
     "location", ("pattern", "spec.lora.adapters.0.uri")),
    (_one(uri="hf://just-a-name"), f"{A0}.uri 'hf://just-a-name': expected hf://ORG/REPO",
     ("pattern", "spec.lora.adapters.0.uri")),
    (_one(uri="pvc://c/../x"), f"{A0}.uri 'pvc://c/../x': '..' is not allowed", None),
    (_one(uri="file:///adapters/x"), f"{A0}.uri 'file:///adapters/x': /adapters is where",
     "lora.adapters.uri: /adapters is where the operator mounts adapters; a file:// adapter "
     "lies outside it"),
    (_one(sha256="ABC"), f"{A0}.sha256 'ABC': 64 lowercase hex digits",
     ("pattern", "spec.lora.adapters.0.sha256")),
    (_one(sha256=SHA.upper()), f"{A0}.sha256 '{SHA.upper()}'",
     ("pattern", "spec.lora.adapters.0.sha256")),
    (_one(digest=SHA), f"{A0}: unknown keys ['digest']", None),
    ({"storage": "2Gi", **_one()}, f"{W}.hfTokenSecretRef and {W}.storage are for hf:// "
     "adapters only", "lora.hfTokenSecretRef and lora.storage are for hf:// adapters only"),
    ({"hfTokenSecretRef": {"name": "t"}}, f"{W}.hfTokenSecretRef and {W}.storage are for "
     "hf://", "lora.hfTokenSecretRef and lora.storage are for hf:// adapters only"),
    ({"storage": "lots", **_one(uri="hf://o/r")}, f"{W}.storage 'lots': a size like 4Gi",
     ("pattern", "spec.lora.storage")),
    ({"hfTokenSecretRef": {"key": "k"}, **_one(uri="hf://o/r")},
     f"{W}.hfTokenSecretRef.name is required", ("required", "spec.lora.hfTokenSecretRef")),
]


@pytest.mark.parametrize(("lora", "message", "crd"), ERRORS,
                         ids=[c[1][:60] for c in ERRORS])
def test_refusals_name_the_field_and_the_crd_agrees(lora, message, crd):
    raw = with_lora(lora)
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert message in str(e.value)
    errors = [(x.validator, ".".join(map(str, x.absolute_path))) for x in _errors(resource(raw))]
    cel = failed_rules(resource(raw)) if not errors else []
    if crd is None:
        assert (errors, cel) == ([], [])
    elif isinstance(crd, (tuple, list)):
        assert errors == (crd if isinstance(crd, list) else [crd])
    else:
        assert cel == [crd]


def test_an_adapter_named_like_the_served_model_is_refused():
    raw = with_lora({"adapters": [{"name": "llama-3-8b", "uri": PVC}]}, "disaggregated")
    with pytest.raises(SpecError, match=r"lora.adapters\[0\].name 'llama-3-8b' is the served "
                                        r"model's name \(model.name\)"):
        parse_spec(raw)
    assert _errors(resource(raw)) == []
    assert failed_rules(resource(raw)) == [
        "lora.adapters: an adapter's name must differ from model.name (the served model's)"]
    raw = with_lora({"adapters": [{"name": "SmolLM2-135M-Instruct", "uri": PVC}]})
    with pytest.raises(SpecError, match="served model's name"):  # the default name, too
        parse_spec(raw)


def test_valid_settings_pass_schema_cel_parser_and_engine():
    for lora in ({}, {"maxLoras": 8, "maxCpuLoras": 8}, {"maxLoraRank": 512},
                 {"adapters": [{"name": n, "uri": f"pvc://c/{i}"} for i, n in enumerate(NAMES)]},
                 {"storage": "1Gi", "adapters": [{"name": "x", "uri": "hf://o/r@v/sub/dir",
                                                   "sha256": SHA}]}):
        raw = with_lora(lora)
        assert _errors(resource(raw)) == [] and failed_rules(resource(raw)) == []
        (cfg,) = worker_configs(raw).values()
        assert cfg.enable_lora and cfg.lora_dirs == ("/adapters",)
        assert cfg.max_loras == lora.get("maxLoras", 1)


# ---- what it renders -----------------------------------------------------------------------

def test_every_role_gets_the_flags_and_the_worker_reads_them_back():
    docs = workers(render("lora"))
    assert set(docs) == {"demo-prefill", "demo-decode"}
    for d in docs.values():
        args = container(d)["args"]
        start = args.index("--enable-lora")
        assert args[start:args.index("--lora-dir") + 2] == [
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras",
            "4", "--lora-modules", *(f"{k}={v}" for k, v in MODULES.items()),
            "--lora-dir", "/adapters"]
    for name, cfg in worker_configs(spec("lora")).items():
        assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (
            True, 2, 64, 4), name
        assert cfg.lora_modules == MODULES and cfg.lora_dirs == ("/adapters",)
    (both,) = workers(render(with_lora({"maxLoraRank": 8}))).values()
    args = container(both)["args"]
    assert arg(args, "--role") == "both" and arg(args, "--max-lora-rank") == "8"
    assert "--lora-modules" not in args and "--max-cpu-loras" not in args
    assert args[-5:-3] == ["--lora-dir", "/adapters"]  # then the worker-auth key file
    for name in ("aggregated", "disaggregated", "pods"):
        assert all("--enable-lora" not in container(d)["args"] for d in render(name)
                   if d["kind"] == "Deployment")


def test_adapters_are_mounted_read_only_and_claims_shared():
    for d in workers(render("lora")).values():
        p, mounts = pod(d), container(d)["volumeMounts"]
        vols = {v["name"]: v for v in p["volumes"]}
        lora = [m for m in mounts if m["mountPath"].startswith("/adapters")]
        assert lora == [
            {"name": "model", "mountPath": "/adapters/0-sql", "readOnly": True,
             "subPath": "adapters/sql"},  # the model's claim: its volume
            {"name": "lora-1", "mountPath": "/adapters/1-acme-support-v2", "readOnly": True,
             "subPath": "support"},
            {"name": "lora-download", "mountPath": "/adapters/2-chat-es", "subPath": "2-chat-es",
             "readOnly": True},
            {"name": "lora-download", "mountPath": "/adapters/3-summarize",
             "subPath": "3-summarize", "readOnly": True}]
        assert vols["lora-1"]["persistentVolumeClaim"] == {"claimName": "adapters",
                                                            "readOnly": True}
        assert vols["lora-download"] == {"name": "lora-download",
                                         "emptyDir": {"sizeLimit": "2Gi"}}
        assert [v["persistentVolumeClaim"]["claimName"] for v in p["volumes"]
                if "persistentVolumeClaim" in v] == ["models", "adapters"]  # one per claim
        assert container(d)["resources"] == {"requests": {"ephemeral-storage": "2Gi"},
                                             "limits": {"ephemeral-storage": "6144Mi"}}


def test_one_init_container_fetches_and_checks_the_adapters():
    for d in workers(render("lora")).values():
        (init,) = pod(d)["initContainers"]
        assert init["name"] == "fetch-adapters" and init["image"] == "tandem:test"
        assert init["command"][:4] == ["python", "-m", "tandem.operator.fetch", "adapters"]
        assert [json.loads(x) for x in init["command"][4:]] == [
            {"local": "/adapters/1-acme-support-v2", "sha256": SHA},
            {"repo": "org/llama-3-8b-es-lora", "revision": "v1", "path": "",
             "dest": "/adapters/2-chat-es", "sha256": SHA[::-1]},
            {"repo": "org/adapters", "revision": "", "path": "summarize",
             "dest": "/adapters/3-summarize"}]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "hf-token", "key": "token"}}} in init["env"]
        assert [m for m in init["volumeMounts"] if m["mountPath"].startswith("/adapters")] == [
            {"name": "lora-1", "mountPath": "/adapters/1-acme-support-v2", "readOnly": True,
             "subPath": "support"},  # checked, not written
            {"name": "lora-download", "mountPath": "/adapters/2-chat-es",
             "subPath": "2-chat-es"},
            {"name": "lora-download", "mountPath": "/adapters/3-summarize",
             "subPath": "3-summarize"}]
    # a pinned file:// adapter is checked in the image; unpinned pvc/file ones need nothing
    raw = with_lora({"adapters": [{"name": "a", "uri": "file:///opt/a", "sha256": SHA},
                                  {"name": "b", "uri": "pvc://c/b"}]})
    (d,) = workers(render(raw)).values()
    (init,) = pod(d)["initContainers"]
    assert [json.loads(x) for x in init["command"][4:]] == [{"local": "/opt/a", "sha256": SHA}]
    assert "lora-download" not in {v["name"] for v in pod(d)["volumes"]}
    assert "resources" not in container(d)
    raw = with_lora({"adapters": [{"name": "b", "uri": "pvc://c/b"}]})
    (d,) = workers(render(raw)).values()
    assert "initContainers" not in pod(d)


def test_the_rendered_init_container_runs(tmp_path, monkeypatch):
    """Its command, /adapters moved under tmp_path, against local files and a fake Hub:
    pinned digests pass, then a changed file fails it naming the file and both digests."""
    (d,) = [d for n, d in workers(render("lora")).items() if n == "demo-decode"]
    (init,) = pod(d)["initContainers"]
    items = [x.replace('"/adapters/', f'"{tmp_path}/') for x in init["command"][4:]]
    weights = {"chat-es": b"es-weights", "summarize": b"sum-weights"}
    fetched = []

    def hub(repo, revision, path, dest, patterns):
        fetched.append((repo, revision, path, dest.name, patterns))
        for pattern in patterns:
            f = dest / pattern
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(weights[dest.name.split("-", 1)[1]] if "model" in pattern else b"{}")

    monkeypatch.setattr(fetch, "hf_download", hub)
    local = tmp_path / "1-acme-support-v2"
    local.mkdir()
    (local / "adapter_config.json").write_text("{}")
    (local / "adapter_model.safetensors").write_bytes(b"support")
    sha = {"support": hashlib.sha256(b"support").hexdigest(),
           "es": hashlib.sha256(b"es-weights").hexdigest()}
    items[0] = items[0].replace(SHA, sha["support"])
    items[1] = items[1].replace(SHA[::-1], sha["es"])
    assert fetch.main(["adapters", *items]) == 0
    assert fetched == [
        ("org/llama-3-8b-es-lora", "v1", "", "2-chat-es",
         ["adapter_config.json", "adapter_model.safetensors"]),
        ("org/adapters", "", "", "3-summarize",
         ["summarize/adapter_config.json", "summarize/adapter_model.safetensors"])]
    assert (tmp_path / "3-summarize" / "summarize" / "adapter_model.safetensors").is_file()
    (local / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(SystemExit) as e:
        fetch.main(["adapters", *items])
    bad = hashlib.sha256(b"tampered").hexdigest()
    assert str(e.value) == (f"{local}/adapter_model.safetensors: sha256 {bad}, "
                            f"lora.adapters pins {sha['support']}")


def test_an_adapter_without_its_files_fails_the_fetch(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit, match="adapter .*/a: no adapter_model.safetensors"):
        fetch.main(["adapters", json.dumps({"local": str(tmp_path / "a")})])
    monkeypatch.setattr(fetch, "hf_download", lambda *a, **k: None)  # nothing matched
    with pytest.raises(SystemExit, match=r"adapter hf://o/r@v1/sub: no adapter_config.json "
                                         r"or adapter_model.safetensors"):
        fetch.main(["adapters", json.dumps({"repo": "o/r", "revision": "v1", "path": "sub",
                                            "dest": str(tmp_path / "b")})])
    with pytest.raises(SystemExit, match="--dest DIR is required"):
        fetch.main(["model", "--repo", "o/r"])


def test_names_that_slug_alike_get_their_own_directories_and_volumes():
    names = ["A.b", "a-b", "日本語", "x" * 128]
    assert [adapter_dir(i, n) for i, n in enumerate(names)] == [
        "0-a-b", "1-a-b", "2-adapter", "3-" + "x" * 40]
    raw = with_lora({"adapters": [{"name": n, "uri": f"pvc://claim-{i}/p"}
                                  for i, n in enumerate(names)]})
    (d,) = workers(render(raw)).values()
    mounts = [m for m in container(d)["volumeMounts"] if m["mountPath"].startswith("/adapters")]
    assert len({m["mountPath"] for m in mounts}) == len({m["name"] for m in mounts}) == 4
    kubernetes_validate.validate(d, K8S, strict=True)


def test_an_hf_model_and_hf_adapters_add_their_downloads():
    raw = with_lora({"adapters": [{"name": "a", "uri": "hf://o/a"}]}, "tls")
    docs = render(raw)
    for d in workers(docs).values():
        assert container(d)["resources"] == {  # 50Gi (the model) + 4Gi (the adapters)
            "requests": {"ephemeral-storage": "55296Mi"},
            "limits": {"ephemeral-storage": f"{55296 + 4096}Mi"}}
        assert [c["name"] for c in pod(d)["initContainers"]] == ["fetch-model",
                                                                 "fetch-adapters"]
        init = pod(d)["initContainers"][1]
        assert all(e["name"] != "HF_TOKEN" for e in init["env"])  # no lora.hfTokenSecretRef
    for doc in docs:
        if doc["kind"] != "Certificate":
            kubernetes_validate.validate(doc, K8S, strict=True)


def test_a_pool_may_mount_more_adapters_under_the_lora_dir_but_not_over_them():
    raw = set_path(spec("lora"), "decode.volumes", [{"name": "extra", "persistentVolumeClaim":
                                                     {"claimName": "more", "readOnly": True}}])
    raw["decode"]["volumeMounts"] = [{"name": "extra", "mountPath": "/adapters/extra",
                                      "readOnly": True}]
    d = one(render(raw), "Deployment", "demo-decode")
    assert {"name": "extra", "mountPath": "/adapters/extra", "readOnly": True} in (
        container(d)["volumeMounts"])
    raw["decode"]["volumeMounts"][0]["mountPath"] = "/adapters"
    with pytest.raises(SpecError, match=r"decode.volumeMounts\[0\].mountPath: '/adapters' "
                                        "overlaps '/adapters/0-sql'"):
        render(raw)
    raw["decode"]["volumes"][0]["name"] = "lora-1"
    raw["decode"]["volumeMounts"][0].update(name="lora-1", mountPath="/adapters/extra")
    with pytest.raises(SpecError, match=r"decode.volumes\[0\].name: 'lora-1' is a volume"):
        render(raw)


# ---- determinism and rollouts --------------------------------------------------------------

def test_renders_are_deterministic_and_a_change_rolls_every_pool():
    assert render("lora") == render("lora")
    base = parse_spec(spec("lora"))
    before = {p.name: pool_config_hash(base, p) for p in pools(base)}
    for path, value in (("lora.maxLoras", 3), ("lora.adapters", [{"name": "x",
                                                                  "uri": "hf://o/x"}]),
                        ("lora.adapters.0", {"name": "sql", "uri": "pvc://models/adapters/v2"})):
        raw = spec("lora")
        if path.endswith(".0"):
            raw["lora"]["adapters"][0] = value
        else:
            set_path(raw, path, value)
        other = parse_spec(raw)
        assert all(pool_config_hash(other, p) != before[p.name] for p in pools(other)), path
    raw = spec("lora")
    raw["lora"]["adapters"][1]["sha256"] = "f" * 64
    other = parse_spec(raw)
    assert all(pool_config_hash(other, p) != before[p.name] for p in pools(other))


def test_services_without_lora_keep_their_config_hash():
    """No rollout of existing pools when the operator learns about LoRA."""
    s = parse_spec(spec("disaggregated"))
    for p in pools(s):
        kv = s.kv_transfer if p.role == "decode" else None
        assert pool_config_hash(s, p) == config_hash(s.model, p.spec.engine, p.role, kv,
                                                     s.kv_transfer.tls_secret)
    assert isinstance(pools(s)[0], Pool)


# ---- the chart's example through `tandem render` -------------------------------------------

def test_tandem_render_shows_the_examples_adapters():
    example = ROOT / "charts" / "tandem" / "examples" / "lora.yaml"
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run([str(tandem), "render", "-f", str(example), "-n", "ml"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    import yaml

    (d,) = [d for d in yaml.safe_load_all(proc.stdout)
            if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "qwen-lora-worker"]
    args = container(d)["args"]
    assert args[args.index("--enable-lora"):args.index("--lora-dir") + 2] == [
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8",
        "--lora-modules", "sql=/adapters/0-sql", "support-v3=/adapters/1-support-v3",
        "--lora-dir", "/adapters"]
    assert [c["name"] for c in pod(d)["initContainers"]] == ["fetch-model", "fetch-adapters"]
    assert {"name": "lora-1", "persistentVolumeClaim": {"claimName": "lora-adapters",
                                                        "readOnly": True}} in pod(d)["volumes"]
    assert {"name": "lora-1", "mountPath": "/adapters/1-support-v3", "readOnly": True,
            "subPath": "support/v3"} in container(d)["volumeMounts"]
