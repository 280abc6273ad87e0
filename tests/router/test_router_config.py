"""`tandem router` arguments + router.yaml -> the router's settings."""

from __future__ import annotations

import argparse

import pytest

from tandem.protocol.bundled import BUNDLED_NAME
from tandem.router.config import RouterConfigError
from tandem.router.main import add_router_args, build, run
from tandem.router.policy import DEFAULT_WEIGHTS


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


def test_yaml_config_and_flags(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000, http://b:8000]\npolicy: least-loaded\n"
                   "saturation_queue: 3\nretries: 5\nmax_tokens_cap: 256\n"
                   "weights: {prefix: 3.0, queue: 1.0, lora_affinity: 0}\n")
    _, router, server = build(_args("--config", str(cfg)))
    assert server.worker_urls == ["http://a:8000", "http://b:8000"]
    assert router.settings.policy == "least-loaded" and router.settings.saturation_queue == 3
    assert server.proxy.retries == 5 and server.max_tokens_cap == 256
    # flags win over the file
    _, router, server = build(_args("--config", str(cfg), "--policy", "cache-aware",
                                    "--workers", "http://c:1", "--retries", "0"))
    assert router.settings.policy == "cache-aware" and server.worker_urls == ["http://c:1"]
    assert server.proxy.retries == 0
    # weights over the defaults: the ones left out keep theirs, 0 switches one off
    assert [(s.name, w) for s, w in router.policy.scorers] == [
        ("prefix", 3.0), ("queue", 1.0), ("kv_usage", 0.5), ("inflight_tokens", 0.5),
        ("cache_churn", 1.0)]
    assert router.settings.weights == {**DEFAULT_WEIGHTS, "prefix": 3.0, "lora_affinity": 0.0}


def test_unknown_scorer_in_config_fails_at_start(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("weights: {prefix: 1.0, astrology: 1.0}\n")
    with pytest.raises(RouterConfigError, match=f'^{cfg}: unknown key "weights.astrology" '
                       r"\(known: cache_churn, cost, inflight_tokens, kv_usage, "
                       r"lora_affinity, prefix, queue, session_affinity\)$"):
        build(_args("--config", str(cfg)))


def test_tokenizers_by_model(tmp_path):
    _, router, _ = build(_args())
    assert router.tokenizer_for(BUNDLED_NAME) is not None  # the bundled model, by default
    assert router.tokenizer_for("some-other-model") is None  # approximate mode


def test_malformed_redis_urls_stop_start_up_with_the_flag_named(tmp_path):
    with pytest.raises(SystemExit, match="--index: Redis URL must specify"):
        build(_args("--workers", "http://a:8000", "--index", "foo://bar"))
    cfg = tmp_path / "router.yaml"
    cfg.write_text("rate_limits: {default: {requests_per_s: 1}}\n")
    with pytest.raises(SystemExit, match="--redis: Redis URL must specify"):
        build(_args("--workers", "http://a:8000", "--config", str(cfg), "--redis", "x://y"))


@pytest.mark.parametrize(("key", "default", "in_yaml", "by_flag"), [
    ("pd_max_prefill_queue", 0, 4, 2),
    ("pd_max_local_prefill", 1024, 512, 0),
])
def test_pd_bounds_from_yaml_and_flag(tmp_path, key, default, in_yaml, by_flag):
    flag_name = "--" + key.replace("_", "-")
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"workers: [http://a:8000]\n{key}: {in_yaml}\n")
    assert getattr(build(_args("--workers", "http://a:1"))[1].settings, key) == default
    assert getattr(build(_args("--config", str(cfg)))[1].settings, key) == in_yaml
    flag = build(_args("--config", str(cfg), flag_name, str(by_flag)))[1]
    assert getattr(flag.settings, key) == by_flag
    with pytest.raises(SystemExit):
        build(_args("--workers", "http://a:1", flag_name, "-1"))


def test_pd_stall_budget_from_yaml_and_flag(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000]\npd_stall_budget: 0.02\n")
    assert build(_args("--workers", "http://a:1"))[1].settings.pd_stall_budget == 0.005
    assert build(_args("--config", str(cfg)))[1].settings.pd_stall_budget == 0.02
    settings = build(_args("--config", str(cfg), "--pd-stall-budget", "0"))[1].settings
    assert settings.pd_stall_budget == 0.0
    for bad in ("-0.1", "1", "nan"):
        with pytest.raises(SystemExit, match="pd_stall_budget: a share in"):
            build(_args("--workers", "http://a:1", "--pd-stall-budget", bad))
    cfg.write_text("workers: [http://a:8000]\npd_stall_budget: 1.5\n")
    with pytest.raises(RouterConfigError, match="pd_stall_budget"):
        build(_args("--config", str(cfg)))


