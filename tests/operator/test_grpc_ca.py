"""`kvTransfer.tlsOwnCA`: the gRPC identity issued from a CA of the InferenceService's own
(cert-manager: self-signed Issuer -> CA Certificate -> CA Issuer -> the leaf Certificate, all
namespaced), so no other namespace can mint NAME.NAMESPACE.tandem.internal; the CRD and
parse_spec refuse it without tlsSecret or beside tlsIssuerRef; the operator may write
Issuers."""

from __future__ import annotations

import pytest
import yaml

from tandem.operator.kube import KINDS
from tandem.operator.render import Owner, render_all
from tandem.operator.spec import SpecError, parse_spec
from tandem.protocol.tls import peer_identity
from tests.chart.conftest import CHART
from tests.operator.samples import spec

RAW = {**spec("disaggregated"), "kvTransfer": {"tlsSecret": "kv-tls", "tlsOwnCA": True}}


def cert_manager(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]


def test_each_inference_service_gets_a_ca_chain_of_its_own() -> None:
    a = render_all(parse_spec(RAW), Owner("chat", "team-a", "u1"), image="t")
    b = render_all(parse_spec(RAW), Owner("chat", "team-b", "u2"), image="t")
    for docs, ns in ((a, "team-a"), (b, "team-b")):
        root, ca, ca_issuer, leaf = cert_manager(docs)
        assert [d["kind"] for d in (root, ca, ca_issuer, leaf)] == [
            "Issuer", "Certificate", "Issuer", "Certificate"]
        assert all(d["metadata"]["namespace"] == ns for d in (root, ca, ca_issuer, leaf))
        assert root["spec"] == {"selfSigned": {}}
        assert ca["spec"]["isCA"] is True
        assert ca["spec"]["issuerRef"] == {"name": "chat-grpc-selfsigned", "kind": "Issuer",
                                           "group": "cert-manager.io"}
        assert ca_issuer["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
        assert leaf["spec"]["issuerRef"] == {"name": "chat-grpc-ca", "kind": "Issuer",
                                             "group": "cert-manager.io"}
        assert leaf["spec"]["dnsNames"] == [peer_identity("chat", ns)]
        assert leaf["spec"]["secretName"] == "kv-tls"
        # issuers before the Certificates that name them, all before any pod
        kinds = [d["kind"] for d in docs]
        assert kinds.index("Deployment") > max(i for i, k in enumerate(kinds)
                                               if k in ("Issuer", "Certificate"))
    # no issuer is shared: every issuerRef is a namespaced Issuer of the same namespace
    for docs in (a, b):
        refs = [d["spec"]["issuerRef"] for d in cert_manager(docs) if "issuerRef" in d["spec"]]
        assert {r["kind"] for r in refs} == {"Issuer"}
    ca_a = {(d["metadata"]["namespace"], d["spec"]["secretName"]) for d in cert_manager(a)
            if d["kind"] == "Certificate" and d["spec"].get("isCA")}
    ca_b = {(d["metadata"]["namespace"], d["spec"]["secretName"]) for d in cert_manager(b)
            if d["kind"] == "Certificate" and d["spec"].get("isCA")}
    assert ca_a.isdisjoint(ca_b)
    # without tlsOwnCA: as before (a tlsIssuerRef's single Certificate, or none)
    plain = render_all(parse_spec(spec("disaggregated")), Owner("chat", "team-a", "u1"),
                       image="t")
    assert cert_manager(plain) == []


@pytest.mark.parametrize("kv", [{"tlsOwnCA": True},
                                {"tlsOwnCA": True, "tlsSecret": "s",
                                 "tlsIssuerRef": {"name": "x"}}])
def test_own_ca_needs_a_secret_and_no_issuer(kv: dict) -> None:
    with pytest.raises(SpecError, match="kvTransfer.tlsOwnCA needs kvTransfer.tlsSecret"):
        parse_spec({**spec("aggregated"), "kvTransfer": kv})


def test_the_operator_may_apply_issuers() -> None:
    assert KINDS["Issuer"].plural == "issuers"
    rbac = (CHART / "templates" / "rbac.yaml").read_text()
    assert 'resources: ["certificates", "issuers"]' in rbac
    crd = yaml.safe_load((CHART / "crds" / "inferenceservice.yaml").read_text())
    kv = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["kvTransfer"]["properties"]
    assert kv["tlsOwnCA"]["default"] is False
