"""Client authentication on the endpoint picker's gRPC port: with `--ext-proc-tls-client-ca`
only clients presenting a certificate that CA issued get through the TLS handshake (ext_proc
and the health services alike); with `--ext-proc-allowed-client` only those whose
certificate names an allowed identity are served, others get PERMISSION_DENIED. Real
certificates made at test time (`tests.protocol.certs`), a real gRPC server and client."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.router.extproc.settings import ExtProcSettings
from tests.protocol.certs import CA
from tests.router.extproc_client import Envoy, EppRouter
from tests.router.stub_worker import StubWorker
from tests.serving.helpers import free_port

MODEL = "stub-model"
SPIFFE = "spiffe://cluster.local/ns/gateway/sa/envoy"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The picker's CA (server and client certificates) and a stranger's CA."""
    d = tmp_path_factory.mktemp("epp-pki")
    ca, other = CA("epp-ca"), CA("other-ca")
    cert, key = ca.issue("epp")
    for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca.pem)):
        (d / name).write_bytes(data)
    return d, ca, other


@pytest.fixture(scope="module")
def epp(pki):
    d, _, _ = pki
    worker = StubWorker(free_port())
    r = EppRouter([worker.url], ext=ExtProcSettings(
        port=0, host="127.0.0.1", tls_cert=str(d / "tls.crt"), tls_key=str(d / "tls.key"),
        tls_client_ca=str(d / "ca.crt"), allowed_clients=("gateway.example", SPIFFE)))
    r.wait_routable(1)
    yield r
    r.stop()
    worker.stop()


def _creds(ca: CA, client: tuple[bytes, bytes] | None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.pem)
    cert, key = client
    return grpc.ssl_channel_credentials(root_certificates=ca.pem, private_key=key,
                                        certificate_chain=cert)


def _health(target: str, creds: grpc.ChannelCredentials, service: str = "liveness") -> int:
    """One Check on a new connection (a handshake of its own)."""
    with grpc.secure_channel(target, creds,
                             options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _complete(target: str, creds: grpc.ChannelCredentials) -> int | None:
    envoy = Envoy(target, creds)
    try:
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 5}).encode()
        return envoy.request("/v1/completions", body).status
    finally:
        envoy.close()


def test_a_client_certificate_of_the_ca_naming_an_allowed_client_is_served(epp, pki) -> None:
    _, ca, _ = pki
    serving = health_pb2.HealthCheckResponse.SERVING
    for client in (ca.issue("gateway.example"),  # the subject CN names it
                   ca.issue("envoy", sans=("localhost", SPIFFE)),  # a SAN URI (SPIFFE id)
                   ca.issue("envoy", sans=("gateway.example",))):  # a SAN DNS name
        creds = _creds(ca, client)
        assert _health(epp.target, creds) == serving
        assert _complete(epp.target, creds) == 200


def test_no_client_certificate_or_one_of_another_ca_fails_the_handshake(epp, pki) -> None:
    _, ca, other = pki
    for creds in (_creds(ca, None), _creds(ca, other.issue("gateway.example"))):
        for call in (lambda c: _health(epp.target, c), lambda c: _complete(epp.target, c)):
            with pytest.raises(grpc.RpcError) as err:
                call(creds)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE  # no RPC ever ran


def test_a_certificate_naming_no_allowed_client_is_permission_denied(epp, pki) -> None:
    _, ca, _ = pki
    before = epp.metric("tandem_router_extproc_streams_total")
    for client in (ca.issue("intruder"), ca.issue("envoy", sans=(SPIFFE + "-x",)),
                   ca.issue("gateway.example.evil", sans=("evil.gateway.example",))):
        creds = _creds(ca, client)
        for call in (lambda c: _health(epp.target, c), lambda c: _complete(epp.target, c)):
            with pytest.raises(grpc.RpcError) as err:
                call(creds)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "not an allowed" in err.value.details()
    assert epp.metric("tandem_router_extproc_streams_total") == before  # no stream began


def test_mutual_tls_without_allowed_names_serves_any_certificate_of_the_ca(pki) -> None:
    d, ca, other = pki
    worker = StubWorker(free_port())
    r = EppRouter([worker.url], ext=ExtProcSettings(
        port=0, host="127.0.0.1", tls_cert=str(d / "tls.crt"), tls_key=str(d / "tls.key"),
        tls_client_ca=str(d / "ca.crt")))
    try:
        r.wait_routable(1)
        assert _complete(r.target, _creds(ca, ca.issue("anyone"))) == 200
        with pytest.raises(grpc.RpcError) as err:
            _health(r.target, _creds(ca, other.issue("anyone")))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        r.stop()
        worker.stop()


