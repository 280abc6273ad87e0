"""InferenceService `engine.speculative` (vLLM's speculative_config keys): the operator's parser
accepts and refuses what the engine's `SpeculativeConfig` and the CRD (schema + CEL) do,
renders `--speculative-config` into decode and aggregated pools only (read back by the
worker's own parser), mounts a pvc:// draft read-only, and rolls the pool on a change."""

from __future__ import annotations

import copy
import json
import random

import celpy
import pytest
from openapi_schema_validator import OAS30Validator

from tandem.engine.config import QUANTIZATIONS as ENGINE_QUANTIZATIONS
from tandem.engine.errors import ConfigError
from tandem.engine.spec_decode import BUILTIN
from tandem.engine.spec_decode.config import MAX_SPECULATIVE_TOKENS as ENGINE_MAX
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.operator.render.workers import Pool, pool_config_hash
from tandem.operator.spec import SpecError, parse_spec
from tandem.operator.spec_engine import QUANTIZATIONS
from tandem.operator.spec_speculative import (
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    SpeculativeSpec,
    parse_speculative,
)
from tests.operator.manifests import arg, by_kind, container, one, render, set_path
from tests.operator.samples import apply_defaults, resource, schema, spec
from tests.operator.test_crd import _ENV, _PROGRAMS, _cel_value, _errors, failed_rules
from tests.operator.test_spec_quant import worker_configs

FLAG = "--speculative-config"


def _node() -> dict:
    return schema()["properties"]["spec"]["properties"]["decode"]["properties"]["engine"][
        "properties"]["speculative"]


def with_speculative(speculative: dict, name: str = "aggregated") -> dict:
    return set_path(spec(name), "decode.engine.speculative", speculative)


def test_the_operators_keys_values_and_defaults_are_the_engines_and_the_crds():
    props = _node()["properties"]
    # a draft's hub revision is the engine's only: the operator mounts file:// or pvc://
    # drafts, never a repository
    engine_only = {"revision"}
    assert set(props) == set(SpeculativeConfig.__dataclass_fields__) - engine_only == set(
        SpeculativeSpec.__dataclass_fields__)
    assert METHODS == BUILTIN and props["method"]["enum"] == list(METHODS)
    assert MAX_SPECULATIVE_TOKENS == ENGINE_MAX == props["num_speculative_tokens"]["maximum"]
    assert props["draft_quantization"]["enum"] == list(QUANTIZATIONS) == list(
        ENGINE_QUANTIZATIONS)
    engine, ours = SpeculativeConfig(method="ngram"), SpeculativeSpec(method="ngram")
    for key, sub in props.items():
        assert getattr(engine, key) == getattr(ours, key), key
        if "default" in sub:
            assert sub["default"] == getattr(ours, key), key


# ---- the three judges agree on random settings --------------------------------------------

# (valid, invalid) values per key; model values are mountable locations or not, which the
# engine (it takes any path) accepts alike
VALUES = {
    "method": (["ngram", "draft", "eagle"], ["medusa", 1, None]),
    "num_speculative_tokens": ([1, 4, 16], [0, 17, True, "4", 2.0]),
    "prompt_lookup_min": ([1, 2, 5, 64], [0, 65, "2"]),
    "prompt_lookup_max": ([1, 3, 5, 64], [65, False]),
    "model": (["self", "file:///opt/draft.gguf", "pvc://drafts/smol.gguf"],
              ["hf://o/r", "draft.gguf", "", 3]),
    "draft_quantization": (["int4", "int8", "fp8"], ["nf4", 4]),
    "draft_num_layers": ([1, 12, 1024], [0, 1025, "2"]),
    "adaptive": ([True, False], ["yes", 1]),
    "draft_tensor_parallel_size": ([1], [2, 0, True, "1", 1.5]),
}


def _random_setting(rng: random.Random) -> dict:
    """A method and some keys, each valid or (one time in eight) not; the draft keys mostly
    where they belong."""
    out: dict = {}
    for key, (good, bad) in VALUES.items():
        method = out.get("method")
        p = {"method": 0.97, "model": {"draft": 0.9, "eagle": 0.4}.get(method, 0.08)}.get(
            key, 0.4 if method == "draft" else 0.08 if key.startswith("draft_") else 0.3)
        if rng.random() < p:
            out[key] = rng.choice(bad if rng.random() < 0.12 else good)
    return out


def _engine_ok(raw: dict) -> bool:
    try:
        SpeculativeConfig.from_dict(raw)
    except (ConfigError, TypeError):
        return False
    return True


def _operator_ok(raw: dict) -> bool:
    try:
        parse_speculative(raw, "decode.engine")
    except SpecError:
        return False
    return True


