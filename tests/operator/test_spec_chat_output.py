"""InferenceService `engine` fields for what the chat and Responses APIs make of outputs
(`toolCallParser`, `enableAutoToolChoice`, `reasoningParser`, `structuredOutputsBackend`,
`responsesStoreMax`, `responsesStoreTtlSeconds`): the CRD's enums are the worker's choices,
the operator renders them as the worker flags its own parser reads back, only where set (pools
without them keep their arguments and config hash), and the CRD (schema + CEL) and the
operator refuse auto tool choice without a parser, unknown values and the fields on a deployed
prefill pool (prefill workers serve no client requests)."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import pytest

from tandem.operator import spec_engine
from tandem.operator.render.common import config_hash
from tandem.operator.render.workers import pool_config_hash, pools
from tandem.operator.spec import SpecError, parse_spec
from tandem.protocol import engine_flags as flags
from tests.operator.manifests import arg, by_kind, container, render, set_path
from tests.operator.samples import SPECS, resource, schema, spec
from tests.operator.test_crd import _errors, failed_rules
from tests.operator.test_render_content import worker_parser

CHAT = {"toolCallParser": "hermes", "enableAutoToolChoice": True, "reasoningParser": "qwen3",
        "structuredOutputsBackend": "xgrammar", "responsesStoreMax": 50,
        "responsesStoreTtlSeconds": 600}
FLAGS = (flags.TOOL_CALL_PARSER, flags.ENABLE_AUTO_TOOL_CHOICE, flags.REASONING_PARSER,
         flags.STRUCTURED_OUTPUTS_BACKEND, flags.RESPONSES_STORE_MAX, flags.RESPONSES_STORE_TTL)
PREFILL_RULE = ("prefill.engine: toolCallParser, enableAutoToolChoice, reasoningParser, "
                "structuredOutputsBackend and responsesStore* are for pools serving clients; "
                "prefill workers serve no client requests: set them on decode.engine")
AUTO_RULE = "engine.enableAutoToolChoice needs engine.toolCallParser (the model's tool-call format)"


def _engine_props() -> dict[str, Any]:
    return schema()["properties"]["spec"]["properties"]["decode"]["properties"]["engine"][
        "properties"]


def with_engine(name: str, pool: str = "decode", **fields: Any) -> dict[str, Any]:
    raw = spec(name)
    engine = raw.setdefault(pool, {}).setdefault("engine", {})
    engine.update(copy.deepcopy(fields))
    return raw


def worker_args_by_pool(raw: dict[str, Any]) -> dict[str, list[str]]:
    """Deployment name -> its `tandem worker` arguments after `worker`."""
    return {d["metadata"]["name"]: container(d)["args"][1:]
            for d in by_kind(render(raw), "Deployment") if container(d)["args"][0] == "worker"}


# ---- the CRD, the operator and the worker agree ----------------------------------------------

def test_the_crds_enums_are_the_workers_choices():
    props = _engine_props()
    assert props["toolCallParser"]["enum"] == list(flags.TOOL_CALL_PARSERS)
    assert props["reasoningParser"]["enum"] == list(flags.REASONING_PARSERS)
    assert props["structuredOutputsBackend"]["enum"] == list(flags.STRUCTURED_OUTPUTS_BACKENDS)
    assert spec_engine.TOOL_CALL_PARSERS is flags.TOOL_CALL_PARSERS
    assert spec_engine.REASONING_PARSERS is flags.REASONING_PARSERS
    assert spec_engine.STRUCTURED_OUTPUTS_BACKENDS is flags.STRUCTURED_OUTPUTS_BACKENDS
    assert props["enableAutoToolChoice"]["type"] == "boolean"
    assert props["responsesStoreMax"]["minimum"] == 0
    assert props["responsesStoreTtlSeconds"]["minimum"] == 1
    # no schema default: unset leaves the worker's own, and `has()` in the CEL rules is "set"
    assert set(spec_engine.CLIENT_OUTPUT_FIELDS) <= set(props)
    assert all("default" not in props[k] for k in spec_engine.CLIENT_OUTPUT_FIELDS)


def test_the_fields_render_flags_the_worker_reads_back():
    from tandem.serving.tool_parsers.options import ChatParsing, chat_parsing
    from tandem.serving.worker import engine_config

    raw = with_engine("aggregated", **CHAT)
    assert _errors(resource(raw)) == [] and failed_rules(resource(raw)) == []
    (args,) = worker_args_by_pool(raw).values()
    assert arg(args, flags.TOOL_CALL_PARSER) == "hermes"
    assert flags.ENABLE_AUTO_TOOL_CHOICE in args
    assert arg(args, flags.RESPONSES_STORE_TTL) == "600"
    parsed = worker_parser().parse_args(args)
    assert chat_parsing(parsed) == ChatParsing("hermes", True, "qwen3")
    assert (parsed.responses_store_max, parsed.responses_store_ttl) == (50, 600.0)
    assert engine_config(parsed, serving=True).structured_outputs_backend == "xgrammar"


def test_a_disaggregated_service_gives_them_to_the_decode_pool_only():
    raw = with_engine("disaggregated", toolCallParser="llama3_json", reasoningParser="deepseek_r1",
                      responsesStoreMax=0)
    assert _errors(resource(raw)) == [] and failed_rules(resource(raw)) == []
    args = worker_args_by_pool(raw)
    assert arg(args["demo-decode"], flags.TOOL_CALL_PARSER) == "llama3_json"
    assert arg(args["demo-decode"], flags.REASONING_PARSER) == "deepseek_r1"
    assert arg(args["demo-decode"], flags.RESPONSES_STORE_MAX) == "0"
    assert flags.ENABLE_AUTO_TOOL_CHOICE not in args["demo-decode"]  # unset: the worker's off
    assert not set(FLAGS) & set(args["demo-prefill"])
    parsed = worker_parser().parse_args(args["demo-decode"])
    assert (parsed.tool_call_parser, parsed.enable_auto_tool_choice) == ("llama3_json", False)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_services_without_them_render_as_before(name):
    """No flag, and the config hash of the engine as it was before the fields existed: an
    operator upgrade rolls no pool."""
    for args in worker_args_by_pool(spec(name)).values():
        assert not set(FLAGS) & set(args)
    s = parse_spec(spec(name))
    for p in pools(s):
        old_engine = {k: v for k, v in asdict(p.spec.engine).items()
                      if k not in spec_engine.CLIENT_OUTPUT_FIELDS.values()}
        kv = s.kv_transfer if p.role == "decode" else None
        lora = [s.lora] if s.lora is not None else []
        tp = [p.spec.parallelism] if p.spec.parallelism.tensor > 1 else []
        tiers = [s.kv_cache.offload] if s.kv_cache.offload is not None else []
        assert pool_config_hash(s, p) == config_hash(
            s.model, old_engine, p.role, kv, s.kv_transfer.tls_secret, *lora, *tp, *tiers)


@pytest.mark.parametrize("field", sorted(CHAT))
def test_setting_one_rolls_the_pool(field):
    extra = {"toolCallParser": "hermes"} if field == "enableAutoToolChoice" else {}
    base = parse_spec(with_engine("aggregated", **extra))
    other = parse_spec(with_engine("aggregated", **extra, **{field: CHAT[field]}))
    (p,), (q,) = pools(base), pools(other)
    assert pool_config_hash(other, q) != pool_config_hash(base, p)


# ---- refusals --------------------------------------------------------------------------------

def test_auto_tool_choice_needs_a_parser():
    raw = with_engine("aggregated", enableAutoToolChoice=True, reasoningParser="qwen3")
    assert _errors(resource(raw)) == []
    assert failed_rules(resource(raw)) == [AUTO_RULE]
    with pytest.raises(SpecError, match=r"decode\.engine\.enableAutoToolChoice needs "
                                        r"decode\.engine\.toolCallParser"):
        parse_spec(raw)
    raw["decode"]["engine"]["enableAutoToolChoice"] = False  # off: nothing to parse
    assert failed_rules(resource(raw)) == []
    assert parse_spec(raw).decode.engine.tool_call_parser is None


@pytest.mark.parametrize(("field", "value", "validator"), [
    ("toolCallParser", "pythonic", "enum"),
    ("reasoningParser", "granite", "enum"),
    ("structuredOutputsBackend", "outlines", "enum"),
    ("responsesStoreMax", -1, "minimum"),
    ("responsesStoreTtlSeconds", 0, "minimum"),
    ("enableAutoToolChoice", "yes", "type"),
])
def test_unknown_values_are_refused_by_the_schema_and_the_operator(field, value, validator):
    raw = with_engine("aggregated", **{"toolCallParser": "hermes", field: value})
    errors = _errors(resource(raw))
    assert [(e.validator, ".".join(map(str, e.absolute_path))) for e in errors] == [
        (validator, f"spec.decode.engine.{field}")]
    with pytest.raises(SpecError, match=rf"decode\.engine\.{field}: "):
        parse_spec(raw)


@pytest.mark.parametrize("field", sorted(CHAT))
def test_a_deployed_prefill_pool_refuses_them(field):
    extra = {"toolCallParser": "hermes"} if field == "enableAutoToolChoice" else {}
    raw = with_engine("disaggregated", "prefill", **extra, **{field: CHAT[field]})
    assert _errors(resource(raw)) == []
    assert failed_rules(resource(raw)) == [PREFILL_RULE]
    with pytest.raises(SpecError, match=rf"prefill\.engine\..*{field}.*: prefill workers "
                                        "serve no client requests; set them on decode.engine"):
        parse_spec(raw)
    raw["prefill"]["replicas"] = 0  # aggregated: the prefill pool's engine is not deployed
    assert failed_rules(resource(raw)) == []
    parse_spec(raw)


def test_a_prefill_pools_auto_tool_choice_false_is_no_setting():
    raw = set_path(spec("disaggregated"), "prefill.engine.enableAutoToolChoice", False)
    assert failed_rules(resource(raw)) == []
    assert parse_spec(raw).prefill.engine.client_output_fields == []


def test_a_store_of_zero_responses_is_a_setting():
    """`responsesStoreMax: 0` (store none) is set, not unset: refused on a deployed prefill
    pool, and it rolls the pool it is set on."""
    raw = with_engine("disaggregated", "prefill", responsesStoreMax=0)
    assert failed_rules(resource(raw)) == [PREFILL_RULE]
    with pytest.raises(SpecError, match=r"prefill\.engine\.responsesStoreMax: "):
        parse_spec(raw)
    base = parse_spec(spec("aggregated"))
    other = parse_spec(with_engine("aggregated", responsesStoreMax=0))
    (p,), (q,) = pools(base), pools(other)
    assert pool_config_hash(other, q) != pool_config_hash(base, p)
