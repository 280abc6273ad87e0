"""A model served under several names (`--served-model-name A B`): the worker answers under
each (its answers and block hashes use the first) and lists each; the router learns every
name from the worker's readiness report, routes each, lists each (no `parent`: they are not
adapters) and hashes prompts for any of them under the first, as the worker does."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.protocol.bundled import BUNDLED_NAME, find_bundled_gguf
from tandem.protocol.tokenizer import Tokenizer
from tandem.router import prompt as prompts
from tandem.router.core import Router, RouterSettings
from tandem.router.workers import Worker
from tests.router.test_router_app import Served, _wait_ready, router_app

PRIMARY, ALIAS = "smol", "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_router_hashes_an_alias_under_the_primary_name():
    tok = Tokenizer.load(find_bundled_gguf())
    router = Router(RouterSettings(seed=0), lambda model: tok)
    router.add_worker(Worker(id="http://w", model=PRIMARY, aliases=frozenset({ALIAS}),
                             ready=True, block_size=16))
    router.add_worker(Worker(id="http://v", model="other", ready=True, block_size=16))
    assert router.base_model(ALIAS) == (PRIMARY, None)  # the base model, not an adapter
    assert router.models() == sorted([PRIMARY, ALIAS, "other"])
    parsed = prompts.parse("completions", {"model": ALIAS, "prompt": "word " * 80}, tok)
    assert router.hashes(parsed, ALIAS) == router.hashes(parsed, PRIMARY)
    assert next(iter(router.hashes(parsed, ALIAS).values())) == prompts.block_hashes(
        parsed, PRIMARY, 16)
    decision, _ = router.route(parsed, ALIAS, time.monotonic())
    assert decision is not None and decision.worker.id == "http://w"


@pytest.fixture(scope="module")
def worker():
    """A real worker app (the bundled model, in-process, on a real port) under two names."""
    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.serving.api_server import ServerSettings, build_app

    app = build_app(ServerSettings(served_model_name=PRIMARY, served_model_aliases=(ALIAS,)),
                    lambda: AsyncLLMEngine.from_args(served_model_name=[PRIMARY, ALIAS],
                                                     num_kv_blocks=64, num_threads=1))
    served = Served(app, lean=False)
    deadline = time.monotonic() + 120
    while httpx.get(served.url + "/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    yield served
    served.stop()


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 3,
        "temperature": 0})


@pytest.mark.slow
def test_a_worker_answers_and_lists_every_served_name(worker):
    ready = httpx.get(worker.url + "/ready", timeout=5).json()
    assert ready["model"] == PRIMARY and ready["models"] == [PRIMARY, ALIAS]
    models = httpx.get(worker.url + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(PRIMARY, None), (ALIAS, None)]
    texts = set()
    for name in (PRIMARY, ALIAS):
        r = _complete(worker.url, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == PRIMARY  # as vLLM: answers name the first
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1  # one model under both names
    r = _complete(worker.url, BUNDLED_NAME)  # neither served name
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"The model `{BUNDLED_NAME}` does not exist."


@pytest.mark.slow
def test_the_router_learns_and_routes_every_served_name(worker):
    router = router_app([worker.url])
    try:
        _wait_ready(router.url, 1)
        models = httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
        assert sorted((m["id"], "parent" in m) for m in models) == sorted(
            [(PRIMARY, False), (ALIAS, False)])
        for name in (ALIAS, PRIMARY):
            r = _complete(router.url, name)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == PRIMARY
        r = _complete(router.url, "gpt-17")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    finally:
        router.stop()