NODE = _node()


def _crd_ok(raw: dict) -> bool:
    """The node's schema, then (defaulted, as the API server does) its CEL rules."""
    if list(OAS30Validator(NODE).iter_errors(raw)):
        return False
    value = celpy.json_to_cel(_cel_value(NODE, apply_defaults(NODE, copy.deepcopy(raw))))
    for rule in NODE["x-kubernetes-validations"]:
        program = _PROGRAMS.get(rule["rule"])
        if program is None:
            program = _PROGRAMS[rule["rule"]] = _ENV.program(_ENV.compile(rule["rule"]))
        if not program.evaluate({"self": value}):
            return False
    return True


def test_operator_engine_and_crd_agree_on_random_settings():
    rng = random.Random(23)
    seen = {True: 0, False: 0}
    for _ in range(400):
        raw = _random_setting(rng)
        ours = _operator_ok(raw)
        seen[ours] += 1
        model, method = raw.get("model"), raw.get("method")
        # by design the spec takes a mountable location ('self' for draft only), the engine a
        # path; everything else the same
        mountable = model is None or (model == "self" and method == "draft") or (
            isinstance(model, str) and model.startswith(("file:///", "pvc://")))
        assert ours == (_engine_ok(raw) and mountable), raw
        if None not in raw.values():  # the API server drops an explicit null
            assert _crd_ok(raw) == ours, raw
    assert min(seen.values()) > 120, seen  # both outcomes well covered


# ---- what it renders -----------------------------------------------------------------------

def test_decode_and_aggregated_pools_get_the_flag_and_the_worker_reads_it_back():
    docs = {d["metadata"]["name"]: container(d)["args"]
            for d in by_kind(render("disaggregated"), "Deployment")}
    assert json.loads(arg(docs["demo-decode"], FLAG)) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5, "adaptive": True}
    assert arg(docs["demo-decode"], FLAG).count(" ") == 0  # compact
    assert FLAG not in docs["demo-prefill"] and FLAG not in docs["demo-router"]
    cfg = worker_configs(spec("disaggregated"))
    assert cfg["demo-decode"].speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3)
    assert cfg["demo-prefill"].speculative_config is None
    raw = with_speculative({"method": "draft", "model": "self", "draft_num_layers": 6,
                            "draft_quantization": "int4", "adaptive": False})
    (got,) = worker_configs(raw).values()
    assert got.speculative_config == SpeculativeConfig(
        method="draft", model="self", draft_num_layers=6, draft_quantization="int4",
        adaptive=False)
    for name in ("aggregated", "gpu", "pods"):
        for d in by_kind(render(name), "Deployment"):
            assert FLAG not in container(d)["args"]


def _draft(model: str, name: str) -> tuple[dict, str]:
    raw = set_path(spec(name), "decode.engine.speculative", {"method": "draft",
                                                              "model": model})
    (d,) = [d for d in by_kind(render(raw), "Deployment")
            if d["metadata"]["name"] in ("demo-decode", "demo-worker")]
    (cfg,) = [c for n, c in worker_configs(raw).items() if n == d["metadata"]["name"]]
    path = json.loads(arg(container(d)["args"], FLAG))["model"]
    assert cfg.speculative_config.model == path
    return d, path


