"""P/D over mutual TLS between real worker processes: a CA and certificates made at test time,
a prefill and a decode worker started with --grpc-tls-dir and --grpc-tls-server-name, their
certificates naming only the service identity (no address) and dialed at 127.0.0.1. The
transfer works and gives the aggregated worker's tokens; the prefill worker's gRPC port
refuses clients without a certificate its CA signed (and plaintext ones) and clients of
another service under the same CA; a decode worker from another CA is refused and computes
the prompt itself; a router reaches the workers' KV events and load by the identity."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import httpx
import pytest

from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.block_hash import HashKeys, hash_block_chain
from tandem.protocol.bundled import BUNDLED_NAME
from tandem.protocol.signing import WorkerKey
from tandem.protocol.tls import TLSFiles, peer_identity
from tandem.router.index import PrefixIndex
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.workers import Worker
from tests.protocol.certs import CA
from tests.serving.helpers import (
    free_port,
    metric,
    signed,
    signing_channel,
    start_worker,
    wait_for,
    worker_key_file,
)

pytestmark = pytest.mark.slow
BS = 16
ID = peer_identity("chat", "tls-test")  # the InferenceService these workers belong to
OTHER = peer_identity("embed", "tls-test")  # another one whose certificates the CA signs


# -- workers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ca, rogue = CA("tandem-test-ca"), CA("some-other-ca")
    grpc_port = free_port()
    common = ("--num-threads", "1", "--num-kv-blocks", "256")
    identity = ("--grpc-tls-server-name", ID)  # the certificates name only the service
    prefill = start_worker(tmp, "--role", "prefill", "--grpc-port", str(grpc_port),
                           "--grpc-tls-dir", str(ca.secret_dir(tmp / "prefill", "p", (ID,))),
                           *identity, *common, wait_ready=False)
    decode = start_worker(tmp, "--role", "decode",
                          "--grpc-tls-dir", str(ca.secret_dir(tmp / "decode", "d", (ID,))),
                          *identity, *common, wait_ready=False)
    # the torch backend: its Prefill control stream runs on the same verified channel
    torch_decode = start_worker(tmp, "--role", "decode", "--kv-transfer-backend", "torch",
                                "--grpc-tls-dir",
                                str(ca.secret_dir(tmp / "torch", "t", (ID,))), *identity,
                                *common, wait_ready=False)
    stranger = start_worker(tmp, "--role", "decode", "--grpc-tls-dir",
                            str(rogue.secret_dir(tmp / "stranger", "d", (ID,))), *identity,
                            *common, wait_ready=False)
    single = start_worker(tmp, "--role", "both", *common, wait_ready=False)
    workers = (prefill, decode, torch_decode, stranger, single)
    try:
        for w in workers:
            wait_for(w, "/ready", 200, timeout=240)
        yield {"prefill": prefill, "decode": decode, "torch_decode": torch_decode,
               "stranger": stranger, "single": single,
               "target": f"127.0.0.1:{grpc_port}", "ca": ca, "rogue": rogue, "tmp": tmp}
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
    body, headers = signed({"model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True}, prefill)
    r = httpx.post(url + "/v1/completions", timeout=120, headers=headers, content=body)
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


def credentials(ca: CA, client_sans: tuple[str, ...] | None = (ID,),
                trust: CA | None = None) -> grpc.ChannelCredentials:
    """A client certificate from `ca` naming `client_sans` (None: no client certificate),
    trusting `trust` (default `ca`)."""
    if client_sans is None:
        return grpc.ssl_channel_credentials(root_certificates=(trust or ca).pem)
    cert, key = ca.issue("test-client", client_sans)
    return grpc.ssl_channel_credentials(root_certificates=(trust or ca).pem, private_key=key,
                                        certificate_chain=cert)


def channel(target: str, creds: grpc.ChannelCredentials | None,
            server_name: str | None = ID) -> grpc.Channel:
    """Dialed at `target`, the server verified as `server_name` (None: as the address)."""
    options = [("grpc.max_receive_message_length", 8 << 20)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return (grpc.secure_channel(target, creds, options=options) if creds
            else grpc.insecure_channel(target, options=options))


def call_prefill(target: str, creds: grpc.ChannelCredentials | None, prompt: list[int],
                 server_name: str | None = ID) -> list[worker_pb2.PageChunk]:
    with channel(target, creds, server_name) as ch:
        stub = worker_pb2_grpc.KVTransferStub(signing_channel(ch))
        chunks = list(stub.Prefill(prefill_request(prompt), timeout=30))
        stub.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=chunks[0].header.lease_id),
                          timeout=10)
        return chunks


def get_load(target: str, creds: grpc.ChannelCredentials,
             server_name: str | None = ID) -> worker_pb2.Load:
    with channel(target, creds, server_name) as ch:
        return worker_pb2_grpc.WorkerStub(signing_channel(ch)).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=10)


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("decoder", ["decode", "torch_decode"])
def test_pd_over_mutual_tls_gives_the_aggregated_tokens(mtls, decoder):
    decode, single, target = mtls[decoder], mtls["single"], mtls["target"]
    ok = fetches(decode.url, "ok")
    received = metric(decode.url, "tandem_kvtransfer_received_bytes_total")
    for seed, n in ((1, 5 * BS + 3), (2, 300)):
        prompt = ids(seed, n)
        assert complete(decode.url, prompt, target) == complete(single.url, prompt)
    assert fetches(decode.url, "ok") == ok + 2
    assert metric(decode.url, "tandem_kvtransfer_received_bytes_total") > received


def test_a_client_of_the_service_is_served_by_identity(mtls):
    """Its certificate names only the identity; the server is dialed at 127.0.0.1."""
    creds = credentials(mtls["ca"])
    chunks = call_prefill(mtls["target"], creds, ids(3, 3 * BS))
    assert chunks[0].WhichOneof("kind") == "header"
    assert chunks[-1].WhichOneof("kind") == "trailer"
    load = get_load(mtls["target"], creds)
    assert (load.role, load.num_total_blocks, load.block_size) == ("prefill", 256, BS)


def _refused(target: str, creds: grpc.ChannelCredentials | None,
             code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
             server_name: str | None = ID) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call_prefill(target, creds, ids(4, 3 * BS), server_name)
    assert info.value.code() == code, info.value


def test_clients_without_a_trusted_certificate_are_refused(mtls):
    ca, rogue, target = mtls["ca"], mtls["rogue"], mtls["target"]
    _refused(target, credentials(ca, None))  # TLS, trusting the server, no client certificate
    _refused(target, credentials(rogue, trust=ca))  # a client certificate from another CA
    _refused(target, None)  # plaintext
    _refused(target, credentials(ca, trust=rogue))  # a client not trusting the server's CA
    # the Worker service on the same port is as closed
    with pytest.raises(grpc.RpcError) as info:
        get_load(target, credentials(ca, None))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # and the worker is fine
    assert httpx.get(mtls["prefill"].url + "/health", timeout=5).status_code == 200


def test_a_client_of_another_service_under_the_same_ca_is_refused(mtls):
    ca, target = mtls["ca"], mtls["target"]
    other = credentials(ca, (OTHER,))
    # it dials expecting its own service: the server's certificate does not name it
    _refused(target, other, server_name=OTHER)
    # it accepts ours: the server sees a client certificate naming OTHER
    _refused(target, other, grpc.StatusCode.PERMISSION_DENIED)
    with pytest.raises(grpc.RpcError) as info:
        get_load(target, other)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert ID in info.value.details()
    with channel(target, other) as ch, pytest.raises(grpc.RpcError) as info:
        next(iter(worker_pb2_grpc.WorkerStub(ch).SubscribeKVEvents(
            worker_pb2.SubscribeKVEventsRequest(), timeout=10)))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_dialed_by_ip_without_the_server_name_the_certificate_does_not_match(mtls):
    """The failure this identity fixes: no pod IP is in the certificate."""
    _refused(mtls["target"], credentials(mtls["ca"]), server_name=None)


def test_a_router_gets_kv_events_and_load_by_identity(mtls, tmp_path):
    from tests.router.test_router_integration import RouterProcess

    prefill, ca = mtls["prefill"], mtls["ca"]
    router_dir = ca.secret_dir(tmp_path / "router", "router", (ID,))
    router = RouterProcess(mtls["tmp"], [prefill.url], "--grpc-tls-dir", str(router_dir),
                           "--grpc-tls-server-name", ID)
    prompt = ids(6, 3 * BS + 5)
    hashes = hash_block_chain(prompt[:3 * BS], BS, HashKeys(BUNDLED_NAME, "", ""))

    async def monitor() -> tuple[dict, worker_pb2.Load | None]:
        index, worker = PrefixIndex(), Worker(id=prefill.url)
        async with httpx.AsyncClient() as http:
            mon = WorkerMonitor(worker, index, http, MonitorSettings(
                load_interval_s=0.05, tls=TLSFiles.from_dir(router_dir, ID)),
                key=WorkerKey(worker_key_file(mtls["tmp"])))
            mon.start()
            try:
                await asyncio.wait_for(mon.connected.wait(), 30)
                await asyncio.to_thread(call_prefill, mtls["target"], credentials(ca), prompt)
                deadline = time.monotonic() + 30
                while index.match(hashes, 0) != {prefill.url: 3} or worker.load is None:
                    assert time.monotonic() < deadline, index.match(hashes, 0)
                    await asyncio.sleep(0.05)
                return index.match(hashes, 0), worker.load
            finally:
                await mon.stop()

    try:
        router.wait_events(1)
        matched, load = asyncio.run(monitor())
        assert matched == {prefill.url: 3}
        assert load.num_total_blocks == 256 and 0 <= load.num_free_blocks <= 256
        indexed = [line for line in httpx.get(router.url + "/metrics", timeout=10).text
                   .splitlines() if line.startswith("tandem_router_worker_indexed_blocks{")]
        assert len(indexed) == 1 and float(indexed[0].rsplit(" ", 1)[1]) >= 3
    finally:
        router.stop()


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
