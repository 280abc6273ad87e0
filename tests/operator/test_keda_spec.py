"""The new InferenceService fields (`autoscaling.mode: keda` and its `keda` block, minReplicas
0, signal demand, `router.flowControl`, `monitoring.keda`): each spec the CRD's CEL rules
refuse is refused by `parse_spec` too, with the same reason; valid ones pass the schema and
every rule, and the CRD's defaults agree with `parse_spec`'s."""

from __future__ import annotations

import copy

import pytest

from tandem.operator.spec import SpecError, parse_spec
from tests.operator.manifests import set_path
from tests.operator.samples import SHA, apply_defaults, resource, schema
from tests.operator.test_crd import _errors, failed_rules
from tests.operator.test_keda_render import AGGREGATED, PD

KEDA0 = {"mode": "keda", "minReplicas": 0, "maxReplicas": 4, "target": 8}
FLOW = {"enabled": True, "fairness": "round-robin", "ordering": "edf", "ttlSeconds": 12.5,
        "saturation": {"waiting": 3, "kv": 0.8},
        "bands": {"default": {"maxRequests": 100, "maxBytes": 1 << 20}, "2": {"maxRequests": 5},
                  "-1": {"maxBytes": 4096}},
        "tenantWeights": {"gold": 4, "free": 0.5}, "shared": True, "startTimeoutSeconds": 60}
def _agg(autoscaling: dict) -> dict:
    return {"model": {"uri": "pvc://m"}, "decode": {"autoscaling": autoscaling}}


