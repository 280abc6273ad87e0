"""A worker told to stop (SIGTERM) loses nothing: real worker processes on a tiny random
model. New and queued requests are handed back at once (503 / an SSE error event with the
`worker_draining` code, which a router retries or migrates), readiness and `Load` say
draining at once, running requests finish within `--drain-timeout` or end with that code,
a draining prefill worker keeps serving pages it leased until they are released, and the
process exits soon after."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from tandem.engine.async_api import unstarted_ids
from tandem.engine.async_engine import OutputStream
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.protocol import worker_pb2, worker_pb2_grpc
from tandem.protocol.web import DRAINING_CODE
from tandem.serving.drain import WorkerDraining
from tests.engine.utils import make_tiny_model_dir

from .helpers import WorkerProcess, metric, signing_channel, start_worker, wait_for


def _child(rid: str, parent: str, outputs: int = 0) -> Request:
    r = Request(rid, [5, 6, 7], SamplingParams(max_tokens=8), max_tokens=8, parent_id=parent)
    for t in range(outputs):
        r.append_output_token(100 + t)
    return r


def test_only_requests_whose_every_sample_waits_without_a_token_are_handed_back():
    class Scheduler:
        running = [_child("c-0", "running-0", outputs=1), _child("m-0", "mixed-0")]
        waiting = [_child("q-0", "queued-0"), _child("q-1", "queued-0"),
                   _child("p-0", "preempted-0", outputs=3), _child("m-1", "mixed-0"),
                   _child("h-0", "half-0"), _child("h-1", "half-0", outputs=2)]

        def waiting_requests(self) -> list[Request]:
            return self.waiting

    class Engine:
        scheduler = Scheduler()

    assert unstarted_ids(Engine()) == {"queued-0"}  # type: ignore[arg-type]


def test_a_failed_output_stream_hands_over_what_is_pending_once_then_raises():
    async def scenario() -> None:
        q = OutputStream(delta=True)
        out = RequestOutput("r-0", None, [1, 2], [CompletionOutput(0, "a", [7])])
        q.put(out)
        q.fail(WorkerDraining("stop"))
        q.fail(WorkerDraining("second"))  # the first counts
        assert (await q.get()).outputs[0].token_ids == [7]
        q.put(out)  # arrived after the cut: not handed over
        with pytest.raises(WorkerDraining, match="stop"):
            await q.get()
        idle = OutputStream()
        waiter = asyncio.ensure_future(idle.get())
        await asyncio.sleep(0)
        idle.fail(WorkerDraining("idle"))  # wakes a reader waiting with nothing pending
        with pytest.raises(WorkerDraining, match="idle"):
            await waiter

    asyncio.run(scenario())

LONG = {"prompt": "Count from one to a thousand:", "max_tokens": 3000, "temperature": 0,
        "ignore_eos": True}  # ~12 s of decoding on this machine, far beyond the drains below
CUT_DRAIN_S = 2.5
GRPC = {"cut": 0, "long": 0}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Two workers started together (their loads overlap): `cut` (a short drain, two
    sequences at a time) and `long` (a long drain); both serve gRPC (`Load`, KV transfer)."""
    from .helpers import free_port

    tmp = tmp_path_factory.mktemp("drain")
    model = tmp / "tiny"
    make_tiny_model_dir(model, "llama", seed=5, max_position_embeddings=4096)
    common = ("--model", str(model), "--num-threads", "1", "--kv-cache-memory", str(64 << 20),
              "--disable-log-stats")
    GRPC.update(cut=free_port(), long=free_port())
    started = {
        "cut": start_worker(tmp, *common, "--drain-timeout", str(CUT_DRAIN_S),
                            "--max-num-seqs", "2", "--grpc-port", str(GRPC["cut"]),
                            wait_ready=False),
        "long": start_worker(tmp, *common, "--drain-timeout", "60",
                             "--grpc-port", str(GRPC["long"]), wait_ready=False),
    }
    for w in started.values():
        wait_for(w, "/ready", 200, timeout=180)
    yield started
    for w in started.values():
        if w.proc.poll() is None:
            w.stop(signal.SIGKILL)


def _call(url: str, body: dict, out: dict, key: str) -> threading.Thread:
    """POST `body` in a thread; `out[key]` = (status, headers, [SSE data] or JSON, end time)."""
    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            if body.get("stream") and r.status_code == 200:
                data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            else:
                data = json.loads(r.read())
            out[key] = (r.status_code, r.headers, data, time.monotonic())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_metric(url: str, name: str, n: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, name) != n:
        assert time.monotonic() < deadline, f"{name} never reached {n}"
        time.sleep(0.02)


def _is_draining_503(status: int, headers: httpx.Headers, body: dict) -> bool:
    return (status == 503 and body["error"]["code"] == DRAINING_CODE
            and int(headers["retry-after"]) >= 1)


