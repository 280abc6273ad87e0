"""P/D through a real router process: 1 prefill + 1 decode worker behind it, over real HTTP
and gRPC. Long prompts are disaggregated (and answer exactly as an aggregated worker),
short ones and prompts the decode worker already holds stay aggregated."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.protocol.bundled import BUNDLED_NAME
from tests.kvtransfer.test_pd_workers import assert_same_echo, fetches, ids
from tests.router.test_router_integration import RouterProcess, _metric
from tests.serving.helpers import free_port, start_worker, wait_for

pytestmark = pytest.mark.slow
DISAGG = "tandem_router_disaggregated_requests_total"
AGG = "tandem_router_aggregated_requests_total"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-router")
    common = ("--num-threads", "1", "--num-kv-blocks", "256")
    workers = [start_worker(tmp, "--role", role, "--grpc-port", str(free_port()), *common,
                            wait_ready=False) for role in ("prefill", "decode")]
    single = start_worker(tmp, "--role", "both", *common, wait_ready=False)
    router = None
    try:
        for w in (*workers, single):
            wait_for(w, "/ready", 200, timeout=240)
        # the threshold rule, stated: these tests are about P/D's mechanics, and the cost
        # decision (`test_pd_cost`) prefills on an idle decode worker, which has no streams
        # to spare
        router = RouterProcess(tmp, [w.url for w in workers], "--pd-decision", "threshold")
        router.wait_events(2)
        yield router, *workers, single
    finally:
        if router is not None:
            router.stop()
        for w in (*workers, single):
            w.stop()


def complete(url: str, prompt) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["text"]


def test_a_long_prompt_is_disaggregated_with_the_same_tokens(pd):
    router, prefill, decode, single = pd
    prompt = ids(31, 300)
    before = (_metric(router.url, DISAGG, 'backend="auto"'), _metric(router.url, AGG),
              fetches(decode.url, "ok"))
    r = complete(router.url, prompt)
    assert r.headers["x-tandem-worker"] == decode.url
    assert text(r) == text(complete(single.url, prompt))
    assert _metric(router.url, DISAGG, 'backend="auto"') == before[0] + 1
    assert _metric(router.url, AGG) == before[1]
    assert fetches(decode.url, "ok") == before[2] + 1
    assert "prefill on " + prefill.url in router.log()

    # the decode worker now holds the prompt's blocks (its KV events say so): aggregated
    deadline = time.monotonic() + 10
    while _metric(router.url, "tandem_router_worker_indexed_blocks",
                  f'worker="{decode.url}"') < 300 // 16:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    again = complete(router.url, prompt)
    assert text(again) == text(r)
    assert _metric(router.url, AGG) == before[1] + 1
    assert fetches(decode.url, "ok") == before[2] + 1


def test_a_chat_prompt_tokenized_by_the_router_is_disaggregated(pd):
    router, _, decode, single = pd
    body = {"model": BUNDLED_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You answer in French. " * 30},
                         {"role": "user", "content": "Name three rivers."}]}
    before = _metric(router.url, DISAGG), fetches(decode.url, "ok")
    got = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
    want = httpx.post(single.url + "/v1/chat/completions", json=body, timeout=120)
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    assert (_metric(router.url, DISAGG), fetches(decode.url, "ok")) == (before[0] + 1,
                                                                        before[1] + 1)


def test_a_short_prompt_stays_aggregated(pd):
    router, _, decode, single = pd
    prompt = ids(32, 9)
    before = _metric(router.url, DISAGG), _metric(router.url, AGG), fetches(decode.url, "ok")
    r = complete(router.url, prompt)
    assert r.headers["x-tandem-worker"] == decode.url
    assert text(r) == text(complete(single.url, prompt))
    assert (_metric(router.url, DISAGG), _metric(router.url, AGG),
            fetches(decode.url, "ok")) == (before[0], before[1] + 1, before[2])


def test_an_echo_with_logprobs_through_pd_scores_the_prompt_on_the_decode_worker(pd):
    """Prompt logprobs need every position's logits: the router keeps the request
    aggregated on the decode worker (and says why in its metrics), which answers as an
    aggregated worker does."""
    router, _, decode, single = pd
    prompt = ids(37, 200)
    body = {"model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}
    before = (fetches(decode.url, "ok"), _metric(router.url, AGG, 'reason="prompt_logprobs"'))
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-tandem-worker"] == decode.url
    ref = httpx.post(single.url + "/v1/completions", json=body, timeout=120).json()
    assert_same_echo(r.json()["choices"][0], ref["choices"][0])
    assert fetches(decode.url, "ok") == before[0]
    assert _metric(router.url, AGG, 'reason="prompt_logprobs"') == before[1] + 1


def test_a_tenant_request_through_a_keyed_router_is_signed_and_disaggregated(pd, tmp_path):
    """With API keys, the router's request carries the tenant salt and a P/D target: both
    only pass the decode worker because the router signed them; the tokens are the
    aggregated worker's."""
    _, prefill, decode, single = pd
    keys = tmp_path / "keys"
    keys.write_text("sk-alpha alpha\n")
    router = RouterProcess(tmp_path, [prefill.url, decode.url], "--api-keys", str(keys))
    try:
        router.wait_events(2)
        prompt = ids(41, 300)
        before = fetches(decode.url, "ok")
        r = httpx.post(router.url + "/v1/completions", timeout=120,
                       headers={"Authorization": "Bearer sk-alpha"},
                       json={"model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True, "cache_salt": "mine"})
        assert r.status_code == 200, r.text
        assert text(r) == text(complete(single.url, prompt))
        assert _metric(router.url, DISAGG, 'backend="auto"') == 1
        assert fetches(decode.url, "ok") == before + 1
        assert _metric(decode.url, "tandem_worker_auth_rejected_total") == 0
    finally:
        router.stop()
