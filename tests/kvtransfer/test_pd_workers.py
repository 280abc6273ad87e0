"""Prefill/decode disaggregation between real worker processes over real gRPC: greedy tokens
through prefill -> transfer -> decode equal a single aggregated worker's (with the `grpc` and
the `torch` transfer backends), only missing blocks travel, and the failure policies hold."""

from __future__ import annotations

import random

import httpx
import pytest

from tandem.protocol.bundled import BUNDLED_NAME
from tests.serving.helpers import free_port, metric, signed, start_worker, wait_for

pytestmark = pytest.mark.slow
BS = 16
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * BS * HEAD_DIM * 4  # every layer's K + V, float32


def fetched_bytes(url: str) -> float:
    return metric(url, "tandem_kvtransfer_received_bytes_total")


def fetches(url: str, result: str, backend: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if (line.startswith("tandem_kvtransfer_fetches_total{") and f'result="{result}"' in line
                and (not backend or f'backend="{backend}"' in line)):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    grpc_port = free_port()
    common = ("--num-threads", "1", "--num-kv-blocks", "256")
    prefill = start_worker(tmp, "--role", "prefill", "--grpc-port", str(grpc_port), *common,
                           wait_ready=False)
    decode = start_worker(tmp, "--role", "decode", "--grpc-port", str(free_port()),
                          "--kv-transfer-backend", "grpc", *common, wait_ready=False)
    single = start_worker(tmp, "--role", "both", *common, wait_ready=False)
    torch_decode = start_worker(tmp, "--role", "decode", "--kv-transfer-backend", "torch",
                                "--kv-transfer-host", "127.0.0.1", *common, wait_ready=False)
    # sends each layer as it is computed; a small token budget splits long prompts into
    # several steps, of which only the last is streamed
    streamed_port = free_port()
    streamed = start_worker(tmp, "--role", "prefill", "--grpc-port", str(streamed_port),
                            "--kv-stream-layers", "--max-num-batched-tokens", "128", *common,
                            wait_ready=False)
    workers = (prefill, decode, single, torch_decode, streamed)
    try:
        for w in workers:
            wait_for(w, "/ready", 200, timeout=240)
        yield prefill, {"grpc": decode, "torch": torch_decode}, single, \
            f"127.0.0.1:{grpc_port}", f"127.0.0.1:{streamed_port}"
    finally:
        for w in workers:
            w.stop()


def complete(url: str, prompt, prefill: str | None = None, **extra) -> dict:
    """Greedy completion; with `prefill`, signed as the router would (P/D)."""
    body, headers = signed({"model": BUNDLED_NAME, "prompt": prompt, "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True, **extra}, prefill)
    r = httpx.post(url + "/v1/completions", timeout=120, headers=headers, content=body)
    assert r.status_code == 200, r.text
    return r.json()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def assert_same_tokens(single, decode, prefill: str, cases: list) -> int:
    """Each (name, prompt, extra) case: greedy text through `decode` with its pages from
    `prefill` equals the single aggregated worker's; and whenever anything was imported the
    decode worker computed only the prompt's last token (the partial last block came over
    too). Returns how many cases imported pages."""
    imported = 0
    for name, prompt, extra in cases:
        want = complete(single.url, prompt, **extra)["choices"][0]["text"]
        before = fetched_bytes(decode.url)
        got = complete(decode.url, prompt, prefill=prefill, **extra)
        assert got["choices"][0]["text"] == want, name
        usage = got["usage"]
        if fetched_bytes(decode.url) > before:
            imported += 1
            assert usage["prompt_tokens_details"]["cached_tokens"] == \
                usage["prompt_tokens"] - 1, name
    return imported


@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_disaggregated_tokens_equal_a_single_worker(pd, backend):
    prefill, decoders, single, target, _ = pd
    decode = decoders[backend]
    doc = ids(1, 300)
    cases = [
        ("one block and a token", ids(2, BS + 1), {}),
        ("short, nothing to send", ids(3, 9), {}),
        ("exact block multiple", ids(4, 8 * BS), {}),
        ("long", ids(5, 700), {}),
        ("document, cold", doc + ids(6, 40), {}),
        ("same document, decode holds its blocks", doc + ids(7, 57), {}),
        ("salted: no sharing with the unsalted blocks", doc + ids(6, 40), {"cache_salt": "t1"}),
        ("text prompt", "The quick brown fox jumps over the lazy dog. " * 12, {}),
    ]
    assert assert_same_tokens(single, decode, target, cases) == len(cases) - 1  # not "short"
    assert fetches(decode.url, "ok") >= len(cases) - 1
    assert fetched_bytes(decode.url) > 0
    assert fetches(decode.url, "ok", backend) >= len(cases) - 1  # through `backend`


@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_pages_streamed_layer_by_layer_give_the_same_tokens(pd, backend):
    _, decoders, single, _, streamed = pd
    decode = decoders[backend]
    doc = ids(30, 200)
    cases = [
        ("one step", ids(31, 5 * BS + 3), {}),
        ("several steps, the last one streamed", ids(32, 300), {}),
        ("cached document on the prefill side", doc + ids(33, 45), {}),
        ("same document, decode holds its blocks", doc + ids(34, 70), {}),
    ]
    ok = fetches(decode.url, "ok", backend)
    assert assert_same_tokens(single, decode, streamed, cases) == len(cases)
    assert fetches(decode.url, "ok", backend) == ok + len(cases)


def test_only_missing_blocks_travel_and_the_prefill_cache_is_used(pd):
    prefill, decoders, _, target, _ = pd
    decode = decoders["grpc"]
    head = ids(10, 20 * BS)
    before = fetched_bytes(decode.url)
    complete(decode.url, head + ids(11, 5), prefill=target)
    first = fetched_bytes(decode.url) - before
    # (20*16 + 5 - 1) // 16 = 20 full blocks, none held before, and the partial block with
    # the 4 tokens before the last
    assert first == 21 * BLOCK_BYTES
    # the decode worker now holds the 20 head blocks: only the 10 new ones come over (and
    # the new partial block)
    before = fetched_bytes(decode.url)
    prefill_hits = metric(prefill.url, "vllm:prefix_cache_hits_total")
    complete(decode.url, head + ids(12, 10 * BS + 3), prefill=target)
    assert fetched_bytes(decode.url) - before == 11 * BLOCK_BYTES
    # and the prefill worker served the head from its own prefix cache
    assert metric(prefill.url, "vllm:prefix_cache_hits_total") - prefill_hits >= 20 * BS


def test_an_unreachable_prefill_worker_is_recomputed_locally(pd):
    _, decoders, single, _, _ = pd
    decode = decoders["grpc"]
    prompt = ids(20, 5 * BS + 2)
    failed = fetches(decode.url, "unavailable") + fetches(decode.url, "rpc")
    got = complete(decode.url, prompt, prefill=f"127.0.0.1:{free_port()}")
    assert got["choices"][0]["text"] == complete(single.url, prompt)["choices"][0]["text"]
    assert fetches(decode.url, "unavailable") + fetches(decode.url, "rpc") == failed + 1


def test_an_echo_with_logprobs_is_computed_on_the_decode_worker(pd):
    """Prompt logprobs need every prompt position's logits: a decode worker asked to import
    pages for such a request computes the prompt itself instead, with the same answer."""
    _, decoders, single, target, _ = pd
    decode = decoders["grpc"]
    prompt = ids(21, 6 * BS + 3)
    extra = {"echo": True, "logprobs": 1, "max_tokens": 2}
    before = fetches(decode.url, "ok")
    assert_same_echo(complete(decode.url, prompt, prefill=target, **extra)["choices"][0],
                     complete(single.url, prompt, **extra)["choices"][0])
    assert fetches(decode.url, "ok") == before


def assert_same_echo(got: dict, want: dict) -> None:
    """Two echoed completion choices with logprobs: the same text and tokens, and the
    same prompt logprobs (the first none; the rest up to float noise)."""
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"][0] is None
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(
        want["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_a_malformed_prefill_target_is_a_400(pd):
    decode = pd[1]["grpc"]
    body, headers = signed({"model": BUNDLED_NAME, "prompt": "hi", "max_tokens": 1}, "no-port")
    r = httpx.post(decode.url + "/v1/completions", headers=headers, content=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-tandem-prefill"
