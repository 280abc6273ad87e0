"""`tandem worker --api-key` (vLLM's flag), over real sockets against a real worker: the API
needs one of the keys as a bearer token, or the router's signature; probes stay open. The
same worker's log shows vLLM's weight-loading progress line and, under load, its status
line (every second here)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tandem.engine.errors import ConfigError
from tandem.protocol.bundled import BUNDLED_NAME
from tandem.protocol.signing import SIGNATURE_HEADER
from tandem.serving.api_server import SIGNED_ROUTES
from tandem.serving.lora_api import LOAD_PATH, UNLOAD_PATH
from tandem.serving.worker import API_KEY_ENV, api_keys
from tests.serving.helpers import free_port, signed, start_worker

pytestmark = pytest.mark.slow
KEYS = ("key-one-0123", "key-two-4567")
COMPLETION = {"model": BUNDLED_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": BUNDLED_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
# every route but the probes, with a body it would accept
PROTECTED = [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
             ("POST", "/v1/chat/completions", CHAT),
             ("POST", "/tokenize", {"model": BUNDLED_NAME, "prompt": "hi"}),
             ("POST", "/detokenize", {"model": BUNDLED_NAME, "tokens": [1, 2]}),
             ("POST", LOAD_PATH, {"lora_name": "a", "lora_path": "/nowhere"}),
             ("POST", UNLOAD_PATH, {"lora_name": "a"}), ("GET", "/openapi.json", None)]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A worker with two API keys and the router's signing key (start_worker's)."""
    w = start_worker(tmp_path_factory.mktemp("apikey"), "--api-key", *KEYS,
                     "--log-stats-interval", "1", "--num-threads", "1",
                     "--num-kv-blocks", "64")
    yield w
    assert w.stop() == 0, w.log()


def call(url: str, method: str, path: str, body: dict | None, headers: dict | None = None
         ) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=120)


def unauthorized(r: httpx.Response, message: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"error": {"message": message, "type": "authentication_error",
                                  "param": None, "code": 401}}


def test_every_api_route_needs_a_key_and_probes_do_not(keyed):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(keyed.url + path, timeout=10).status_code == 200, path
    for method, path, body in PROTECTED:
        unauthorized(call(keyed.url, method, path, body),
                     "missing Authorization: Bearer <key>")
        for auth in ("Bearer wrong-key", f"Basic {KEYS[0]}", f"Bearer {KEYS[0]}x"):
            unauthorized(call(keyed.url, method, path, body, {"Authorization": auth}),
                         "invalid API key")


def test_either_key_serves(keyed):
    for key in KEYS:
        auth = {"Authorization": f"Bearer {key}"}
        r = call(keyed.url, "POST", "/v1/completions", COMPLETION, auth)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert call(keyed.url, "GET", "/v1/models", None, auth).json()["data"][0]["id"] == \
            BUNDLED_NAME
        tokens = call(keyed.url, "POST", "/tokenize", {"prompt": "hi"}, auth).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
    # the key is checked before the route: a keyed caller gets the route's own answers
    r = call(keyed.url, "POST", LOAD_PATH, {"lora_name": "a", "lora_path": "/x"},
             {"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 403, r.text  # LoRA admin stays the router's (signed) only


def test_a_router_signed_request_needs_no_key(keyed):
    body, headers = signed(COMPLETION)
    r = httpx.post(keyed.url + "/v1/completions", content=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    # each signature is accepted once: its replay has neither key nor signature
    r = httpx.post(keyed.url + "/v1/completions", content=body, headers=headers, timeout=120)
    unauthorized(r, f"invalid API key and replayed {SIGNATURE_HEADER}: this signature was "
                    "already used (send Authorization: Bearer <key>)")
    # a forged signature is no key either, on a route that checks signatures or not
    forged = {SIGNATURE_HEADER: "t=1,n=2,v1=3"}
    for method, path, payload in PROTECTED:
        r = call(keyed.url, method, path, payload, forged)
        if path in (LOAD_PATH, UNLOAD_PATH):  # admin calls: the router's signature only
            assert r.status_code == 403 and "malformed x-tandem-signature" in r.text, r.text
        elif path in SIGNED_ROUTES:
            unauthorized(r, "invalid API key and malformed x-tandem-signature (expected "
                            "t=<unix seconds>,n=<32 hex>,v1=<64 hex>) (send Authorization: "
                            "Bearer <key>)")
        else:
            unauthorized(r, "missing Authorization: Bearer <key>")
    r = httpx.get(keyed.url + "/v1/models", headers=signed({})[1], timeout=10)
    unauthorized(r, "missing Authorization: Bearer <key>")


def test_the_log_shows_loading_progress_and_a_status_line_under_load(keyed):
    lines = keyed.log().splitlines()
    assert any(line.startswith("Loading GGUF checkpoint tensors: 100% Completed | ")
               for line in lines), lines[:20]
    auth = {"Authorization": f"Bearer {KEYS[1]}"}
    r = call(keyed.url, "POST", "/v1/completions",
             {**COMPLETION, "max_tokens": 24, "ignore_eos": True}, auth)
    assert r.status_code == 200, r.text

    def status_lines() -> list[str]:
        return [line.split(": ", 1)[1] for line in keyed.log().splitlines()
                if "tandem.serving.stats_logger" in line]

    deadline = time.monotonic() + 10
    zeros = ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
             "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
             "Prefix cache hit rate: ")
    while not (status_lines() and status_lines()[-1].startswith(zeros)):
        assert time.monotonic() < deadline, keyed.log()
        time.sleep(0.2)
    seen = status_lines()
    assert any(", Avg generation throughput: 0.0 " not in line for line in seen), seen
    time.sleep(2.5)  # idle: no more lines at INFO
    assert status_lines() == seen


def test_keys_come_from_the_flag_else_the_environment():
    assert api_keys(["a", "b"], {API_KEY_ENV: "env"}) == ("a", "b")
    assert api_keys(None, {API_KEY_ENV: "env"}) == ("env",)
    assert api_keys(None, {}) == ()
    with pytest.raises(ConfigError, match="may not be empty"):
        api_keys([" "], {})
    with pytest.raises(ConfigError, match=r"^\$TANDEM_API_KEY: a key may not be empty"):
        api_keys(None, {API_KEY_ENV: "  "})  # named where it came from


def test_a_key_longer_than_any_bearer_token_compared_is_refused():
    """The middleware refuses bearer tokens over MAX_KEY_LEN unread: a longer key would
    parse, then lock every client out."""
    from tandem.serving.worker_auth import MAX_KEY_LEN, ApiKeyAuth

    longest = "k" * MAX_KEY_LEN
    assert api_keys([longest], {}) == (longest,)
    assert ApiKeyAuth(None, [longest]).valid(f"Bearer {longest}".encode())
    with pytest.raises(ConfigError, match=f"^--api-key: a key is at most {MAX_KEY_LEN} "):
        api_keys([longest + "k"], {})
    with pytest.raises(ConfigError, match=r"^\$TANDEM_API_KEY: a key is at most"):
        api_keys(None, {API_KEY_ENV: longest + "k"})


def test_a_blank_key_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "--port",
                        str(free_port()), "--api-key", " "],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "tandem worker: error: --api-key: a key may not be empty or blank")
