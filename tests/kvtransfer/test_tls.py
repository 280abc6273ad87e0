"""P/D over mutual TLS between real worker processes: a CA and certificates made at test time,
a prefill and a decode worker started with --grpc-tls-dir. The transfer works and gives the
aggregated worker's tokens; the prefill worker's gRPC port refuses clients without a
certificate its CA signed (and plaintext ones); a decode worker from another CA is refused
and computes the prompt itself."""

from __future__ import annotations

import datetime
import ipaddress
import random
import signal
from pathlib import Path

import grpc
import httpx
import pytest

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.bundled import BUNDLED_NAME
from tests.serving.conftest import free_port, metric, start_worker, wait_for

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

pytestmark = pytest.mark.slow
BS = 16


# -- a CA and certificates ------------------------------------------------------------------------

class CA:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256()))

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str) -> tuple[bytes, bytes]:
        """(certificate, key) PEM for `name`, valid as server and client on 127.0.0.1."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self.key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def secret_dir(self, path: Path, name: str) -> Path:
        """A directory laid out like a mounted Kubernetes TLS Secret."""
        cert, key = self.issue(name)
        path.mkdir(parents=True)
        (path / "tls.crt").write_bytes(cert)
        (path / "tls.key").write_bytes(key)
        (path / "ca.crt").write_bytes(self.pem)
        return path


# -- workers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ca, rogue = CA("tandem-test-ca"), CA("some-other-ca")
    grpc_port = free_port()
    common = ("--num-threads", "1", "--num-kv-blocks", "256")
    prefill = start_worker(tmp, "--role", "prefill", "--grpc-port", str(grpc_port),
                           "--grpc-tls-dir", str(ca.secret_dir(tmp / "prefill", "prefill")),
                           *common, wait_ready=False)
    decode = start_worker(tmp, "--role", "decode",
                          "--grpc-tls-dir", str(ca.secret_dir(tmp / "decode", "decode")),
                          *common, wait_ready=False)
    stranger = start_worker(tmp, "--role", "decode", "--grpc-tls-dir",
                            str(rogue.secret_dir(tmp / "stranger", "decode")), *common,
                            wait_ready=False)
    single = start_worker(tmp, "--role", "both", *common, wait_ready=False)
    workers = (prefill, decode, stranger, single)
    try:
        for w in workers:
            wait_for(w, "/ready", 200, timeout=240)
        yield {"prefill": prefill, "decode": decode, "stranger": stranger, "single": single,
               "target": f"127.0.0.1:{grpc_port}", "ca": ca, "rogue": rogue}
    finally:
        for w in workers:  # all drain at once
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.stop()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def complete(url: str, prompt, prefill: str | None = None) -> str:
    headers = {"x-tandem-prefill": prefill} if prefill else {}
    r = httpx.post(url + "/v1/completions", timeout=120, headers=headers, json={
        "model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def fetches(url: str, result: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem_kvtransfer_fetches_total{") and f'result="{result}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def prefill_request(prompt: list[int]) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id="tls-test", model_id=BUNDLED_NAME, token_ids=prompt, block_size=BS,
        first_block=0, num_blocks=len(prompt) // BS, backend="grpc", lease_s=5)


def call_prefill(target: str, credentials: grpc.ChannelCredentials | None,
                 prompt: list[int]) -> list[worker_pb2.PageChunk]:
    options = [("grpc.max_receive_message_length", 8 << 20)]
    with (grpc.secure_channel(target, credentials, options=options) if credentials
          else grpc.insecure_channel(target, options=options)) as ch:
        stub = worker_pb2_grpc.KVTransferStub(ch)
        chunks = list(stub.Prefill(prefill_request(prompt), timeout=30))
        stub.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id),
                          timeout=10)
        return chunks


# -- tests -----------------------------------------------------------------------------------------

def test_pd_over_mutual_tls_gives_the_aggregated_tokens(mtls):
    decode, single, target = mtls["decode"], mtls["single"], mtls["target"]
    ok = fetches(decode.url, "ok")
    received = metric(decode.url, "tandem_kvtransfer_received_bytes_total")
    for seed, n in ((1, 5 * BS + 3), (2, 300)):
        prompt = ids(seed, n)
        assert complete(decode.url, prompt, target) == complete(single.url, prompt)
    assert fetches(decode.url, "ok") == ok + 2
    assert metric(decode.url, "tandem_kvtransfer_received_bytes_total") > received


def test_a_client_with_a_certificate_from_the_ca_is_served(mtls):
    cert, key = mtls["ca"].issue("test-client")
    creds = grpc.ssl_channel_credentials(root_certificates=mtls["ca"].pem, private_key=key,
                                         certificate_chain=cert)
    chunks = call_prefill(mtls["target"], creds, ids(3, 3 * BS))
    assert chunks[0].WhichOneof("kind") == "header"
    assert chunks[-1].WhichOneof("kind") == "trailer"


def _refused(target: str, credentials: grpc.ChannelCredentials | None) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call_prefill(target, credentials, ids(4, 3 * BS))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def test_clients_without_a_trusted_certificate_are_refused(mtls):
    ca, rogue, target = mtls["ca"], mtls["rogue"], mtls["target"]
    # TLS, trusting the server, but no client certificate
    _refused(target, grpc.ssl_channel_credentials(root_certificates=ca.pem))
    # a client certificate from another CA
    cert, key = rogue.issue("intruder")
    _refused(target, grpc.ssl_channel_credentials(root_certificates=ca.pem, private_key=key,
                                                  certificate_chain=cert))
    # plaintext
    _refused(target, None)
    # a good client certificate, but the client does not trust the server's CA
    cert, key = ca.issue("test-client")
    _refused(target, grpc.ssl_channel_credentials(root_certificates=rogue.pem,
                                                  private_key=key, certificate_chain=cert))
    # the Worker service on the same port is as closed
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca.pem)
                             ) as ch, pytest.raises(grpc.RpcError) as info:
        worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # and the worker is fine
    assert httpx.get(mtls["prefill"].url + "/health", timeout=5).status_code == 200


def test_a_decode_worker_from_another_ca_is_refused_and_computes_itself(mtls):
    stranger, single, target = mtls["stranger"], mtls["single"], mtls["target"]
    prompt = ids(5, 5 * BS + 3)
    failed = fetches(stranger.url, "unavailable") + fetches(stranger.url, "rpc")
    assert complete(stranger.url, prompt, target) == complete(single.url, prompt)
    assert fetches(stranger.url, "unavailable") + fetches(stranger.url, "rpc") == failed + 1
    assert fetches(stranger.url, "ok") == 0


def test_unreadable_tls_files_stop_the_worker_at_start(tmp_path):
    (tmp_path / "empty").mkdir()
    w = start_worker(tmp_path, "--role", "prefill", "--grpc-port", str(free_port()),
                     "--grpc-tls-dir", str(tmp_path / "empty"), wait_ready=False)
    assert w.proc.wait(timeout=120) != 0
    assert "--grpc-tls-dir" in w.log()