VALID = {
    "aggregated-keda": AGGREGATED,
    "pd-keda": PD,
    "flow": {"model": {"uri": "pvc://m"},
             "router": {"managedRedis": True, "flowControl": FLOW}},
    "keda-peer": {**copy.deepcopy(AGGREGATED), "monitoring": {"keda": {
        "podSelector": {"matchLabels": {"app": "keda-operator"}}}}},
    "idle": {"model": {"uri": "pvc://m"}, "decode": {"autoscaling": {
        "mode": "keda", "maxReplicas": 3, "target": 2, "keda": {"idleReplicas": 0}}}},
    "operator-zero": {"model": {"uri": "pvc://m", "sha256": SHA},
                      "prefill": {"replicas": 1, "autoscaling": {**KEDA0, "mode": "operator"}},
                      "decode": {"replicas": 0, "autoscaling": {
                          **KEDA0, "mode": "operator", "signal": "demand"}}},
    "operator-demand": _agg({"maxReplicas": 2, "target": 1, "signal": "demand"}),
    "band-targets": _agg({**KEDA0, "keda": {"bandTargets": {"2": 4, "-1": 16.5}}}),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_specs_pass_schema_cel_and_parse(name):
    raw = copy.deepcopy(VALID[name])
    assert _errors(resource(raw)) == []
    assert failed_rules(resource(raw)) == []
    defaulted = apply_defaults(schema()["properties"]["spec"], copy.deepcopy(raw))
    assert parse_spec(defaulted) == parse_spec(raw)


# (spec, what the CEL rule's message says, what parse_spec's error says); every rule of the
# autoscaling block is also held to parse_autoscaling over random blocks below
INVALID = [
    (_agg({**KEDA0, "mode": "hpa"}),
     "minReplicas 0 (scale to zero) needs mode operator or keda: an HPA cannot scale from zero",
     "decode.autoscaling.minReplicas 0 (scale to zero) needs decode.autoscaling.mode operator "
     "or keda: an HPA cannot scale from zero"),
    (_agg({"mode": "hpa", "maxReplicas": 2, "target": 1, "signal": "demand"}),
     "signal demand (the router's queued, running and waiting requests) needs mode operator "
     "or keda",
     "decode.autoscaling.signal demand (the router's queued, running and waiting requests) "
     "needs decode.autoscaling.mode operator or keda"),
    (_agg({**KEDA0, "mode": "operator", "signal": "waitingRequests"}),
     "scaling to zero (minReplicas or keda.idleReplicas 0) needs signal demand",
     "scaling to zero (minReplicas or keda.idleReplicas 0) needs signal demand"),
    ({**_agg({**KEDA0, "mode": "operator"}), "router": {"flowControl": {"enabled": False}}},
     "router.flowControl.enabled false: a pool scales to zero",
     "router.flowControl.enabled false: a pool scales to zero"),
    ({**_agg({**KEDA0, "minReplicas": 1, "keda": {"bandTargets": {"2": 4}}}),
      "router": {"flowControl": {"enabled": False}}},
     "router.flowControl.enabled false: autoscaling.keda.bandTargets scales on the "
     "flow-control queue's bands",
     "router.flowControl.enabled false: autoscaling.keda.bandTargets scales on the "
     "flow-control queue's bands"),
    (_agg({**KEDA0, "keda": {"bandTargets": {"gold": 4}}}),
     "autoscaling.keda.bandTargets: keys are band numbers",
     "decode.autoscaling.keda.bandTargets.gold: a band number"),
    (_agg({**KEDA0, "keda": {"idleReplicas": 0}}), "idleReplicas needs minReplicas >= 1",
     "keda.idleReplicas needs decode.autoscaling.minReplicas >= 1"),
    ({"model": {"uri": "pvc://m"}, "prefill": {"replicas": 1, "autoscaling": {
        **KEDA0, "minReplicas": 1, "signal": "kvUtilization", "target": 0.5,
        "keda": {"idleReplicas": 0}}}},
     "scaling to zero (minReplicas or keda.idleReplicas 0) needs signal demand",
     "scaling to zero (minReplicas or keda.idleReplicas 0) needs signal demand"),
    ({**_agg(KEDA0), "router": {"flowControl": {"enabled": False}}},
     "router.flowControl.enabled false: a pool scales to zero",
     "router.flowControl.enabled false: a pool scales to zero"),
    ({"model": {"uri": "pvc://m"}, "router": {"flowControl": {"shared": True}}},
     "router.flowControl.shared needs router.redisUrlSecretRef or router.managedRedis",
     "router.flowControl.shared needs router.redisUrlSecretRef or router.managedRedis"),
    ({"model": {"uri": "pvc://m"}, "router": {"flowControl": {
        "bands": {"gold": {"maxRequests": 1}}}}},
     "router.flowControl.bands: keys are band numbers (higher is served first) or 'default'",
     "router.flowControl.bands.gold: a band number (higher is served first) or 'default'"),
    ({"model": {"uri": "pvc://m"}, "monitoring": {"keda": {
        "podSelector": {"matchLabels": {"app": "keda-operator"}}}}},
     "monitoring.keda: no pool has autoscaling.mode keda",
     "monitoring.keda: no pool has autoscaling.mode keda"),
    ({**_agg(KEDA0), "monitoring": {"keda": {}}},
     "monitoring.keda needs a podSelector and/or a namespaceSelector",
     "monitoring.keda: one of namespaceSelector, podSelector"),
]


@pytest.mark.parametrize(("raw", "cel", "parsed"), INVALID, ids=[c for _, c, _ in INVALID])
def test_cel_and_parse_spec_refuse_alike(raw, cel, parsed):
    obj = resource(copy.deepcopy(raw))
    assert _errors(obj) == []  # the OpenAPI part alone lets it through
    failed = failed_rules(obj)
    assert len(failed) == 1 and cel in failed[0], failed
    with pytest.raises(SpecError) as exc:
        parse_spec(copy.deepcopy(raw))
    assert parsed in str(exc.value)


@pytest.mark.parametrize(("path", "value"), [
    ("decode.autoscaling.minReplicas", -1),
    ("decode.autoscaling.mode", "vpa"),
    ("decode.autoscaling.keda.idleReplicas", 1),
    ("decode.autoscaling.keda.kvUtilizationTarget", 1.5),
    ("decode.autoscaling.keda.pollingIntervalSeconds", 0),
    ("decode.autoscaling.keda.bandTargets.2", 0),
    ("decode.autoscaling.keda.bandTargets", {str(b): 1 for b in range(9)}),
    ("router.flowControl.fairness", "lottery"),
    ("router.flowControl.ordering", "lifo"),
    ("router.flowControl.ttlSeconds", 0),
    ("router.flowControl.saturation.kv", 1.2),
    ("router.flowControl.bands.default", {}),
    ("router.flowControl.tenantWeights.gold", 0),
    ("router.flowControl.startTimeoutSeconds", 0),
])
def test_schema_and_parse_spec_refuse_out_of_range_values(path, value):
    raw = set_path(copy.deepcopy(AGGREGATED), path, value)
    assert _errors(resource(raw)), path
    with pytest.raises(SpecError):
        parse_spec(raw)


def test_parsed_values():
    s = parse_spec(copy.deepcopy(PD))
    a = s.decode.autoscaling
    assert (a.mode, a.signal, a.min_replicas, a.keda.kv_utilization_target) == (
        "keda", "demand", 0, 0.85)
    assert s.disaggregated and s.scales_to_zero and s.flow_control_enabled
    assert s.prefill.autoscaling.keda.polling_interval_seconds == 5
    # operator and hpa keep their default signal
    assert parse_spec(_agg({"maxReplicas": 2, "target": 1})).decode.autoscaling.signal == (
        "waitingRequests")
    off = parse_spec(_agg({"maxReplicas": 2, "target": 1}))
    assert not off.scales_to_zero and not off.flow_control_enabled and off.keda is None
    # operator mode from zero: signal demand by default, the router holds the model
    zero = parse_spec(_agg({**KEDA0, "mode": "operator"}))
    assert (zero.decode.autoscaling.signal, zero.scales_to_zero, zero.flow_control_enabled,
            zero.keda) == ("demand", True, True, None)
    bands = parse_spec(_agg({**KEDA0, "minReplicas": 1,
                             "keda": {"bandTargets": {"2": 4, "-1": 16.5}}}))
    assert bands.decode.autoscaling.keda.band_targets == (("-1", 16.5), ("2", 4.0))
    assert bands.band_targets == ["-1", "2"] and bands.flow_control_enabled


# ---- the CRD's autoscaling block and parse_autoscaling agree, over random blocks ---------

def _autoscaling_schema() -> dict:
    return schema()["properties"]["spec"]["properties"]["decode"]["properties"]["autoscaling"]


def _random_block(rng) -> dict:
    d: dict = {"maxReplicas": rng.choice([1, 2, 4]), "target": rng.choice([0.5, 1, 3])}
    pick = {"mode": ["operator", "hpa", "keda"], "minReplicas": [0, 1, 2, 5],
            "signal": ["waitingRequests", "kvUtilization", "tokensPerSecond", "demand"],
            "scaleDownStabilizationSeconds": [0, 60]}
    for key, values in pick.items():
        if rng.random() < 0.6:
            d[key] = rng.choice(values)
    if rng.random() < 0.4:
        keda = {}
        for key, values in {"pollingIntervalSeconds": [1, 30], "cooldownPeriodSeconds": [0, 60],
                            "idleReplicas": [0], "kvUtilizationTarget": [0.5, 1],
                            "bandTargets": [{"3": 2}, {"-7": 0.5, "0": 8}]}.items():
            if rng.random() < 0.5:
                keda[key] = rng.choice(values)
        d["keda"] = keda
    return d


def test_random_autoscaling_blocks_cel_and_parse_agree():
    """1,500 seeded random blocks (every mode, minReplicas 0..5, every signal, keda fields):
    the CRD (schema after defaulting + the block's CEL rules) accepts exactly what
    `parse_autoscaling` accepts, and an accepted block's ScaledObject passes KEDA's CRD."""
    import random

    from openapi_schema_validator import OAS30Validator

    from tandem.operator.render.keda import scaled_object
    from tandem.operator.render.workload import Pool, Workload
    from tandem.operator.spec import PoolSpec
    from tandem.operator.spec_autoscaling import parse_autoscaling
    from tests.operator.crd_validate import cel_failures, crd_errors
    from tests.operator.manifests import OWNER

    node, rng = _autoscaling_schema(), random.Random(41)
    validator, seen = OAS30Validator(node), {True: 0, False: 0}
    model = parse_spec({"model": {"uri": "pvc://m"}})
    for _ in range(1500):
        block = _random_block(rng)
        defaulted = apply_defaults(node, copy.deepcopy(block))
        crd_ok = not list(validator.iter_errors(defaulted)) and not cel_failures(node, block)
        try:
            auto = parse_autoscaling(copy.deepcopy(block), "decode")
        except SpecError:
            auto = None
        assert crd_ok == (auto is not None), block
        assert auto is None or parse_autoscaling(defaulted, "decode") == auto, block
        seen[crd_ok] += 1
        if auto is not None and auto.mode == "keda":
            pool = Pool("worker", "both", PoolSpec(replicas=1, autoscaling=auto))
            so = scaled_object(model, OWNER, Workload.of(OWNER, pool))
            assert crd_errors(so) == [], (block, crd_errors(so))
            assert so["spec"]["minReplicaCount"] == auto.min_replicas
    assert min(seen.values()) > 300, seen  # both outcomes well covered
