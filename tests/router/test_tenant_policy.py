"""Tenant policy at the router and its check on workers: a client's `priority` only within
its tenant's range (router.yaml `priority`; anonymous: 0), its tenant's default when
omitted; a keyed worker honours a nonzero priority, and with --require-signed-requests
serves anything, only under the router's signature, each signature once; a tenant's
`cache_salt` limit counts the client's part only."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from tandem.protocol.openai_api import MAX_CACHE_SALT, CompletionRequest
from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, signed_headers
from tandem.router.auth import tenant_cache_salt
from tandem.router.priority import PriorityPolicy
from tandem.serving.api_server import ServerSettings
from tandem.serving.api_server import build_app as worker_app
from tests.router.test_router_app import Served, _wait_ready, router_app, stub_openai
from tests.serving.helpers import WORKER_KEY, worker_key_file

POLICY = {"default": {"min": 0, "max": 0, "default": 0},
          "tenants": {"alpha": {"min": 0, "max": 10, "default": 5},
                      "gold": {"min": -3, "max": 3, "default": 0}}}


@pytest.fixture()
def routed(tmp_path):
    seen: list = []
    stub = Served(stub_openai("stub0", seen))
    key = WorkerKey(worker_key_file(tmp_path))
    router = router_app([stub.url], {"sk-a": "alpha", "sk-b": "beta", "sk-g": "gold"},
                        worker_key=key, priority=PriorityPolicy.from_dict(POLICY))
    _wait_ready(router.url, 1)
    yield router.url, seen
    router.stop()
    stub.stop()


def post(url: str, key: str | None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", headers=headers, timeout=10,
                      json={"model": "stub-model", "prompt": "hi", **body})


def refused(r: httpx.Response, param: str, text: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err


def test_priority_follows_the_tenant_policy(routed):
    url, seen = routed
    for key, asked, sent in (("sk-a", None, 5), ("sk-a", 0, 0), ("sk-a", 10, 10),
                             ("sk-g", -3, -3), ("sk-g", None, None), ("sk-b", 0, 0),
                             ("sk-b", None, None)):
        extra = {} if asked is None else {"priority": asked}
        r = post(url, key, **extra)
        assert r.status_code == 200, (key, asked, r.text)
        assert seen[-1][1].get("priority") == sent, (key, asked, seen[-1][1])
    n = len(seen)
    for key, asked, allowed in (("sk-a", -1, "[0, 10]"), ("sk-a", 11, "[0, 10]"),
                                ("sk-g", -4, "[-3, 3]"), ("sk-b", -1, "only 0"),
                                ("sk-b", -10**18, "only 0")):
        refused(post(url, key, priority=asked), "priority", f"priority {asked} is not allowed")
        refused(post(url, key, priority=asked), "priority", allowed)
    refused(post(url, "sk-a", priority="1"), "priority", "an integer")
    assert len(seen) == n  # nothing refused reached the worker


def test_anonymous_requests_may_use_priority_0_only(tmp_path):
    seen: list = []
    stub = Served(stub_openai("stub0", seen))
    router = router_app([stub.url], worker_key=WorkerKey(worker_key_file(tmp_path)),
                        priority=PriorityPolicy.from_dict(POLICY))
    try:
        _wait_ready(router.url, 1)
        assert post(router.url, None, priority=0).status_code == 200
        refused(post(router.url, None, priority=-1), "priority", "anonymous requests")
        refused(post(router.url, None, priority=-10**18), "priority", "only 0")
        assert len(seen) == 1
    finally:
        router.stop()
        stub.stop()


def test_priority_policy_config_errors():
    for bad, match in (({"default": {"min": 1, "max": 0}}, "min <= default <= max"),
                       ({"tenants": {"a": {"min": 0, "max": 2**31}}}, "tenants.a: max"),
                       ({"tenants": {"a": {"max": 1, "maximum": 2}}}, "unknown keys"),
                       ({"tenant": {}}, "expected"), ({"tenants": {"a": 3}}, "tenants.a")):
        with pytest.raises(ValueError, match=match):
            PriorityPolicy.from_dict(bad)
    assert PriorityPolicy.from_dict(None).range_for("anyone").max == 0


def test_a_tenant_salt_limit_counts_the_client_part_only(routed):
    url, seen = routed
    client = "s" * MAX_CACHE_SALT
    assert post(url, "sk-a", cache_salt=client).status_code == 200
    sent = seen[-1][1]["cache_salt"]
    assert sent.startswith("tenant=alpha;ns=") and sent.endswith(";" + client)
    refused(post(url, "sk-a", cache_salt=client + "s"), "cache_salt",
            f"at most {MAX_CACHE_SALT} characters")
    # the longest tenant name's namespace plus the longest client salt: a worker accepts it
    longest = tenant_cache_salt("t" * 128, client, WORKER_KEY)
    assert CompletionRequest(model="m", prompt="hi", cache_salt=longest).cache_salt == longest
    with pytest.raises(ValueError, match="at most 256"):  # a client's own salt, unprefixed
        CompletionRequest(model="m", prompt="hi", cache_salt=client + "s")
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="hi", priority=-10**18)


# -- the worker's side ------------------------------------------------------------------------
def _worker(tmp_path, key: bool = True, require_signed: bool = False) -> TestClient:
    def load():
        raise RuntimeError("no engine in this test")

    settings = ServerSettings(served_model_name="m", require_signed=require_signed,
                              auth_key=WorkerKey(worker_key_file(tmp_path)) if key else None)
    return TestClient(worker_app(settings, load))


JSON = {"Content-Type": "application/json"}


def _error(r: httpx.Response) -> str:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["param"] == SIGNATURE_HEADER
    return err["message"]


def test_a_keyed_worker_honours_priority_only_when_signed(tmp_path):
    """503 (the engine failed to load) is the answer a request gets once past the check."""
    body = json.dumps({"model": "m", "prompt": "hi", "priority": -5}).encode()
    with _worker(tmp_path) as client:
        assert "a nonzero priority" in _error(client.post("/v1/completions", content=body,
                                                          headers=JSON))
        chat = {"model": "m", "priority": 1, "messages": [{"role": "user", "content": "x"}]}
        assert "a nonzero priority" in _error(client.post("/v1/chat/completions", json=chat))
        assert client.post("/v1/completions", content=body,
                           headers={**JSON, **signed_headers(WORKER_KEY, body)}).status_code == 503
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                     "priority": 0}).status_code == 503
    with _worker(tmp_path, key=False) as client:  # no key: priority as vLLM has it
        assert client.post("/v1/completions", content=body,
                           headers=JSON).status_code == 503


def test_require_signed_requests_and_replays(tmp_path):
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    with _worker(tmp_path, require_signed=True) as client:
        for path, payload in (("/v1/completions", body),
                              ("/tokenize", b'{"prompt": "hi"}'),
                              ("/detokenize", b'{"tokens": [1]}')):
            r = client.post(path, content=payload, headers=JSON)
            assert "--require-signed-requests" in _error(r)
        headers = {**JSON, **signed_headers(WORKER_KEY, body)}
        assert client.post("/v1/completions", content=body, headers=headers).status_code == 503
        again = _error(client.post("/v1/completions", content=body, headers=headers))
        assert again.startswith("replayed x-tandem-signature"), again
        for path in ("/health", "/ready", "/v1/models"):  # no signature needed (503: no engine)
            assert client.get(path).status_code == 503
        metrics = client.get("/metrics").text
        assert 'reason="replayed"} 1.0' in metrics and 'reason="missing"} 3.0' in metrics
    with _worker(tmp_path) as client:  # without the flag: plain requests go unsigned
        assert client.post("/v1/completions", content=body,
                           headers=JSON).status_code == 503


def test_require_signed_requests_needs_a_key():
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "worker",
                           "--require-signed-requests"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--require-signed-requests needs --worker-auth-key-file" in proc.stderr