def test_flags_and_router_yaml_configure_client_authentication(tmp_path, pki) -> None:
    import argparse

    import yaml

    from tandem.router.config import RouterConfigError, check_config
    from tandem.router.main import add_router_args, ext_proc_settings

    d, _, _ = pki
    p = argparse.ArgumentParser()
    add_router_args(p)
    tls = ["--ext-proc-port", "9002", "--ext-proc-tls-cert", str(d / "tls.crt"),
           "--ext-proc-tls-key", str(d / "tls.key")]
    got = ext_proc_settings(p.parse_args([*tls, "--ext-proc-tls-client-ca", str(d / "ca.crt"),
                                          "--ext-proc-allowed-client", "a",
                                          "--ext-proc-allowed-client", SPIFFE]), {})
    assert (got.tls_client_ca, got.allowed_clients) == (str(d / "ca.crt"), ("a", SPIFFE))
    cfg = check_config(yaml.safe_load(
        f"ext_proc_tls_client_ca: {d / 'ca.crt'}\next_proc_allowed_clients: [gw]\n"))
    got = ext_proc_settings(p.parse_args(tls), cfg)
    assert (got.tls_client_ca, got.allowed_clients) == (str(d / "ca.crt"), ("gw",))
    for bad, named in (({"ext_proc_allowed_clients": []}, "ext_proc_allowed_clients"),
                       ({"ext_proc_allowed_clients": [""]}, "ext_proc_allowed_clients.0"),
                       ({"ext_proc_tls_client_ca": 3}, "ext_proc_tls_client_ca")):
        with pytest.raises(RouterConfigError, match=named):
            check_config(bad)
    ca_flag = ["--ext-proc-tls-client-ca", str(d / "ca.crt")]
    for argv, message in (
            (["--ext-proc-port", "9002", *ca_flag], "needs --ext-proc-tls-cert"),
            ([*tls, "--ext-proc-allowed-client", "a"], "needs --ext-proc-tls-client-ca"),
            ([*tls, "--ext-proc-tls-client-ca", str(tmp_path / "none")], "cannot read"),
            (ca_flag, "need --ext-proc-port")):
        with pytest.raises(SystemExit, match=message):
            ext_proc_settings(p.parse_args(argv), {})


def test_a_client_ca_without_a_server_certificate_is_a_usage_error(pki) -> None:
    d, _, _ = pki
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "router", "--workers", "http://127.0.0.1:9",
         "--port", str(free_port()), "--ext-proc-port", str(free_port()),
         "--ext-proc-tls-client-ca", str(d / "ca.crt")],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--ext-proc-tls-client-ca: needs --ext-proc-tls-cert" in proc.stderr


def test_a_rotated_client_ca_applies_to_new_connections_without_a_restart(
        tmp_path, monkeypatch) -> None:
    """Mounted as Kubernetes mounts Secrets (kubelet's atomic `..data` swap): after the
    client CA is rotated, new connections need a certificate of the new CA."""
    from tandem.router.extproc import clientauth
    from tests.protocol.certs import SecretVolume

    monkeypatch.setattr(clientauth, "RECHECK_S", 0.0)
    old, new = CA("old-gateway-ca"), CA("new-gateway-ca")
    server_ca = CA("epp-server-ca")
    cert, key = server_ca.issue("epp")
    tls = SecretVolume(tmp_path / "tls", {"tls.crt": cert, "tls.key": key})
    client_ca = SecretVolume(tmp_path / "client-ca", {"ca.crt": old.pem})
    worker = StubWorker(free_port())
    r = EppRouter([worker.url], ext=ExtProcSettings(
        port=0, host="127.0.0.1", tls_cert=str(tls.path / "tls.crt"),
        tls_key=str(tls.path / "tls.key"), tls_client_ca=str(client_ca.path / "ca.crt")))
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        r.wait_routable(1)
        by_old = _creds(server_ca, old.issue("gw"))
        by_new = _creds(server_ca, new.issue("gw"))
        assert _health(r.target, by_old) == serving
        client_ca.update({"ca.crt": new.pem})
        assert _health(r.target, by_new) == serving
        with pytest.raises(grpc.RpcError) as err:
            _health(r.target, by_old)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        client_ca.update({"ca.crt": b"not a certificate"})  # a bad update: the last good kept
        assert _health(r.target, by_new) == serving
    finally:
        r.stop()
        worker.stop()


def test_mismatched_files_stop_the_picker_at_start(tmp_path, pki) -> None:
    from tandem.router.extproc.clientauth import credentials

    d, ca, _ = pki
    _, other_key = ca.issue("someone-else")
    (tmp_path / "other.key").write_bytes(other_key)
    (tmp_path / "empty.crt").write_bytes(b"")
    for key, client_ca, message in ((tmp_path / "other.key", d / "ca.crt", "not the private key"),
                                    (d / "tls.key", tmp_path / "empty.crt", "no PEM certificate")):
        with pytest.raises(OSError, match=f"ext_proc mutual TLS: .*{message}"):
            credentials(ExtProcSettings(port=0, tls_cert=str(d / "tls.crt"), tls_key=str(key),
                                        tls_client_ca=str(client_ca)))
