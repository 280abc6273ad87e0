"""The router's Responses API: `POST /v1/responses` routed like chat (same rendering, same
block hashes), a `previous_response_id` followed to the worker that stored it (even by a
router that did not relay it), `GET` / `DELETE` by id relayed there, each tenant seeing
only its own responses; with the official openai client, over real sockets, in front of two
real worker apps (a tiny random model)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from tandem.protocol.signing import WorkerKey
from tandem.protocol.tokenizer import Tokenizer
from tandem.protocol.web import APIError
from tandem.router import prompt as prompts
from tandem.router import responses, usage
from tandem.router.core import Router, RouterSettings
from tandem.router.responses import ResponseLocations
from tandem.router.workers import Worker
from tandem.serving.api_server import ServerSettings
from tests.engine.utils import make_tiny_model_dir
from tests.router.test_router_app import Served, _wait_ready, router_app
from tests.serving.helpers import worker_key_file
from tests.serving.tiny_worker import TINY_BLOCK, tiny_worker

NAME = "tiny"
BLOCK = TINY_BLOCK
KEYS = {"key-alice": "alice", "key-bob": "bob"}
BASE = {"model": NAME, "temperature": 0, "max_output_tokens": 4}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two worker apps; `route(**settings)` starts a router (round-robin, so a request that
    is not pinned to a worker goes to the other one) in front of both."""
    path = tmp_path_factory.mktemp("tiny-responses-route")
    make_tiny_model_dir(path, "llama", seed=3)
    key_file = worker_key_file(path)
    workers, apps = [], []
    for _ in range(2):
        worker, app = tiny_worker(path, ServerSettings(served_model_name=NAME,
                                                       auth_key=WorkerKey(key_file)))
        workers.append(worker)
        apps.append(app)
    tok = Tokenizer.load(path)
    routers: list[Served] = []

    def route(keys: dict[str, str] | None = KEYS) -> Served:
        router = Router(RouterSettings(policy="round-robin", seed=0), lambda model: tok)
        served = router_app([w.url for w in workers], keys, router=router,
                            worker_key=WorkerKey(key_file), debug_headers=True)
        _wait_ready(served.url, 2)
        routers.append(served)
        return served

    yield workers, apps, tok, route
    for s in [*routers, *workers]:
        s.stop()


def _client(router: Served, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0)


def test_a_conversation_follows_its_stored_response_to_its_worker(cluster):
    workers, _, _, route = cluster
    router = route()
    alice = _client(router)
    raw = alice.responses.with_raw_response.create(input="My name is Ada.", **BASE)
    first, holder = raw.parse(), raw.headers["x-tandem-worker"]
    assert first.status == "incomplete" and first.output_text
    # round-robin would send the next request to the other worker: it goes to the holder
    for _ in range(2):
        raw = alice.responses.with_raw_response.create(input="What is my name?",
                                                       previous_response_id=first.id, **BASE)
        assert raw.headers["x-tandem-worker"] == holder
    second = raw.parse()
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # streamed through the router: the OpenAI event sequence, and the stream is located too
    events = list(alice.responses.create(input="And now?", previous_response_id=second.id,
                                         stream=True, **BASE))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    third = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        third.output_text
    assert alice.responses.retrieve(third.id).output_text == third.output_text
    # another router replica (it relayed none of them) finds the worker holding each
    other = _client(route())
    assert other.responses.retrieve(first.id).id == first.id
    raw = other.responses.with_raw_response.create(input="Again?",
                                                   previous_response_id=third.id, **BASE)
    assert raw.headers["x-tandem-worker"] == holder and raw.parse().status == "incomplete"
    other.responses.delete(first.id)
    for client in (alice, other):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)


def test_each_tenant_sees_only_its_own_responses(cluster):
    *_, route = cluster
    router = route()
    alice, bob = _client(router), _client(router, "key-bob")
    mine = alice.responses.create(input="A secret", **BASE)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError) as err:
        bob.responses.create(input="Tell me", previous_response_id=mine.id, **BASE)
    assert err.value.body["param"] == "previous_response_id"
    assert alice.responses.retrieve(mine.id).id == mine.id  # bob's delete did nothing
    with pytest.raises(openai.AuthenticationError):
        _client(router, "key-nobody").responses.retrieve(mine.id)


