"""`spec.router.flowControl` -> router.yaml `flow_control` (the keys of the router's contract,
only the fields the spec sets; the router's defaults for the rest), and what a change does
to the routers (a new router.yaml rolls them through the config hash)."""

from __future__ import annotations

import copy

import yaml

from tandem.operator.render.common import CONFIG_HASH
from tests.operator.manifests import one, render
from tests.operator.test_keda_spec import FLOW


def _cfg(raw: dict) -> dict:
    docs = render(raw)
    return yaml.safe_load(one(docs, "ConfigMap", "demo-router-config")["data"]["router.yaml"])


def _hash(raw: dict) -> str:
    dep = one(render(raw), "Deployment", "demo-router")
    return dep["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]


BASE = {"model": {"uri": "pvc://models/m"}, "router": {"managedRedis": True}}


def test_every_field_renders_to_the_routers_key():
    raw = copy.deepcopy(BASE)
    raw["router"]["flowControl"] = copy.deepcopy(FLOW)
    cfg = _cfg(raw)
    assert cfg["flow_control"] == {
        "enabled": True, "fairness": "round-robin", "ordering": "edf", "ttl_s": 12.5,
        "saturation": {"waiting": 3, "kv": 0.8},
        "bands": {"default": {"max_requests": 100, "max_bytes": 1048576},
                  2: {"max_requests": 5}, -1: {"max_bytes": 4096}},
        "tenant_weights": {"free": 0.5, "gold": 4.0}, "shared": True}
    assert "served_models" not in cfg  # no pool scales to zero: nothing to hold
    assert cfg["redis"] == "env:TANDEM_REDIS_URL"  # the shared queue's Redis


def test_only_the_fields_set_are_rendered():
    raw = copy.deepcopy(BASE)
    raw["router"]["flowControl"] = {"enabled": True, "saturation": {"kv": 0.95}}
    assert _cfg(raw)["flow_control"] == {"enabled": True, "saturation": {"kv": 0.95}}
    raw["router"]["flowControl"] = {"tenantWeights": {"gold": 2}}  # set, but not enabled
    assert _cfg(raw)["flow_control"] == {"enabled": False, "tenant_weights": {"gold": 2.0}}


def test_unset_keeps_router_yaml_and_the_routers_as_they_were():
    cfg = _cfg(BASE)
    assert "flow_control" not in cfg and "served_models" not in cfg
    raw = copy.deepcopy(BASE)
    raw["router"]["flowControl"] = {"startTimeoutSeconds": 300}  # its default: no change
    assert _cfg(raw) == cfg and _hash(raw) == _hash(BASE)
    raw["router"]["flowControl"] = {"enabled": True}
    assert _hash(raw) != _hash(BASE)  # a new router.yaml rolls the routers
