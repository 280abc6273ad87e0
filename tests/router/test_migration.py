"""Request migration through a real router process and real worker processes (a tiny random
model): a worker killed with SIGKILL mid-stream, and its streams go on on another worker,
token for token as an undisturbed run (greedy and seeded; logprobs, a stop string, usage),
for completions and chat; a stream that cannot be migrated (n > 1) ends with one clean
error event. The bound and draining workers: `test_migration_relay.py`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tandem.protocol.migration import RESUME_HEADER, TOKENS_HEADER, Resume, signed_target
from tandem.protocol.signing import SIGNATURE_HEADER, sign
from tests.engine.utils import make_tiny_model_dir
from tests.router.test_router_integration import RouterProcess, _metric
from tests.serving.helpers import WORKER_KEY, start_worker, wait_for

MIGRATIONS = "tandem_router_migrations_total"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A router over two workers, the second frozen (SIGSTOP) so that every stream starts on
    the first: (router, first, second)."""
    tmp = tmp_path_factory.mktemp("migration")
    model = tmp / "model"
    make_tiny_model_dir(model, "llama", seed=5, tokenizer="trained",
                        max_position_embeddings=1024)
    common = ("--model", str(model), "--served-model-name", "tiny", "--num-threads", "1",
              "--num-kv-blocks", "512", "--block-size", "16")
    workers = [start_worker(tmp, *common, wait_ready=False) for _ in range(2)]
    router = None
    try:
        for w in workers:
            wait_for(w, "/ready", 200, timeout=240)
        os.kill(workers[1].proc.pid, signal.SIGSTOP)
        router = RouterProcess(tmp, [w.url for w in workers], "--max-migrations", "1")
        wait_for(router, "/ready", 200, timeout=60)
        yield router, *workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            if w.proc.poll() is None:
                w.stop(signal.SIGKILL)