def test_a_draft_model_is_mounted_read_only_like_the_model():
    d, path = _draft("pvc://drafts/smol/q8.gguf", "aggregated")  # its own claim
    assert path == "/draft-model/smol/q8.gguf"
    pod = d["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "draft-model"]
    assert vol["persistentVolumeClaim"] == {"claimName": "drafts", "readOnly": True}
    assert {"name": "draft-model", "mountPath": "/draft-model", "readOnly": True} in (
        container(d)["volumeMounts"])
    d, path = _draft("pvc://models/llama/llama-3-1b.Q8_0.gguf", "disaggregated")
    assert path == "/models/llama/llama-3-1b.Q8_0.gguf"  # the model's claim, its mount
    assert "draft-model" not in {v["name"] for v in d["spec"]["template"]["spec"]["volumes"]}
    d, path = _draft("pvc://model-cache/drafts/small", "pods")  # the hf:// model's cache PVC
    assert path == "/draft-model/drafts/small"
    assert {"name": "model", "mountPath": "/draft-model", "readOnly": True} in (
        container(d)["volumeMounts"])
    assert "draft-model" not in {v["name"] for v in d["spec"]["template"]["spec"]["volumes"]}
    d, path = _draft("file:///opt/drafts/d.gguf", "aggregated")
    assert path == "/opt/drafts/d.gguf"
    assert all(m["mountPath"] != "/draft-model" for m in container(d)["volumeMounts"])
    eagle = with_speculative({"method": "eagle", "model": "pvc://heads/eagle.safetensors"})
    d = one(render(eagle), "Deployment", "demo-worker")
    assert json.loads(arg(container(d)["args"], FLAG))["model"] == (
        "/draft-model/eagle.safetensors")


def test_a_change_rolls_the_pool():
    base = parse_spec(spec("disaggregated"))
    before = pool_config_hash(base, Pool("decode", "decode", base.decode))
    for change in ({"method": "ngram", "num_speculative_tokens": 4},
                   {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                   {"method": "draft", "model": "self"}):
        other = parse_spec(with_speculative(change, "disaggregated"))
        assert pool_config_hash(other, Pool("decode", "decode", other.decode)) != before
    prefill = Pool("prefill", "prefill", base.prefill)
    assert pool_config_hash(parse_spec(with_speculative(
        {"method": "eagle"}, "disaggregated")), prefill) == pool_config_hash(base, prefill)


# ---- refusals ------------------------------------------------------------------------------

W = "decode.engine.speculative"
SPEC_ERRORS = [
    ({}, f"{W}.method is required (ngram, draft, eagle)"),
    ({"method": "medusa"}, f"{W}.method: 'medusa' is not one of ngram, draft, eagle"),
    ({"method": "ngram", "k": 2}, f"{W}: unknown keys ['k']"),
    ({"method": "ngram", "num_speculative_tokens": 17},
     f"{W}.num_speculative_tokens: 17 is not in [1, 16]"),
    ({"method": "ngram", "prompt_lookup_min": 6},
     f"{W}.prompt_lookup_max 5 is below prompt_lookup_min 6"),
    ({"method": "ngram", "adaptive": "no"}, f"{W}.adaptive: expected bool, got 'no'"),
    ({"method": "ngram", "model": "self"}, f"{W}.model applies to methods draft and eagle"),
    ({"method": "draft"}, f"{W}.model is required for method draft"),
    ({"method": "draft", "model": "hf://org/draft"},
     f"{W}.model 'hf://org/draft': 'self', file:///PATH or pvc://CLAIM/PATH (hf:// drafts "
     "are not fetched"),
    ({"method": "draft", "model": "s3://b/d"}, f"{W}.model 's3://b/d': expected pvc://"),
    ({"method": "draft", "model": "file:///a/../etc"}, f"{W}.model 'file:///a/../etc': "
                                                      "'..' is not allowed"),
    ({"method": "eagle", "model": "self"}, f"{W}.model 'self': file:///PATH or pvc://"),
    ({"method": "draft", "model": "self", "draft_quantization": "nf4"},
     f"{W}.draft_quantization: 'nf4' is not one of int8"),
    ({"method": "eagle", "draft_num_layers": 2},
     f"{W}.draft_quantization and draft_num_layers apply to method draft only"),
]


@pytest.mark.parametrize(("speculative", "message"), SPEC_ERRORS,
                         ids=[c[1][len(W):][:40] for c in SPEC_ERRORS])
def test_spec_errors_name_the_field(speculative, message):
    with pytest.raises(SpecError) as e:
        parse_spec(with_speculative(speculative))
    assert message in str(e.value)


def test_a_prefill_pool_does_not_speculate():
    raw = set_path(spec("disaggregated"), "prefill.engine.speculative", {"method": "ngram"})
    with pytest.raises(SpecError, match="prefill.engine.speculative: prefill workers do not "
                                        "decode; set decode.engine.speculative"):
        parse_spec(raw)
    assert _errors(resource(raw)) == []
    assert failed_rules(resource(raw)) == [
        "prefill.engine.speculative: prefill workers do not decode; set "
        "decode.engine.speculative"]
    raw["prefill"]["replicas"] = 0  # aggregated: the prefill pool's engine is not deployed
    assert failed_rules(resource(raw)) == []
    assert parse_spec(raw).decode.engine.speculative.num_speculative_tokens == 3


@pytest.mark.parametrize(("speculative", "validator", "field"), [
    ({"method": "medusa"}, "enum", "method"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "maximum", "num_speculative_tokens"),
    ({"method": "draft", "model": "hf://org/draft"}, "pattern", "model"),
    ({"num_speculative_tokens": 2}, "required", None),
])
def test_the_schema_refuses_what_it_can_express(speculative, validator, field):
    errors = _errors(resource(with_speculative(speculative)))
    path = "spec.decode.engine.speculative" + (f".{field}" if field else "")
    assert [(e.validator, ".".join(map(str, e.absolute_path))) for e in errors] == [
        (validator, path)]
