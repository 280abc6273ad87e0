"""InferenceService `engine.quantization`, `engine.quantizationGroupSize` and
`engine.kvCacheDtype`: the operator's parser (SpecError naming the field), the CRD (enums and
CEL rules, the same refusals), and the rendered `tandem worker` flags, read back by the
worker's own parser into its EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from tandem.engine import config as engine_config_module
from tandem.operator.render.workers import Pool, pool_config_hash, worker_args
from tandem.operator.spec import SpecError, parse_spec
from tandem.operator.spec_engine import GROUP_SIZES, KV_CACHE_DTYPES, QUANTIZATIONS
from tests.operator.manifests import arg, by_kind, container, render, set_path
from tests.operator.samples import resource, schema, spec
from tests.operator.test_crd import _errors, failed_rules

QUANT_FLAGS = ("--quantization", "--quantization-group-size", "--kv-cache-dtype")


def quantized() -> dict:
    """Disaggregated: int4 g64 prefill and int8 decode, both with an fp8 KV cache (the
    prefill pool spelling it as vLLM's alias)."""
    raw = spec("disaggregated")
    raw["prefill"]["engine"].update(quantization="int4", quantizationGroupSize=64,
                                    kvCacheDtype="fp8_e4m3")
    raw["decode"]["engine"].update(quantization="int8", kvCacheDtype="fp8")
    return raw


def worker_configs(raw: dict) -> dict:
    """Deployment name -> the EngineConfig `tandem worker` builds from its rendered args."""
    from tandem.serving.worker import add_engine_args, add_server_args, engine_config

    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    add_server_args(p)
    return {d["metadata"]["name"]: engine_config(p.parse_args(container(d)["args"][1:]),
                                                 serving=True)
            for d in by_kind(render(raw), "Deployment") if container(d)["args"][0] == "worker"}


def _engine_node() -> dict:
    return schema()["properties"]["spec"]["properties"]["decode"]["properties"]["engine"]


def test_the_operators_values_are_the_engines_the_crds_and_the_workers():
    from tandem.serving.worker import add_engine_args

    assert QUANTIZATIONS == engine_config_module.QUANTIZATIONS
    assert KV_CACHE_DTYPES == engine_config_module.KV_CACHE_DTYPES
    props = _engine_node()["properties"]
    assert props["quantization"]["enum"] == list(QUANTIZATIONS)
    assert props["quantizationGroupSize"]["enum"] == list(GROUP_SIZES)
    assert props["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    assert props["kvCacheDtype"]["default"] == "auto"
    p = argparse.ArgumentParser()
    add_engine_args(p)
    choices = {a.dest: tuple(a.choices) for a in p._actions if a.choices is not None}
    assert choices["quantization"] == QUANTIZATIONS
    assert choices["quantization_group_size"] == GROUP_SIZES
    assert choices["kv_cache_dtype"] == KV_CACHE_DTYPES


def test_rendered_into_both_pools_and_read_back_by_the_workers_parser():
    docs = {d["metadata"]["name"]: container(d)["args"]
            for d in by_kind(render(quantized()), "Deployment")}
    pre, dec = docs["demo-prefill"], docs["demo-decode"]
    assert [(f, arg(pre, f)) for f in QUANT_FLAGS] == [
        ("--quantization", "int4"), ("--quantization-group-size", "64"),
        ("--kv-cache-dtype", "fp8_e4m3")]
    assert [(f, arg(dec, f)) for f in QUANT_FLAGS] == [
        ("--quantization", "int8"), ("--quantization-group-size", None),
        ("--kv-cache-dtype", "fp8")]
    got = worker_configs(quantized())
    p, d = got["demo-prefill"], got["demo-decode"]
    assert (p.quantization, p.quantization_group_size, p.kv_cache_dtype) == ("int4", 64, "fp8")
    assert (d.quantization, d.quantization_group_size, d.kv_cache_dtype) == ("int8", None, "fp8")


def test_unset_fields_render_no_flag_and_leave_the_workers_defaults():
    for name in ("aggregated", "disaggregated"):
        for d in by_kind(render(name), "Deployment"):
            assert not set(QUANT_FLAGS) & set(container(d)["args"]), d["metadata"]["name"]
    raw = spec("aggregated")
    raw["decode"] = {"engine": {"kvCacheDtype": "auto"}}  # the CRD's default, written out
    assert "--kv-cache-dtype" not in container(by_kind(render(raw), "Deployment")[-1])["args"]
    (cfg,) = worker_configs(spec("aggregated")).values()
    assert (cfg.quantization, cfg.quantization_group_size, cfg.kv_cache_dtype) == (
        None, None, "auto")


def test_an_aggregated_pool_renders_every_quantization():
    for quant in QUANTIZATIONS:
        for kv in KV_CACHE_DTYPES:
            raw = set_path(spec("aggregated"), "decode.engine",
                           {"quantization": quant, "kvCacheDtype": kv})
            (cfg,) = worker_configs(raw).values()
            assert (cfg.quantization, cfg.kv_cache_dtype) == (  # vLLM's aliases resolved
                {"gptq_marlin": "gptq", "awq_marlin": "awq"}.get(quant, quant),
                "fp8" if kv == "fp8_e4m3" else kv)


def test_a_change_rolls_the_pool():
    base = parse_spec(quantized())
    pool = Pool("decode", "decode", base.decode)
    for change in ({"kvCacheDtype": "int8"}, {"quantization": "w8a8"},
                   {"quantization": "int8", "quantizationGroupSize": 128}):
        raw = quantized()
        raw["decode"]["engine"].update(change)
        if "kvCacheDtype" in change:
            raw["prefill"]["engine"]["kvCacheDtype"] = "int8"
        other = parse_spec(raw)
        assert pool_config_hash(other, Pool("decode", "decode", other.decode)) != (
            pool_config_hash(base, pool)), change
        assert worker_args(other, Pool("decode", "decode", other.decode), None) != (
            worker_args(base, pool, None))


SPEC_ERRORS = [  # (engine of the aggregated pool, the message's words)
    ({"quantization": "nf4"}, "decode.engine.quantization: 'nf4' is not one of int8, w8a8, "
                              "int4, fp8, gguf"),
    ({"quantization": 8}, "decode.engine.quantization: expected str, got 8"),
    ({"quantization": "int4", "quantizationGroupSize": 16},
     "decode.engine.quantizationGroupSize: 16 is not one of 32, 64, 128"),
    ({"quantization": "int4", "quantizationGroupSize": "64"},
     "decode.engine.quantizationGroupSize: expected int, got '64'"),
    ({"quantization": "int4", "quantizationGroupSize": True},
     "decode.engine.quantizationGroupSize: expected int, got True"),
    ({"quantization": "fp8", "quantizationGroupSize": 32},
     "decode.engine.quantizationGroupSize applies to quantization int4 or int8 (this pool's "
     "quantization: fp8)"),
    ({"quantizationGroupSize": 64}, "decode.engine.quantizationGroupSize applies to "
                                    "quantization int4 or int8 (this pool's quantization: "
                                    "unset)"),
    ({"kvCacheDtype": "fp16"}, "decode.engine.kvCacheDtype: 'fp16' is not one of auto, fp8, "
                               "fp8_e4m3, int8"),
]


@pytest.mark.parametrize(("engine", "message"), SPEC_ERRORS, ids=[c[1][:48] for c in SPEC_ERRORS])
def test_spec_errors_name_the_field(engine, message):
    with pytest.raises(SpecError) as e:
        parse_spec(set_path(spec("aggregated"), "decode.engine", engine))
    assert message in str(e.value)


def test_prefill_and_decode_must_share_the_kv_cache_dtype():
    raw = quantized()
    raw["decode"]["engine"]["kvCacheDtype"] = "int8"
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert str(e.value) == ("prefill.engine.kvCacheDtype fp8_e4m3 and decode.engine."
                            "kvCacheDtype int8 differ; KV pages move between the pools, so "
                            "they must match")
    raw["decode"]["engine"]["kvCacheDtype"] = "auto"
    with pytest.raises(SpecError, match="kvCacheDtype fp8_e4m3 and decode.engine.kvCacheDtype "
                                        "auto differ"):
        parse_spec(raw)
    raw["prefill"]["replicas"] = 0  # aggregated: the prefill pool's engine is not deployed
    assert parse_spec(raw).decode.engine.kv_cache_dtype == "auto"


# ---- the CRD refuses the same -------------------------------------------------------------

SCHEMA_INVALID = [  # (engine, the field whose enum fails)
    ({"quantization": "nf4"}, "quantization"),
    ({"quantization": "int4", "quantizationGroupSize": 16}, "quantizationGroupSize"),
    ({"kvCacheDtype": "fp16"}, "kvCacheDtype"),
]


@pytest.mark.parametrize(("engine", "field"), SCHEMA_INVALID, ids=[c[1] for c in SCHEMA_INVALID])
def test_the_schema_refuses_unknown_values(engine, field):
    errors = _errors(resource(set_path(spec("aggregated"), "decode.engine", engine)))
    assert [(e.validator, ".".join(map(str, e.absolute_path))) for e in errors] == [
        ("enum", f"spec.decode.engine.{field}")]


@pytest.mark.parametrize("engine", [
    {"quantizationGroupSize": 64}, {"quantization": "fp8", "quantizationGroupSize": 32}])
def test_cel_refuses_a_group_size_without_int4_or_int8(engine):
    obj = resource(set_path(spec("aggregated"), "decode.engine", engine))
    assert _errors(obj) == []  # the OpenAPI part alone lets it through
    assert failed_rules(obj) == [
        "engine.quantizationGroupSize applies to quantization int4 or int8 only"]
    with pytest.raises(SpecError, match="quantizationGroupSize applies to quantization int4"):
        parse_spec(obj["spec"])


def test_cel_accepts_what_the_operator_accepts_and_refuses_a_kv_dtype_mismatch():
    ok = resource(quantized())  # fp8_e4m3 against fp8: the same dtype
    assert _errors(ok) == [] and failed_rules(ok) == []
    for prefill, decode in (("fp8", "int8"), ("int8", None)):
        raw = quantized()
        raw["prefill"]["engine"]["kvCacheDtype"] = prefill
        if decode is None:  # unset: defaulted to auto
            del raw["decode"]["engine"]["kvCacheDtype"]
        else:
            raw["decode"]["engine"]["kvCacheDtype"] = decode
        obj = resource(raw)
        assert _errors(obj) == []
        assert failed_rules(obj) == ["prefill.engine.kvCacheDtype and decode.engine."
                                     "kvCacheDtype must match: KV pages move between the pools"]
        with pytest.raises(SpecError, match="must match"):
            parse_spec(raw)
    raw = quantized()
    raw["prefill"]["replicas"] = 0
    raw["prefill"]["engine"]["kvCacheDtype"] = "int8"
    assert failed_rules(resource(raw)) == []  # aggregated: no pages move
    parse_spec(raw)
