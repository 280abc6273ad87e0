"""Rollout defaults by pool kind, and log levels as spec fields.

* A pool whose resources request nvidia.com/gpu replaces its pods one at a time (maxSurge 0,
  maxUnavailable 1; a multi-node pool's LeaderWorkerSet the same in its rolloutStrategy):
  a surge pod on a fully allocated GPU pool would never schedule. CPU pools and the router
  surge one pod first. An explicit bound wins; an unset one never leaves both at 0. The CRD
  no longer defaults the bounds (the API server would make every default explicit).
* `spec.logLevel` (and router / prefill / decode `logLevel`, which win) is `tandem
  --log-level LEVEL` ahead of the subcommand; unset, no flag (the CLI's INFO)."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tandem.operator.spec import SpecError, parse_spec
from tests.operator.manifests import K8S, by_kind, container, render, set_path
from tests.operator.samples import apply_defaults, resource, schema, spec
from tests.operator.test_crd import _errors, failed_rules

GPU = {"limits": {"nvidia.com/gpu": 1, "memory": "48Gi"}}
SURGE = {"maxSurge": 1, "maxUnavailable": 0}
ONE_AT_A_TIME = {"maxSurge": 0, "maxUnavailable": 1}


def strategies(raw: dict) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["strategy"]["rollingUpdate"]
            for d in by_kind(render(raw), "Deployment")}


def gpu_disaggregated() -> dict:
    raw = spec("disaggregated")
    raw["model"]["dtype"] = "bfloat16"
    raw["prefill"]["resources"] = copy.deepcopy(GPU)
    return raw  # prefill on a GPU, decode on CPUs


def test_gpu_pools_replace_one_at_a_time_cpu_pools_and_the_router_surge() -> None:
    assert strategies(gpu_disaggregated()) == {
        "demo-router": SURGE, "demo-prefill": ONE_AT_A_TIME, "demo-decode": SURGE}


@pytest.mark.parametrize(("given", "cpu", "gpu"), [
    ({"maxSurge": 2, "maxUnavailable": 0}, {"maxSurge": 2, "maxUnavailable": 0},
     {"maxSurge": 2, "maxUnavailable": 0}),  # explicit wins, on GPUs too
    ({"maxUnavailable": 0}, SURGE, SURGE),  # no unavailability: surge by one
    ({"maxSurge": 0}, ONE_AT_A_TIME, ONE_AT_A_TIME),  # no surge: one down at a time
    ({"maxSurge": "25%"}, {"maxSurge": "25%", "maxUnavailable": 0},
     {"maxSurge": "25%", "maxUnavailable": 1}),
    ({"maxUnavailable": "50%"}, {"maxSurge": 1, "maxUnavailable": "50%"},
     {"maxSurge": 0, "maxUnavailable": "50%"}),
], ids=["both", "unavailable-0", "surge-0", "surge-only", "unavailable-only"])
def test_an_explicit_bound_wins_and_the_other_keeps_the_rollout_moving(given, cpu, gpu) -> None:
    raw = gpu_disaggregated()
    raw["prefill"]["strategy"] = dict(given)
    raw["decode"]["strategy"] = dict(given)
    got = strategies(raw)
    assert (got["demo-decode"], got["demo-prefill"]) == (cpu, gpu)


def test_both_bounds_zero_is_still_refused() -> None:
    raw = set_path(gpu_disaggregated(), "prefill.strategy", {"maxSurge": 0, "maxUnavailable": 0})
    with pytest.raises(SpecError, match="cannot both be 0"):
        parse_spec(raw)
    assert "strategy: maxSurge and maxUnavailable cannot both be 0" in failed_rules(
        resource(raw))
    for one_bound in ({"maxSurge": 0}, {"maxUnavailable": 0}):
        assert failed_rules(resource(set_path(gpu_disaggregated(), "prefill.strategy",
                                              one_bound))) == []


def test_the_crd_leaves_the_bounds_unset_so_the_operator_picks_by_pool() -> None:
    raw = gpu_disaggregated()
    defaulted = apply_defaults(schema()["properties"]["spec"], copy.deepcopy(raw))
    assert defaulted["prefill"]["strategy"] == {} == defaulted["router"]["strategy"]
    assert parse_spec(defaulted) == parse_spec(raw)


def test_a_multi_node_gpu_pool_rolls_its_groups_one_at_a_time() -> None:
    raw = spec("aggregated")
    raw["model"]["dtype"] = "bfloat16"
    raw.setdefault("decode", {}).update(resources={"limits": {"nvidia.com/gpu": 8}},
                         parallelism={"tensor": 16})
    (lws,) = by_kind(render(raw), "LeaderWorkerSet")
    assert lws["spec"]["rolloutStrategy"] == {"type": "RollingUpdate",
                                              "rollingUpdateConfiguration": ONE_AT_A_TIME}


# ---- log levels ---------------------------------------------------------------------------

def args_by_name(raw: dict) -> dict[str, list[str]]:
    docs = render(raw)
    for d in docs:
        if d["kind"] in ("Deployment",):
            kubernetes_validate.validate(d, K8S, strict=True)
    return {d["metadata"]["name"]: container(d)["args"] for d in by_kind(docs, "Deployment")}


def test_no_log_level_renders_no_flag() -> None:
    for name, args in args_by_name(spec("disaggregated")).items():
        assert "--log-level" not in args, name
        assert args[0] in ("router", "worker")


def test_spec_log_level_reaches_every_pod_and_a_pools_own_wins() -> None:
    raw = spec("disaggregated")
    raw["logLevel"] = "DEBUG"
    raw["decode"]["logLevel"] = "WARNING"
    raw["router"]["logLevel"] = "ERROR"
    got = args_by_name(raw)
    assert got["demo-prefill"][:3] == ["--log-level", "DEBUG", "worker"]
    assert got["demo-decode"][:3] == ["--log-level", "WARNING", "worker"]
    assert got["demo-router"][:3] == ["--log-level", "ERROR", "router"]
    raw = spec("aggregated")
    raw["logLevel"] = "WARNING"
    assert args_by_name(raw)["demo-worker"][:3] == ["--log-level", "WARNING", "worker"]


def test_the_rendered_command_lines_parse_with_the_real_cli() -> None:
    """`tandem --log-level X router|worker ...` as the pods run it: the level is the top-level
    parser's and logging knows it."""
    import logging

    from tandem.cli import _command

    raw = spec("disaggregated")
    raw["logLevel"] = "DEBUG"
    for args in args_by_name(raw).values():
        assert _command(args) in ("router", "worker")
        assert isinstance(logging.getLevelName(args[1]), int)


@pytest.mark.parametrize("path", ["logLevel", "router.logLevel", "prefill.logLevel",
                                  "decode.logLevel"])
def test_an_unknown_log_level_is_refused_by_the_crd_and_the_parser(path: str) -> None:
    raw = set_path(spec("disaggregated"), path, "verbose")
    with pytest.raises(SpecError, match=r"logLevel: 'verbose' is not one of DEBUG, INFO"):
        parse_spec(raw)
    assert any(e.validator == "enum" for e in _errors(resource(raw)))
    ok = set_path(spec("disaggregated"), path, "INFO")
    assert _errors(resource(ok)) == [] and parse_spec(ok)