def _ready_503_within(w: WorkerProcess, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (r := httpx.get(w.url + "/ready", timeout=5)).status_code != 503:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.01)
    assert r.json()["status"] == "draining"


def test_sigterm_hands_back_new_and_queued_requests_and_cuts_running_ones_at_the_timeout(
        workers):
    w = workers["cut"]
    out: dict = {}
    threads = [_call(w.url, {**LONG, "stream": True}, out, "running_stream"),
               _call(w.url, LONG, out, "running_json")]
    _wait_metric(w.url, "vllm:num_requests_running", 2)
    threads += [_call(w.url, {**LONG, "stream": True}, out, "queued_stream"),
                _call(w.url, LONG, out, "queued_json")]
    _wait_metric(w.url, "vllm:num_requests_waiting", 2)
    sigterm = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    _ready_503_within(w, 1.0)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC['cut']}") as channel:
        load = worker_pb2_grpc.WorkerStub(signing_channel(channel)).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=5)
    assert load.draining
    new = httpx.post(w.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
    assert _is_draining_503(new.status_code, new.headers, new.json()), new.text
    for t in threads:
        t.join(timeout=60)
    # queued: handed back at once, before the drain timeout, with no token
    status, headers, body, ended = out["queued_json"]
    assert _is_draining_503(status, headers, body) and ended - sigterm < CUT_DRAIN_S, body
    status, _, events, ended = out["queued_stream"]
    assert status == 200 and ended - sigterm < CUT_DRAIN_S
    assert len(events) == 2 and json.loads(events[0])["error"]["code"] == DRAINING_CODE
    assert events[1] == "[DONE]"
    # running: its tokens, then at the timeout the draining error (not a finish)
    status, _, events, ended = out["running_stream"]
    assert status == 200 and ended - sigterm >= CUT_DRAIN_S
    tokens = [json.loads(e) for e in events[:-2]]
    assert tokens and all(t["choices"][0]["finish_reason"] is None for t in tokens)
    error = json.loads(events[-2])["error"]
    assert error["code"] == DRAINING_CODE and "drain timeout" in error["message"]
    assert events[-1] == "[DONE]"
    status, headers, body, ended = out["running_json"]
    assert _is_draining_503(status, headers, body) and ended - sigterm >= CUT_DRAIN_S
    assert w.proc.wait(timeout=30) == 0, w.log()
    assert time.monotonic() - sigterm < CUT_DRAIN_S + 10, w.log()
    log = w.log()
    assert "drain: 2 queued requests handed back" in log
    assert "2 running requests ended with worker_draining" in log


def test_a_long_drain_finishes_running_streams_and_serves_leased_pages_until_released(
        workers):
    w = workers["long"]
    events: list[str] = []
    with grpc.insecure_channel(f"127.0.0.1:{GRPC['long']}") as plain:
        kv = worker_pb2_grpc.KVTransferStub(signing_channel(plain))
        request = worker_pb2.PrefillRequest(  # pages a decode worker has not released yet
            model_id="tiny", token_ids=list(range(100, 164)), block_size=16, num_blocks=3,
            backend="grpc", lease_s=30.0, request_id="drain-test")
        chunks = list(kv.Prefill(request, timeout=60))
        lease_id = chunks[0].header.lease_id
        assert lease_id and chunks[-1].HasField("trailer")
        with httpx.stream("POST", w.url + "/v1/completions", timeout=60,
                          json={**LONG, "max_tokens": 600, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            for line in lines:  # the first token is out: the request runs
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            sigterm = time.monotonic()
            w.proc.send_signal(signal.SIGTERM)
            _ready_503_within(w, 1.0)
            with pytest.raises(grpc.RpcError) as refused:  # no new prefill while draining
                list(kv.Prefill(worker_pb2.PrefillRequest(
                    model_id="tiny", token_ids=list(range(200, 240)), block_size=16,
                    num_blocks=2, backend="grpc", lease_s=30.0), timeout=30))
            events += [line[6:] for line in lines if line.startswith("data: ")]
        # the stream ran to its end
        assert events[-1] == "[DONE]" and '"error"' not in "".join(events)
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 600
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        time.sleep(1.0)  # nothing runs, but the pages are still leased: the worker stays
        assert w.proc.poll() is None
        assert metric(w.url, "tandem_kv_leases_active") == 1
        released = kv.ReleasePages(worker_pb2.ReleasePagesRequest(lease_id=lease_id),
                                   timeout=10)
        assert released.released
    assert w.proc.wait(timeout=20) == 0, w.log()
    assert time.monotonic() - sigterm < 20  # released: not the lease's 30 s nor the drain's 60


def test_vllms_shutdown_timeout_flag_is_the_drain_timeout():
    from tandem.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["worker", "--shutdown-timeout", "7"]).drain_timeout == 7.0
    assert parse(["worker", "--drain-timeout", "9"]).drain_timeout == 9.0
    assert parse(["worker"]).drain_timeout == 30.0
