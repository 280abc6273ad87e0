"""router.yaml is checked like the command line: an unknown key at any level or a bad value
is refused with its path (`tandem router` / `tandem serve`: a usage error, exit 2, before
anything binds); `weights` are merged over the defaults; and every router.yaml the operator
renders (each chart example, each shared sample spec) loads unchanged."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.operator.render import Owner, render_all
from tandem.operator.spec import parse_spec
from tandem.router.config import RouterConfig, RouterConfigError, check_config, load_config
from tandem.router.main import add_router_args, build
from tandem.router.policy import DEFAULT_WEIGHTS
from tests.operator.samples import SPECS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "charts" / "tandem" / "examples").glob("*.yaml"))
TANDEM = Path(sys.executable).with_name("tandem")
TOP = ", ".join(sorted(RouterConfig.model_fields))


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("data", "message"), [
    ({"polcy": "random"},
     f'unknown key "polcy" (did you mean "policy"? known: {TOP})'),
    ({"weights": {"foo": 1}}, 'unknown key "weights.foo" (known: cache_churn, cost, '
     "inflight_tokens, kv_usage, lora_affinity, prefix, queue, session_affinity)"),
    ({"rate_limits": {"tenant": {}}},
     'unknown key "rate_limits.tenant" (did you mean "tenants"? known: default, tenants)'),
    ({"rate_limits": {"tenants": {"batch": {"rps": 1}}}},
     'unknown key "rate_limits.tenants.batch.rps" (known: burst_requests, requests_per_s, '
     "tokens_per_min)"),
    ({"priority": {"default": {"mni": 0}}},
     'unknown key "priority.default.mni" (did you mean "min"? known: default, max, min)'),
    ({"policy": "fastest"}, "policy: input should be 'cache-aware', 'cost', 'least-loaded', "
     "'random' or 'round-robin', not 'fastest'"),
    ({"weights": {"prefix": -1}},
     "weights.prefix: input should be greater than or equal to 0, not -1"),
    ({"saturation_kv": 1.5}, "saturation_kv: input should be less than or equal to 1, not 1.5"),
    ({"retries": "3"}, "retries: input should be a valid integer, not '3'"),
    ({"debug_headers": "yes"}, "debug_headers: input should be a valid boolean, not 'yes'"),
    ({"max_body_bytes": 0}, "max_body_bytes: input should be greater than or equal to 1, not 0"),
    ({"workers": "http://a:8000"}, "workers: input should be a valid list, not 'http://a:8000'"),
    ({"tokenizers": {"m": 3}}, "tokenizers.m: input should be a valid string, not 3"),
    ({"priority": {"tenants": {"batch": {"min": 5, "max": 1}}}},
     "priority.tenants.batch: expected min <= default <= max, got 5, 0, 1"),
    (["policy"], "expected a mapping of keys, not ['policy']"),
])
def test_a_bad_key_or_value_is_refused_with_its_path(data, message):
    with pytest.raises(RouterConfigError) as err:
        check_config(data)
    assert str(err.value) == f"router.yaml: {message}"


def test_unreadable_files_and_empty_values(tmp_path):
    with pytest.raises(RouterConfigError, match=r"^--config .*missing.yaml: No such file"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "router.yaml"
    bad.write_text("policy: [random\n")
    with pytest.raises(RouterConfigError, match=r"router.yaml: not valid YAML \(line 2\)"):
        load_config(str(bad))
    bad.write_bytes(b"policy: random\n\xff\xfe")  # a binary file: one line, not a traceback
    with pytest.raises(RouterConfigError,
                       match=r"router.yaml: not UTF-8 text \(byte 15: invalid start byte\)$"):
        load_config(str(bad))
    bad.write_text("")
    assert load_config(str(bad)) == {}
    bad.write_text("max_tokens_cap:\npolicy: random\n")  # an empty value: unset
    assert load_config(str(bad)) == {"policy": "random"}


def test_partial_weights_keep_the_other_defaults_and_zero_switches_one_off(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000]\npolicy: cache-aware\n"
                   "weights: {prefix: 4, queue: 0}\n")
    _, router, _ = build(_args("--config", str(cfg)))
    assert router.settings.weights == {**DEFAULT_WEIGHTS, "prefix": 4.0, "queue": 0.0}
    assert [(s.name, w) for s, w in router.policy.scorers] == [
        (name, 4.0 if name == "prefix" else w) for name, w in DEFAULT_WEIGHTS.items()
        if name != "queue"]
    _, router, _ = build(_args("--workers", "http://a:8000", "--policy", "cache-aware"))
    # no weights: the defaults
    assert [(s.name, w) for s, w in router.policy.scorers] == list(DEFAULT_WEIGHTS.items())


def _free_port_held() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("command", ["router", "serve"])
def test_the_cli_refuses_a_bad_router_yaml_as_a_usage_error_before_binding(tmp_path, command):
    """Exit 2 with argparse's usage line and one error line, no traceback; the port is
    held by another listener, so a config checked after binding would say that instead."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000]\nweights: {prefix: 1, astrology: 2}\n")
    with _free_port_held() as held:
        proc = subprocess.run([str(TANDEM), command, "--config", str(cfg),
                               "--port", str(held.getsockname()[1])],
                              capture_output=True, text=True, timeout=60)
    usage = {"router": "tandem router [options]", "serve": "tandem serve [MODEL] [options]"}
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"usage: {usage[command]}",
        f'tandem {command}: error: {cfg}: unknown key "weights.astrology" (known: '
        "cache_churn, cost, inflight_tokens, kv_usage, lora_affinity, prefix, queue, "
        "session_affinity)"]
    assert proc.stdout == ""


