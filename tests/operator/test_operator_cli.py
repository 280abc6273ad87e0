"""`tandem operator`'s arguments, the configuration it builds from the chart's environment,
and the kopf settings it runs with (the run itself: `test_operator_kmock`)."""

from __future__ import annotations

import argparse
import logging

import pytest

from tandem.operator.cli import add_operator_args, config_from, settings
from tandem.operator.render import DEFAULT_IMAGE


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_operator_args(p)
    return p.parse_args(argv)


def test_the_charts_arguments():
    args = parse("--standalone", "--namespace=team-a", "--namespace=team-b",
                 "--liveness=http://0.0.0.0:8080/healthz")
    assert args.standalone and not args.all_namespaces
    assert args.namespace == ["team-a", "team-b"]
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert parse("--standalone", "--all-namespaces").all_namespaces


def test_all_namespaces_and_a_namespace_exclude_each_other():
    with pytest.raises(SystemExit):
        parse("--all-namespaces", "--namespace=a")


@pytest.mark.parametrize("flag", ["--status-interval", "--autoscale-interval",
                                  "--resync-interval"])
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_timer_interval_must_be_positive_seconds(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        parse("-A", flag, value)
    assert info.value.code == 2
    assert "number of seconds > 0" in capsys.readouterr().err


def test_config_takes_the_childrens_image_from_the_environment():
    args = parse("-A", "--status-interval", "5", "--autoscale-interval", "30",
                 "--resync-interval", "120")
    cfg = config_from(args, {"TANDEM_IMAGE": "registry.example/tandem:1.2",
                             "TANDEM_IMAGE_PULL_POLICY": "Always"})
    assert (cfg.image, cfg.image_pull_policy) == ("registry.example/tandem:1.2", "Always")
    assert (cfg.status_interval_s, cfg.autoscale_interval_s, cfg.resync_interval_s) == (
        5.0, 30.0, 120.0)
    assert cfg.metrics is None  # scrape the pods over HTTP
    cfg = config_from(args, {})
    assert (cfg.image, cfg.image_pull_policy) == (DEFAULT_IMAGE, None)


def test_kopf_settings():
    s = settings()
    assert s.persistence.finalizer == "tandem.dev/operator"
    assert s.posting.level == logging.WARNING
    assert s.background.cancellation_polling <= 1  # a delete mid-tick is not held a minute


def test_leader_election_arguments():
    from tandem.operator.cli import lease_from

    assert lease_from(parse("-A"), {}) is None
    args = parse("-A", "--leader-elect", "--lease-name", "ops", "--lease-duration", "20",
                 "--renew-deadline", "12", "--retry-period", "3")
    lease = lease_from(args, {"TANDEM_OPERATOR_NAMESPACE": "tandem-system"})
    assert (lease.name, lease.namespace, lease.duration_s, lease.renew_deadline_s,
            lease.retry_s) == ("ops", "tandem-system", 20, 12.0, 3.0)
    other = lease_from(args, {"TANDEM_OPERATOR_NAMESPACE": "tandem-system"})
    assert lease.identity != other.identity  # a restarted replica is a new candidate
    assert lease_from(parse("-A", "--leader-elect", "--lease-namespace", "x"), {}).namespace == "x"
    with pytest.raises(SystemExit, match="needs --lease-namespace"):
        lease_from(parse("-A", "--leader-elect"), {})
    with pytest.raises(SystemExit, match="lease duration > renew deadline"):
        lease_from(parse("-A", "--leader-elect", "--renew-deadline", "20"), {
            "TANDEM_OPERATOR_NAMESPACE": "ns"})