def test_pd_decision_and_itl_weight_from_yaml_and_flag(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000]\npd_decision: threshold\npd_itl_weight: 2.5\n")
    settings = build(_args("--workers", "http://a:1"))[1].settings
    assert (settings.pd_decision, settings.pd_itl_weight) == ("cost", 1.0)
    settings = build(_args("--config", str(cfg)))[1].settings
    assert (settings.pd_decision, settings.pd_itl_weight) == ("threshold", 2.5)
    settings = build(_args("--config", str(cfg), "--pd-decision", "cost",
                           "--pd-itl-weight", "0"))[1].settings
    assert (settings.pd_decision, settings.pd_itl_weight) == ("cost", 0.0)
    for bad in ("-1", "nan", "1001"):
        with pytest.raises(SystemExit, match="pd_itl_weight: a number in"):
            build(_args("--workers", "http://a:1", "--pd-itl-weight", bad))
    with pytest.raises(SystemExit):  # argparse: exit 2
        build(_args("--workers", "http://a:1", "--pd-decision", "sometimes"))
    cfg.write_text("workers: [http://a:8000]\npd_decision: sometimes\n")
    with pytest.raises(RouterConfigError, match="pd_decision"):
        build(_args("--config", str(cfg)))
    cfg.write_text("workers: [http://a:8000]\npd_itl_weight: -1\n")
    with pytest.raises(RouterConfigError, match="pd_itl_weight"):
        build(_args("--config", str(cfg)))


def test_pd_threshold_from_yaml_and_flag(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000]\npd_threshold: 128\n")
    assert build(_args("--workers", "http://a:1"))[1].settings.pd_threshold == 16
    assert build(_args("--config", str(cfg)))[1].settings.pd_threshold == 128
    assert build(_args("--config", str(cfg), "--pd-threshold", "0"))[1].settings.pd_threshold == 0
    with pytest.raises(SystemExit):
        build(_args("--workers", "http://a:1", "--pd-threshold", "-1"))


def test_churn_half_life_and_processes_are_checked_at_start(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:8000]\nchurn_half_life_s: 12.5\n")
    assert build(_args("--config", str(cfg)))[1].churn.half_life_s == 12.5
    for bad, why in (("0", "greater than 0, not 0"), ("-3", "greater than 0, not -3"),
                     ("'soon'", "a valid number, not 'soon'"),
                     ("true", "a valid number, not True")):
        cfg.write_text(f"workers: [http://a:8000]\nchurn_half_life_s: {bad}\n")
        with pytest.raises(RouterConfigError, match=f"churn_half_life_s: input should be {why}$"):
            build(_args("--config", str(cfg)))
    with pytest.raises(SystemExit, match="processes: a process count >= 1, not 0"):
        run(_args("--workers", "http://a:1", "--processes", "0"))
    cfg.write_text("workers: [http://a:8000]\nprocesses: two\n")
    with pytest.raises(RouterConfigError, match="processes: input should be a valid integer, "
                       "not 'two'"):
        run(_args("--config", str(cfg)))
    with pytest.raises(SystemExit, match="needs the lean HTTP server"):
        run(_args("--workers", "http://a:1", "--processes", "2", "--http-server", "uvicorn"))


def test_peer_pull_is_on_by_default_only_with_a_worker_key(tmp_path):
    from tests.serving.helpers import worker_key_file

    key = worker_key_file(tmp_path)
    base = ("--workers", "http://a:1")
    assert build(_args(*base))[1].settings.peer_pull is False  # nothing signs the peer
    assert build(_args(*base, "--worker-auth-key-file", key))[1].settings.peer_pull is True
    assert build(_args(*base, "--worker-auth-key-file", key, "--no-peer-pull")
                 )[1].settings.peer_pull is False
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: [http://a:1]\npeer_pull: false\n")
    keyed = ("--config", str(cfg), "--worker-auth-key-file", key)
    assert build(_args(*keyed))[1].settings.peer_pull is False
    assert build(_args(*keyed, "--peer-pull"))[1].settings.peer_pull is True
    cfg.write_text("workers: [http://a:1]\npeer_pull: 3\n")
    with pytest.raises(RouterConfigError, match="peer_pull"):
        build(_args("--config", str(cfg)))