def _rendered_router_yaml(name: str, spec: dict) -> str:
    owner = Owner(name, "ml", "6f1c2b0e-7a55-4d8e-9b21-0c3d4e5f6a7b")
    docs = render_all(parse_spec(spec), owner, image="registry.example/tandem:1.0")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"  # the picker's in gateway mode
                     and d["metadata"]["name"] in (f"{name}-router-config", f"{name}-epp-config")]
    return config_map["data"]["router.yaml"]


SOURCES = [(p.stem, yaml.safe_load(p.read_text())) for p in EXAMPLES] + [
    (f"sample-{k}", {"metadata": {"name": "demo"}, "spec": v}) for k, v in SPECS.items()]


@pytest.mark.parametrize(("name", "source"), SOURCES, ids=[n for n, _ in SOURCES])
def test_the_operators_router_yaml_loads_with_the_routers_loader(tmp_path, name, source):
    """Each chart example and shared sample spec: the ConfigMap's router.yaml passes the
    router's real loader with nothing dropped, and its weights (the CRD's, a missing one at
    its default) are the whole set."""
    text = _rendered_router_yaml(source["metadata"]["name"], source["spec"])
    path = tmp_path / "router.yaml"
    path.write_text(text)
    raw = yaml.safe_load(text)
    assert load_config(str(path)) == raw
    if "weights" in raw:  # the cache-aware scorers', the cost scorer's and the session weight
        assert set(raw["weights"]) == set(DEFAULT_WEIGHTS) | {"cost", "session_affinity"}


def test_the_sources_cover_every_key_the_operator_renders():
    """The parametrized sources above exercise weights, rate limits (tenants too) and Redis."""
    keys: set[str] = set()
    for _, source in SOURCES:
        cfg = yaml.safe_load(_rendered_router_yaml(source["metadata"]["name"], source["spec"]))
        keys |= set(cfg) | {f"rate_limits.{k}" for k in cfg.get("rate_limits", {})}
    assert {"weights", "rate_limits.default", "rate_limits.tenants", "redis", "index",
            "redis_key_prefix", "tokenizers", "policy", "pd_threshold",
            "worker_port_name", "flow_control", "served_models"} <= keys
    assert len(EXAMPLES) >= 5


def test_docs_router_yaml_example_loads_and_the_page_names_every_key():
    """docs/router.md: its router.yaml example passes the loader, and the example with the
    "other keys" sentence names exactly `RouterConfig`'s keys."""
    page = (ROOT / "docs" / "router.md").read_text(encoding="utf-8")
    section = page[page.index("## router.yaml"):]
    section = section[:section.index("\n## ", 1)]
    example = section[section.index("```yaml\n") + 8:section.index("```\n", 1)]
    cfg = check_config(yaml.safe_load(example))
    others = section[section.index("The other keys:"):]
    others = others[:others.index(". The operator")]
    named = set(cfg) | set(re.findall(r"`([a-z_]+)`", others))
    assert named == set(RouterConfig.model_fields)