def test_responses_and_chat_of_one_conversation_share_cached_blocks(cluster):
    workers, apps, tok, route = cluster
    router = route(keys=None)
    system = "You answer in one short sentence, in English, and never more than that."
    question = "Which river runs through the old town of Prague, and where does it end?"
    body = {**BASE, "instructions": system, "input": question}
    raw = httpx.post(f"{router.url}/v1/responses", json=body, timeout=60)
    assert raw.status_code == 200, raw.text
    engine = apps[[w.url for w in workers].index(raw.headers["x-tandem-worker"])] \
        .state.holder.get()
    parsed = prompts.parse("responses", body, tok)
    chat = prompts.parse("chat", {"model": NAME, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}, tok)
    assert parsed.token_ids == chat.token_ids
    assert raw.json()["usage"]["input_tokens"] == len(parsed.token_ids)
    chain = prompts.block_hashes(parsed, NAME, BLOCK)
    assert len(chain) >= 8 and engine.cached_prefix_len(chain) == len(chain)


@pytest.mark.parametrize(("extra", "param", "at_router"), [
    ({"background": True}, "background", True), ({"seed": 1}, "seed", True),
    ({"tools": [{"type": "file_search"}]}, "tools.0", True),
    ({"max_output_tokens": 10**6}, "max_output_tokens", False),  # the worker's context check
])
def test_bad_bodies_are_named_400s(cluster, extra, param, at_router):
    *_, route = cluster
    router = route()
    r = httpx.post(f"{router.url}/v1/responses", json={**BASE, "input": "x", **extra},
                   headers={"Authorization": "Bearer key-alice"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert ("x-tandem-worker" not in r.headers) == at_router  # refused before any worker
    missing = httpx.get(f"{router.url}/v1/responses/resp_unknown",
                        headers={"Authorization": "Bearer key-alice"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_token_accounting_reads_the_responses_usage():
    completed = {"type": "response.completed", "sequence_number": 9,
                 "response": {"id": "resp_x", "usage": {"input_tokens": 5, "output_tokens": 2,
                                                        "total_tokens": 7}}}
    assert usage.answer_usage(json.dumps(completed).encode()) == (7, 0)
    assert usage.answer_usage(json.dumps(completed["response"]).encode()) == (7, 0)
    assert usage.worst_case("responses", {"max_output_tokens": 5}, 10, 100) == (15, 10)


def test_locations_are_bounded_and_foreign_ids_are_looked_for_nowhere():
    where = ResponseLocations(capacity=2)
    where.record("alice", "resp_a", "w1")
    where.record(None, "resp_b", "w2")
    assert where.get("alice", "resp_a") == "w1"  # now the most recently used
    where.record("alice", "resp_c", "w1")
    assert (where.get(None, "resp_b"), where.get("bob", "resp_a"), len(where)) == (None, None, 2)

    def no_client() -> None:
        raise AssertionError("asked the workers")

    worker = Worker(id="http://w", model=NAME, ready=True)
    ra = SimpleNamespace(router=SimpleNamespace(workers={worker.id: worker}),
                         locations=where, client=no_client,
                         settings=SimpleNamespace(worker_key=None))
    assert asyncio.run(responses.locate(ra, "alice", "resp_unknown")) is None


def test_searches_for_unknown_ids_are_bounded():
    """At most `max_searches` searches of the workers at once: the next is a 429 that asks
    no worker; a finished search frees its place."""
    where = ResponseLocations(max_searches=1)
    asked: list[str] = []
    release = asyncio.Event()

    class Client:
        async def get(self, url: str, **_: object) -> SimpleNamespace:
            asked.append(url)
            await release.wait()
            return SimpleNamespace(status_code=404)

    worker = Worker(id="http://w", model=NAME, ready=True)
    ra = SimpleNamespace(router=SimpleNamespace(workers={worker.id: worker}),
                         locations=where, client=Client,
                         settings=SimpleNamespace(worker_key=None))
    rid = "resp_" + "0" * 32

    async def run() -> None:
        first = asyncio.create_task(responses.locate(ra, "alice", rid))
        await asyncio.sleep(0)
        assert where.searching == 1
        with pytest.raises(APIError) as refused:
            await responses.locate(ra, "bob", rid)
        assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
        for _ in range(5):  # the first search reaches its worker; the refused one never does
            await asyncio.sleep(0)
        assert len(asked) == 1
        release.set()
        assert await first is None and where.searching == 0
        assert await responses.locate(ra, "bob", rid) is None and len(asked) == 2

    asyncio.run(run())


def test_the_routers_max_tokens_cap_bounds_max_output_tokens():
    from tandem.router.stages import check_bounds

    ra = SimpleNamespace(settings=SimpleNamespace(max_tokens_cap=10))
    check_bounds(ra, {"max_output_tokens": 10})
    with pytest.raises(ValueError, match="max_output_tokens: at most 10"):
        check_bounds(ra, {"max_output_tokens": 11})
