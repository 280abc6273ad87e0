"""How the worker's HTTP layer hands prompts to the engine: tokenized in its pool (neither
on the engine thread, where a long prompt would stall every running decode, nor on the
event loop), and a multi-prompt completion admitted in one engine command (one step, not
one step per prompt)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
from fastapi.testclient import TestClient

from tandem.engine.async_engine import AsyncLLMEngine, _Call
from tandem.protocol.tokenizer import Tokenizer
from tandem.serving.api_server import ServerSettings, build_app
from tests.engine.utils import make_tiny_model_dir

NAME = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-served")
    make_tiny_model_dir(path, "llama", seed=11)
    engines: list[AsyncLLMEngine] = []

    def load() -> AsyncLLMEngine:
        engines.append(AsyncLLMEngine.from_args(str(path), served_model_name=NAME,
                                                block_size=4, kv_cache_memory=32 << 20))
        return engines[0]

    app = build_app(ServerSettings(served_model_name=NAME), load)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client, engines[0]


def test_prompts_are_tokenized_in_the_pool_not_on_the_engine_or_the_event_loop(
        served, monkeypatch):
    client, engine = served
    seen: list[str] = []
    real_encode, real_template = Tokenizer.encode, Tokenizer.apply_chat_template

    def encode(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return real_encode(self, *args, **kwargs)

    def template(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return real_template(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    monkeypatch.setattr(Tokenizer, "apply_chat_template", template)
    body = {"model": NAME, "max_tokens": 2, "temperature": 0}
    r = client.post("/v1/completions", json={**body, "prompt": ["a text prompt", "another"]})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": "hi there"}]})
    assert r.status_code == 200, r.text
    r = client.post("/tokenize", json={"model": NAME, "prompt": "count me"})
    assert r.status_code == 200 and r.json()["count"] > 0
    assert len(seen) >= 5
    assert all(name.startswith("tandem-tokenize") for name in seen), seen


def test_a_bad_prompt_found_off_thread_is_still_a_400(served):
    client, _ = served
    r = client.post("/v1/completions", json={"model": NAME, "prompt": [[1, 2], [10**8]],
                                             "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_multi_prompt_completion_joins_one_engine_step(served):
    client, engine = served
    sched = engine.engine.scheduler
    steps: list[set[str]] = []
    real = sched.schedule

    def recording():
        out = real()
        steps.append({s.request.request_id for s in out.scheduled})
        return out

    gate = threading.Event()
    sched.schedule = recording  # type: ignore[method-assign]
    try:
        # the engine thread is busy (a long step) when the request arrives
        busy: concurrent.futures.Future = concurrent.futures.Future()
        engine._send(_Call(lambda e: gate.wait(10), busy))
        box: list = []
        t = threading.Thread(target=lambda: box.append(client.post("/v1/completions", json={
            "model": NAME, "prompt": [[100 + i, 200 + i, 300 + i] for i in range(4)],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True})))
        t.start()
        time.sleep(0.5)  # the handler has sent what it sends before the engine answers
        gate.set()
        t.join(60)
    finally:
        gate.set()
        sched.schedule = real  # type: ignore[method-assign]
    r = box[0]
    assert r.status_code == 200, r.text
    assert [len(c["text"]) >= 0 for c in r.json()["choices"]] == [True] * 4
    first = next(s for s in steps if s)
    assert len(first) == 4 and all(rid.rsplit("-", 1)[1] in "0123" for rid in first), steps
