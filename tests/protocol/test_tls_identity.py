"""mTLS between pods: certificates that name only the service identity (no address), peers
dialed by 127.0.0.1. Real grpc.aio servers (`start_grpc_server`, the worker's Worker
service over a real `KVEventHub`) and the router's real `WorkerMonitor`; certificates come
from CAs made at test time, in directories updated the way kubelet updates a Secret volume.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.core import EngineStats
from tandem.engine.kv_events_hub import KVEventHub
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.kv_events import BlockStored
from tandem.protocol.tls import TLSFiles, add_tls_arg, peer_identity, tls_from_args
from tandem.protocol.tls_peers import PeerChannel
from tandem.router.index import PrefixIndex
from tandem.router.monitor import MonitorSettings, WorkerMonitor
from tandem.router.workers import Worker
from tandem.serving.grpc_server import WorkerService, start_grpc_server
from tandem.serving.ports import free_port
from tests.protocol.certs import CA, SecretVolume

ID = peer_identity("chat", "prod")
OTHER = peer_identity("embed", "prod")  # another InferenceService under the same CA


@pytest.fixture(scope="module")
def pki():
    return SimpleNamespace(ca=CA("cluster-ca"), rogue=CA("another-ca"), renewed=CA("new-ca"))


class FakeEngine:
    """What WorkerService reads of an engine: load figures, block geometry, a real KV hub."""

    def __init__(self, held: list[bytes], num_running: int = 3) -> None:
        self.kv_hub = KVEventHub()
        self.held = held
        self.snapshot = EngineStats(
            num_running=num_running, num_waiting=1, kv_cache_usage=0.25, num_free_blocks=200,
            prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0,
            generation_tokens=0, kv_unused_slots=0, in_flight_tokens=77)
        self.state = SimpleNamespace(num_kv_blocks=256, num_usable_blocks=256,  # engine state
                                     block_size=16)

    async def subscribe_kv_events(self):  # noqa: ANN201 - the engine's signature
        return self.kv_hub.subscribe(list(self.held), asyncio.get_running_loop())


async def serve(tls: TLSFiles, engine: FakeEngine, port: int | None = None
                ) -> tuple[grpc.aio.Server, int]:
    port = port or free_port()
    service = WorkerService(lambda: engine, "w0", "m", "both")
    return await start_grpc_server(service, "127.0.0.1", port, tls=tls), port


async def get_load(port: int, tls: TLSFiles | None) -> worker_pb2.Load:
    """GetLoad on a new channel (a new connection, a new handshake)."""
    ch = PeerChannel(f"127.0.0.1:{port}", tls)
    try:
        return await worker_pb2_grpc.WorkerStub(ch.get()).GetLoad(worker_pb2.GetLoadRequest(),
                                                                  timeout=5)
    finally:
        await ch.close()


async def refused(port: int, tls: TLSFiles | None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_load(port, tls)
    return info.value


def tls_dir(tmp: Path, ca: CA, label: str, sans: tuple[str, ...] = (ID,),
            server_name: str | None = ID) -> TLSFiles:
    return TLSFiles.from_dir(ca.secret_dir(tmp / label, label, sans), server_name)


# -- identity --------------------------------------------------------------------------------

def test_peer_identity_is_the_services_dns_name():
    assert peer_identity("chat", "prod") == "chat.prod.tandem.internal"
    assert peer_identity("a" * 63, "ns-1") == f"{'a' * 63}.ns-1.tandem.internal"
    for name, ns in (("Chat", "prod"), ("chat", "a.b"), ("-x", "prod"), ("chat", ""),
                     ("a" * 64, "prod"), ("chat", "prod_1")):
        with pytest.raises(ValueError, match="is not a DNS label"):
            peer_identity(name, ns)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.A_", min_size=0, max_size=70),
       st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=63))
def test_peer_identity_accepts_exactly_dns_labels(name, namespace):
    label = (0 < len(name) <= 63 and set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
             and name[0] != "-" and name[-1] != "-")
    ns_ok = namespace[0] != "-" and namespace[-1] != "-"
    if label and ns_ok:
        identity = peer_identity(name, namespace)
        assert identity.split(".") == [name, namespace, "tandem", "internal"]
    else:
        with pytest.raises(ValueError):
            peer_identity(name, namespace)


def test_the_flags(tmp_path, pki):
    p = argparse.ArgumentParser()
    add_tls_arg(p)
    d = pki.ca.secret_dir(tmp_path / "s", "s", (ID,))
    args = p.parse_args(["--grpc-tls-dir", str(d), "--grpc-tls-server-name", ID])
    tls = tls_from_args(args.grpc_tls_dir, args.grpc_tls_server_name)
    assert tls is not None and tls.server_name == ID
    assert tls.channel_options() == [("grpc.ssl_target_name_override", ID)]
    assert tls_from_args(str(d)).channel_options() == []  # verified against the address
    assert tls_from_args(None) is None
    with pytest.raises(SystemExit, match="--grpc-tls-server-name needs --grpc-tls-dir"):
        tls_from_args(None, ID)
    with pytest.raises(SystemExit, match="--grpc-tls-server-name: 'a b' is not a DNS name"):
        tls_from_args(str(d), "a b")
    (d / "tls.key").write_bytes(pki.ca.issue("x")[1])  # not tls.crt's key
    with pytest.raises(SystemExit, match="--grpc-tls-dir: tls.key is not the private key"):
        tls_from_args(str(d), ID)


def test_tandem_serve_hands_the_workers_tls_flags_to_the_router():
    from tandem.serving.embedded import plan as _plan

    args = SimpleNamespace(workers=1, prefill=0, decode=0, host="127.0.0.1", port=8000,
                           log_level="info", pd_threshold=None, pd_max_prefill_queue=None,
                           pd_max_local_prefill=None)
    ports = iter(range(9000, 9100))
    plan = _plan(args, ["--grpc-tls-dir", "/tls", f"--grpc-tls-server-name={ID}",
                        "--num-kv-blocks", "64"], lambda host: next(ports))
    router = plan.router
    i = router.index("--grpc-tls-dir")
    assert router[i + 1] == "/tls" and f"--grpc-tls-server-name={ID}" in router
    assert "--num-kv-blocks" not in router
    assert "--grpc-tls-dir" not in _plan(args, [], lambda host: next(ports)).router


# -- dialed by address, verified by identity ------------------------------------------------

def test_identity_certificates_dialed_by_ip(tmp_path, pki):
    async def main() -> None:
        server, port = await serve(tls_dir(tmp_path, pki.ca, "worker"), FakeEngine([]))
        try:
            load = await get_load(port, tls_dir(tmp_path, pki.ca, "router"))
            assert (load.worker_id, load.num_running, load.num_total_blocks,
                    load.in_flight_tokens) == ("w0", 3, 256, 77)
            # without the server name the certificate is checked against 127.0.0.1: no match
            e = await refused(port, tls_dir(tmp_path, pki.ca, "plain", server_name=None))
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            # a client of another service (same CA) expects its own identity: name mismatch
            e = await refused(port, tls_dir(tmp_path, pki.ca, "other", (OTHER,), OTHER))
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            # ... and if it asks for ours, the server sees its certificate names OTHER
            e = await refused(port, tls_dir(tmp_path, pki.ca, "impostor", (OTHER,), ID))
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED
            assert ID in e.details()
            # a certificate from another CA, with the right name
            e = await refused(port, tls_dir(tmp_path, pki.rogue, "rogue"))
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            e = await refused(port, None)  # plaintext
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_without_a_server_name_the_address_is_verified_and_any_ca_client_is_served(
        tmp_path, pki):
    async def main() -> None:
        server_tls = tls_dir(tmp_path, pki.ca, "worker", ("127.0.0.1",), None)
        server, port = await serve(server_tls, FakeEngine([]))
        try:
            client = tls_dir(tmp_path, pki.ca, "client", ("10.9.9.9",), None)
            assert (await get_load(port, client)).num_running == 3
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_router_monitor_gets_kv_events_and_load_by_identity(tmp_path, pki):
    held = [os.urandom(32) for _ in range(5)]
    new = os.urandom(32)

    async def main() -> None:
        engine = FakeEngine(held)
        server, port = await serve(tls_dir(tmp_path, pki.ca, "worker"), engine)
        index = PrefixIndex()
        worker = Worker(id="http://127.0.0.1:1")
        worker.grpc_target = f"127.0.0.1:{port}"
        mon = WorkerMonitor(worker, index, http=None, settings=MonitorSettings(
            load_interval_s=0.05, tls=tls_dir(tmp_path, pki.ca, "router")))
        mon._start_grpc_loops()
        try:
            await asyncio.wait_for(mon.connected.wait(), 10)
            assert index.match(held, 0) == {worker.id: 5}
            engine.kv_hub.publish([BlockStored(block_hashes=(new,), parent_hash=held[-1],
                                               token_ids=(), block_size=16)])
            await until(lambda: index.match([*held, new], 0) == {worker.id: 6})
            await until(lambda: worker.load is not None and worker.load.num_running == 3)
            assert (worker.load.num_total_blocks, worker.load.in_flight_tokens) == (256, 77)
        finally:
            await mon.stop()
            await server.stop(None)

    asyncio.run(main())


async def until(condition, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


# -- renewals: files replaced on disk, no restart --------------------------------------------

def test_renewed_files_take_effect_on_new_connections(tmp_path, pki, caplog):
    """The server is never restarted: after kubelet swaps its volume to certificates from a
    new CA, new connections from old-CA clients are refused and new-CA ones are served; a
    half-written update (key of another certificate) changes nothing and is logged."""
    caplog.set_level(logging.WARNING, "tandem.protocol.tls")

    async def main() -> None:
        volume = SecretVolume(tmp_path / "worker", pki.ca.files("worker", (ID,)))
        server_tls = TLSFiles.from_dir(volume.path, ID, recheck_s=0)
        server, port = await serve(server_tls, FakeEngine([]))
        old = tls_dir(tmp_path, pki.ca, "old-client")
        new = tls_dir(tmp_path, pki.renewed, "new-client")
        try:
            assert (await get_load(port, old)).num_running == 3
            assert (await refused(port, new)).code() == grpc.StatusCode.UNAVAILABLE
            # half-written: the renewed certificate beside another pair's key
            broken = pki.renewed.files("worker", (ID,))
            broken["tls.key"] = pki.renewed.issue("worker", (ID,))[1]
            volume.update(broken)
            assert (await get_load(port, old)).num_running == 3
            assert "keeping the last good certificate: tls.key is not the private key" \
                in caplog.text
            volume.update(pki.renewed.files("worker", (ID,)))
            assert (await get_load(port, new)).num_running == 3
            assert (await refused(port, old)).code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_monitor_rebuilds_its_channel_when_its_files_are_renewed(tmp_path, pki):
    """The router's monitor outlives a renewal: once its volume holds the new CA's files, it
    reaches a worker that trusts and shows only the new CA (a restarted pod) with a new
    channel - the old one's credentials could no longer connect."""
    first, second = [os.urandom(32) for _ in range(3)], [os.urandom(32) for _ in range(4)]

    async def main() -> None:
        server, port = await serve(tls_dir(tmp_path, pki.ca, "w1"), FakeEngine(first, 3))
        volume = SecretVolume(tmp_path / "router", pki.ca.files("router", (ID,)))
        index, worker = PrefixIndex(), Worker(id="http://127.0.0.1:1")
        worker.grpc_target = f"127.0.0.1:{port}"
        mon = WorkerMonitor(worker, index, http=None, settings=MonitorSettings(
            load_interval_s=0.05, backoff_max_s=0.2, retire_grace_s=0.5,
            tls=TLSFiles.from_dir(volume.path, ID, recheck_s=0)))
        mon._start_grpc_loops()
        try:
            await until(lambda: worker.load is not None and worker.load.num_running == 3)
            assert index.match(first, 0) == {worker.id: 3}
            channel = mon._channel.get()
            assert mon._channel.get() is channel  # unchanged files: the same channel
            await server.stop(None)
            volume.update(pki.renewed.files("router", (ID,)))
            server, _ = await serve(tls_dir(tmp_path, pki.renewed, "w2"),
                                    FakeEngine(second, 9), port)
            await until(lambda: worker.load.num_running == 9)
            await until(lambda: index.match(second, 0) == {worker.id: 4})
            assert mon._channel.get() is not channel
        finally:
            await mon.stop()
            await server.stop(None)

    asyncio.run(main())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["good", "mismatch", "no-ca"])),
                min_size=1, max_size=8))
def test_the_files_in_use_are_always_the_last_good_update(updates):
    """Whatever mix of complete and broken updates lands, `current()` is the last complete
    one (the first update is complete: a process does not start without one)."""
    import tempfile

    cas = [CA(f"ca{i}") for i in range(3)]
    pairs = [ca.files("w", (ID,)) for ca in cas]
    with tempfile.TemporaryDirectory() as tmp:
        volume = SecretVolume(Path(tmp) / "v", pairs[0])
        tls = TLSFiles.from_dir(volume.path, ID, recheck_s=0)
        tls.load()
        expect = pairs[0]
        for which, kind in updates:
            data = dict(pairs[which])
            if kind == "mismatch":
                data["tls.key"] = pairs[(which + 1) % 3]["tls.key"]
            elif kind == "no-ca":
                data["ca.crt"] = b""
            volume.update(data)
            if kind == "good":
                expect = data
            m = tls.current()
            assert (m.cert, m.key, m.ca) == (expect["tls.crt"], expect["tls.key"],
                                             expect["ca.crt"])
