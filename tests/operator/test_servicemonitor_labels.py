"""`spec.monitoring.labels`: labels added to the ServiceMonitor, so a Prometheus whose
serviceMonitorSelector asks for them (kube-prometheus-stack's: `release: <its Helm release>`)
selects it. Never in place of the operator's own labels: a key the operator sets, or one
under tandem.dev/, is refused naming the field, as is a key or value that is not a
Kubernetes label's (by the CRD's schema and CEL rule where they can say it, and by the
operator's spec parsing). Unset, the ServiceMonitor carries the operator's labels only."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any
from unittest import mock

import pytest
import yaml

from tandem.cli import build_parser
from tandem.operator.crd_schema import Invalid, check
from tandem.operator.dryrun import run
from tandem.operator.render import Owner, render_all
from tandem.operator.render.common import all_labels
from tandem.operator.spec import OPERATOR_LABELS, SpecError, parse_spec
from tests.operator.manifests import by_kind
from tests.operator.samples import resource
from tests.operator.test_crd import failed_rules

OWNER = Owner("demo", "ml", "u-1")
RELEASE = {"release": "kube-prometheus-stack"}


def raw(labels: Any = None, service_monitor: bool = True) -> dict[str, Any]:
    mon: dict[str, Any] = {"serviceMonitor": service_monitor}
    if labels is not None:
        mon["labels"] = labels
    return {"model": {"uri": "SmolLM2-135M-Instruct"}, "monitoring": mon}


def service_monitor_labels(spec: dict[str, Any]) -> dict[str, str]:
    (sm,) = by_kind(render_all(parse_spec(spec), OWNER, image="t"), "ServiceMonitor")
    return sm["metadata"]["labels"]


def test_the_service_monitor_carries_the_labels_beside_the_operators():
    own = all_labels(OWNER, "metrics")
    labels = {**RELEASE, "team": "ml", "example.com/tier": ""}
    assert service_monitor_labels(raw(labels)) == {**own, **labels}
    assert service_monitor_labels(raw()) == own  # unset: no release guessed
    docs = render_all(parse_spec(raw(labels)), OWNER, image="t")
    # only the ServiceMonitor: its selector, and every other child's labels, are unchanged
    assert all("team" not in d["metadata"]["labels"] for d in docs
               if d["kind"] != "ServiceMonitor")
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"] == {"tandem.dev/inference-service": "demo"}
    # without a ServiceMonitor, nothing carries them
    docs = render_all(parse_spec(raw(RELEASE, service_monitor=False)), OWNER, image="t")
    assert by_kind(docs, "ServiceMonitor") == []
    assert all("release" not in d["metadata"].get("labels", {}) for d in docs)


def test_the_operator_labels_parse_spec_refuses_are_those_it_renders():
    rendered = set(all_labels(OWNER, "metrics"))
    assert set(OPERATOR_LABELS) == {k for k in rendered if not k.startswith("tandem.dev/")}


@pytest.mark.parametrize("labels, message", [
    ({"app.kubernetes.io/name": "x"},
     "monitoring.labels: 'app.kubernetes.io/name' is a label the operator sets"),
    ({"app.kubernetes.io/managed-by": "helm"},
     "monitoring.labels: 'app.kubernetes.io/managed-by' is a label the operator sets"),
    ({"tandem.dev/inference-service": "other"},
     "monitoring.labels: 'tandem.dev/inference-service': keys under tandem.dev/ are the "
     "operator's"),
    ({"bad key": "x"}, "monitoring.labels: 'bad key' is not a valid key"),
    ({"-release": "x"}, "monitoring.labels: '-release' is not a valid key"),
    ({"a" * 64: "x"}, f"monitoring.labels: {'a' * 64!r} is not a valid key"),
    ({"Example.com/team": "x"}, "monitoring.labels: 'Example.com/team' is not a valid key"),
    ({"release": "kube prometheus"},
     "monitoring.labels.release: 'kube prometheus' is not a valid value"),
    ({"release": "x" * 64}, f"monitoring.labels.release: {'x' * 64!r} is not a valid value"),
    ({"release": 1}, "monitoring.labels.release: 1 is not a valid value"),
    (["release"], "monitoring.labels: expected dict, got ['release']"),
])
def test_parse_spec_refuses_a_label_naming_the_field(labels: Any, message: str):
    with pytest.raises(SpecError) as e:
        parse_spec(raw(labels))
    assert str(e.value) == message


@pytest.mark.parametrize("value, reason", [
    ("kube prometheus", 'Invalid value: "kube prometheus": spec.monitoring.labels[release] in '
     "body should match '^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$'"),
    ("x" * 64, "Too long: may not be more than 63 bytes"),
    (1, 'Invalid value: 1: spec.monitoring.labels[release] in body must be of type string: '
     '"integer"'),
])
def test_the_crd_schema_refuses_a_bad_value_with_its_path(value: Any, reason: str):
    with pytest.raises(Invalid) as e:
        check(resource(raw({"release": value})))
    assert e.value.errors == (f"spec.monitoring.labels[release]: {reason}",)
    check(resource(raw(RELEASE)))  # a good one passes


def test_the_crd_refuses_more_than_64_labels():
    with pytest.raises(Invalid) as e:
        check(resource(raw({f"l{i}": "x" for i in range(65)})))
    assert e.value.errors[0].startswith("spec.monitoring.labels: Too many: 65: must have at most "
                                        "64 items")


def test_the_crd_cel_rule_refuses_tandem_dev_keys():
    assert failed_rules(resource(raw(RELEASE))) == []
    assert failed_rules(resource(raw({"tandem.dev/role": "x"}))) == [
        "monitoring.labels: keys under tandem.dev/ are the operator's"]


def render_cli(doc: dict[str, Any]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `tandem render -f -` on `doc`, with no TANDEM_*
    variable set."""
    args = build_parser().parse_args(["render", "-f", "-"])
    out, err = io.StringIO(), io.StringIO()
    bare = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, bare, clear=True):
        code = run(args, stdin=io.StringIO(yaml.safe_dump(doc)), stdout=out)
    return code, out.getvalue(), err.getvalue()


def test_tandem_render_applies_the_labels_and_refuses_an_operator_key():
    code, out, err = render_cli(resource(raw(RELEASE)))
    assert (code, err) == (0, "")
    (sm,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    code, out, err = render_cli(resource(raw({"app.kubernetes.io/instance": "x"})))
    assert (code, out) == (1, "")
    assert err == ('tandem render: stdin: InferenceService "demo": InvalidSpec: '
                   "monitoring.labels: 'app.kubernetes.io/instance' is a label the operator "
                   "sets\n")