def ready_in_router(router, worker, want: float, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while _metric(router.url, "tandem_router_worker_ready", f'worker="{worker.url}"') != want:
        assert time.monotonic() < deadline, router.log()
        time.sleep(0.05)


class Stream:
    """One SSE stream read on a thread: its events as they come."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.events: list[dict | str] = []
        self.raw: list[str] = []
        self.worker: str | None = None
        self.started = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url + path, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                self.worker = r.headers.get("x-tandem-worker")
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    self.raw.append(line)
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        if self.tokens_seen() >= 1:
                            self.started.set()
        finally:
            self.started.set()
            self.done.set()

    def tokens_seen(self) -> int:
        n = 0
        for e in self.events:
            if isinstance(e, dict) and e.get("choices"):
                c = e["choices"][0]
                n += bool(c.get("text") or (c.get("delta") or {}).get("content"))
        return n

    def result(self) -> dict:
        assert self.done.wait(60)
        return joined(self.events, self.raw)


def joined(events: list, raw: list[str]) -> dict:
    """What a client makes of a stream: text, logprobs, usage, ids, roles, errors."""
    out = {"text": "", "ids": set(), "created": set(), "roles": 0, "errors": [], "finish": None,
           "usage": None, "lp": [], "done": events[-1:] == ["[DONE]"],
           "comments": [r for r in raw if r.startswith(":")]}
    for e in events:
        if e == "[DONE]":
            continue
        if "error" in e:
            out["errors"].append(e["error"])
            continue
        out["ids"].add(e["id"])
        out["created"].add(e["created"])
        if e.get("usage"):
            out["usage"] = {k: e["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                       "total_tokens")}
        for c in e["choices"]:
            delta = c.get("delta")
            if delta is not None:
                out["roles"] += "role" in delta
                out["text"] += delta.get("content") or ""
                lp = (c.get("logprobs") or {}).get("content") or []
                out["lp"] += [(t["token"], round(t["logprob"], 3)) for t in lp]
            else:
                out["text"] += c["text"]
                lp = c.get("logprobs")
                if lp:  # (text_offset depends on how the engine's deltas were chunked)
                    out["lp"] += list(zip(lp["tokens"], [round(x, 3) for x in
                                                         lp["token_logprobs"]], strict=True))
            out["finish"] = c.get("finish_reason") or out["finish"]
    return out


def direct(url: str, path: str, body: dict) -> dict:
    """An undisturbed run, straight to a worker."""
    return Stream(url, path, body).result()


def direct_all(url: str, plan: list[tuple[str, dict]]) -> list[dict]:
    """Undisturbed runs of every (path, body), at once."""
    return [s.result() for s in [Stream(url, path, body) for path, body in plan]]


def late_stop(text: str) -> str:
    """A 3-character stop string that first occurs in the last third of `text`."""
    for i in range(len(text) * 2 // 3, len(text) - 3):
        cand = text[i:i + 3]
        if cand.strip() and text.find(cand) == i:
            return cand
    raise AssertionError("no late stop string in " + repr(text))


COMPLETION = {"model": "tiny", "prompt": "The river flows", "max_tokens": 500,
              "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something long."}],
        "max_tokens": 500, "ignore_eos": True}


def test_token_ids_and_resumes_need_the_routers_signature(fleet):
    _, first, _ = fleet
    url = first.url + "/v1/completions"
    body = json.dumps({**COMPLETION, "max_tokens": 4, "stream": True}).encode()
    resume = Resume("cmpl-x", 5, 0, [40, 41]).encode()

    def post(headers: dict, content: bytes = body) -> httpx.Response:
        return httpx.post(url, content=content, timeout=60,
                          headers={"Content-Type": "application/json", **headers})

    for headers in ({TOKENS_HEADER: "1"}, {RESUME_HEADER: resume},
                    {RESUME_HEADER: resume,  # signed without the header: another target
                     SIGNATURE_HEADER: sign(WORKER_KEY, body, None)}):
        r = post(headers)
        assert r.status_code == 403 and r.json()["error"]["param"] == SIGNATURE_HEADER, r.text
        assert "tandem-tokens" not in r.text

    def signed(headers: dict, content: bytes = body) -> httpx.Response:
        return post({**headers, SIGNATURE_HEADER: sign(WORKER_KEY, content,
                                                       signed_target(None, headers))}, content)

    r = signed({TOKENS_HEADER: "1"})
    assert r.status_code == 200 and r.text.startswith(": tandem-tokens "), r.text
    r = signed({RESUME_HEADER: resume})  # no token ids asked: none sent
    assert r.status_code == 200 and "tandem-tokens" not in r.text
    assert {json.loads(line[6:])["id"] for line in r.text.splitlines()
            if line.startswith("data: {")} == {"cmpl-x"}
    assert signed({RESUME_HEADER: "cmpl-x;5;0;!!"}).status_code == 400
    two = json.dumps({**COMPLETION, "max_tokens": 4, "stream": True, "n": 2}).encode()
    r = signed({RESUME_HEADER: resume}, two)
    assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"]


def test_a_stream_of_a_frozen_worker_goes_on_elsewhere_long_before_the_read_timeout(fleet):
    """SIGSTOP, not a kill: the connection stays open, so only the router's stall check (the
    stream silent `FROZEN_SILENT_S` while the worker's probes get no answer) ends the leg;
    the stream goes on on the other worker, token for token, in seconds (the read timeout
    is 600 s)."""
    router, first, second = fleet
    ready_in_router(router, second, 0)
    body = {**COMPLETION, "temperature": 0, "max_tokens": 300}
    want = direct(first.url, "/v1/completions", body)
    before = _metric(router.url, MIGRATIONS, 'reason="stalled",result="resumed"')
    stream = Stream(router.url, "/v1/completions", body)
    try:
        assert stream.started.wait(60)
        os.kill(first.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        os.kill(second.proc.pid, signal.SIGCONT)
        got = stream.result()
        took = time.monotonic() - t0
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    assert got["errors"] == [] and got["done"] and got["text"] == want["text"]
    assert took < 60, took
    assert _metric(router.url, MIGRATIONS, 'reason="stalled",result="resumed"') == before + 1
    ready_in_router(router, first, 1)  # as the next test expects: the second one frozen
    os.kill(second.proc.pid, signal.SIGSTOP)
    ready_in_router(router, second, 0)


def test_streams_of_a_killed_worker_go_on_elsewhere_token_for_token(fleet):
    router, first, second = fleet
    ready_in_router(router, second, 0)  # frozen: every stream starts on the first
    # long enough that none can end between the last one's first token and the SIGSTOP,
    # however loaded the machine (500 tokens once did, under a busy CI worker)
    long = {"max_tokens": 960}
    greedy = {**COMPLETION, **long, "temperature": 0, "logprobs": 2,
              "stream_options": {"include_usage": True}}
    seeded_chat = {**CHAT, **long, "temperature": 0.9, "seed": 1234, "logprobs": True}
    seeded_chat["stop"] = late_stop(direct(first.url, "/v1/chat/completions",
                                           seeded_chat)["text"])
    seeded_chat["stream_options"] = {"include_usage": True}
    greedy_chat = {**CHAT, **long, "temperature": 0}
    seeded = {**COMPLETION, **long, "temperature": 1.0, "seed": 7, "top_k": 20}
    two = {**COMPLETION, **long, "temperature": 1.0, "seed": 7, "n": 2}
    plan = [("/v1/completions", greedy), ("/v1/chat/completions", greedy_chat),
            ("/v1/chat/completions", seeded_chat), ("/v1/completions", seeded),
            ("/v1/completions", two)]
    want = direct_all(first.url, plan)
    before = _metric(router.url, MIGRATIONS, 'result="resumed"')
    streams = [Stream(router.url, path, body) for path, body in plan]
    assert all(s.started.wait(60) for s in streams)
    os.kill(first.proc.pid, signal.SIGSTOP)  # every stream stops where it is
    assert not any(s.done.is_set() for s in streams)
    assert {s.worker for s in streams} == {first.url}
    os.kill(second.proc.pid, signal.SIGCONT)
    ready_in_router(router, second, 1)
    first.stop(signal.SIGKILL)
    got = [s.result() for s in streams]
    for i, (g, w) in enumerate(zip(got[:4], want, strict=False)):
        assert g["errors"] == [] and g["done"], (i, g["errors"])
        assert g["text"] == w["text"] and g["finish"] == w["finish"], i
        assert g["lp"] == w["lp"] and g["usage"] == w["usage"], i
        assert len(g["ids"]) == len(g["created"]) == 1 and g["comments"] == [], i
        assert g["roles"] == w["roles"], i
    assert got[2]["finish"] == "stop"
    # n > 1 cannot be replayed: the text so far, then one clean error event and [DONE]
    bad = got[4]
    assert bad["done"] and len(bad["errors"]) == 1 and bad["errors"][0]["code"] == 502
    assert 0 < len(bad["text"]) < len(want[4]["text"])
    assert _metric(router.url, MIGRATIONS, 'result="resumed"') == before + 4
    assert _metric(router.url, MIGRATIONS, 'result="not_replayable"') == 1
