"""LoRA through a real router process and two real LoRA workers (tiny model, gRPC load
reports): admin-only fan-out of adapter loads, `model` naming an adapter routed only to
workers holding it, affinity to the replica already running it while load allows,
adapter-aware prompt hashing (prefix hits per adapter, never across), and the outputs equal
the merged-weights model's."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.protocol.signing import SIGNATURE_HEADER, admin_target, sign
from tests.engine.utils import make_peft_adapter, make_tiny_model_dir, merge_adapter
from tests.router.test_router_integration import RouterProcess, _metric
from tests.serving.helpers import WORKER_KEY, free_port, start_worker

ADMIN, TENANT = "admin-key-0123456789", "tenant-key-0123456789"
NAMES = ("x", "y", "z", "w")


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-routing")
    base = root / "base"
    make_tiny_model_dir(base, "llama", seed=8, num_hidden_layers=2)
    cfg = json.loads((base / "config.json").read_text())
    allowed = root / "adapters"
    for i, name in enumerate(NAMES):
        w = make_peft_adapter(allowed / name, cfg, rank=4, alpha=8.0, seed=20 + i)
        if name == "x":
            merge_adapter(base, root / "x-merged", w, 2.0)
    (root / "keys").write_text(f"{TENANT} acme\n")
    (root / "admins").write_text(f"{ADMIN} ops\n")
    workers = []
    router = None
    try:
        for _ in range(2):
            workers.append(start_worker(root, "--model", str(base), "--device", "cpu",
                                        "--served-model-name", "tiny", "--enable-lora",
                                        "--max-loras", "1", "--max-lora-rank", "4",
                                        "--max-cpu-loras", "4", "--lora-dir", str(allowed),
                                        "--grpc-port", str(free_port()), "--block-size", "8"))
        # cache-aware: its load term counts requests; `cost` weighs measured step times,
        # which a loaded machine skews (affinity is then a timing outcome, not a rule)
        router = RouterProcess(root, [w.url for w in workers], "--api-keys",
                               str(root / "keys"), "--admin-api-keys", str(root / "admins"),
                               "--policy", "cache-aware")
        router.wait_events(2)
        yield router, workers, root
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


def _post(url: str, path: str, payload: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=payload, headers=headers, timeout=60)


def _load_on(worker, name: str, root) -> None:
    """Load `name` on one worker directly, as the router would (signed)."""
    body = json.dumps({"lora_name": name, "lora_path": str(root / "adapters" / name)}).encode()
    path = "/v1/load_lora_adapter"
    r = httpx.post(worker.url + path, content=body, timeout=60, headers={
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(WORKER_KEY, body, admin_target(path))})
    assert r.status_code == 200, r.text


def _wait(pred, what: str, timeout: float = 20) -> None:
    async def loop() -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                await asyncio.sleep(0.1)

    try:
        asyncio.run(loop())
    except TimeoutError as exc:
        raise AssertionError(f"timed out waiting for {what}") from exc


def _served(router) -> dict[str, str | None]:
    data = httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {TENANT}"},
                     timeout=10).json()["data"]
    return {m["id"]: m.get("parent") for m in data}


def _routed(router, worker) -> float:
    return _metric(router.url, "tandem_router_requests_total", f'worker="{worker.url}"')


def test_loads_fan_out_to_every_worker_for_admins_only(lora_cluster):
    router, workers, root = lora_cluster
    payload = {"lora_name": "x", "lora_path": str(root / "adapters" / "x")}
    assert _post(router.url, "/v1/load_lora_adapter", payload).status_code == 401
    r = _post(router.url, "/v1/load_lora_adapter", payload, TENANT)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = _post(router.url, "/v1/load_lora_adapter", payload, ADMIN)
    assert r.status_code == 200, r.text
    assert sorted(x["worker"] for x in r.json()["workers"]) == sorted(w.url for w in workers)
    bad = _post(router.url, "/v1/load_lora_adapter",
                {"lora_name": "evil", "lora_path": "../../etc"}, ADMIN)
    assert bad.status_code == 400 and "'..'" in bad.json()["error"]["message"]
    assert _served(router) == {"tiny": None, "x": "tiny"}
    for w in workers:  # every worker holds it
        assert "x" in httpx.get(w.url + "/ready").json()["lora_adapters"]


def test_requests_for_an_adapter_go_only_where_it_is_loaded(lora_cluster):
    """`y` lives on worker 0 only, `z` on worker 1 only: each request goes to its holder,
    and the output of `x` through the router equals the merged model's."""
    router, workers, root = lora_cluster
    _load_on(workers[0], "y", root)
    _load_on(workers[1], "z", root)
    _wait(lambda: {"y", "z"} <= set(_served(router)), "the router to learn y and z")
    headers = {"Authorization": f"Bearer {TENANT}"}
    rng = random.Random(0)
    before = [_routed(router, w) for w in workers]
    for name, n in (("y", 4), ("z", 4)):
        for _ in range(n):
            prompt = [rng.randrange(3, 49152) for _ in range(12)]
            r = httpx.post(router.url + "/v1/completions", headers=headers, timeout=60,
                           json={"model": name, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
    after = [_routed(router, w) for w in workers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]
    r = httpx.post(router.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    prompt = [rng.randrange(3, 49152) for _ in range(20)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(root / "x-merged"), device="cpu").generate([prompt], sp)[0]
    r = httpx.post(router.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                         "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == want.outputs[0].text


def test_affinity_to_the_replica_running_the_adapter(lora_cluster):
    """Both workers hold `w` and `x`, one slot each. While worker 0 runs `w` requests, new
    `w` requests join it there and `x` requests go to worker 1 (worker 0's only slot is
    busy); a long `x` prompt sent twice hits its own prefix, never `w`'s."""
    router, workers, root = lora_cluster
    for w in workers:
        _load_on(w, "w", root)
        _load_on(w, "x", root)  # a no-op where the fan-out test loaded it
    _wait(lambda: {"w", "x"} <= set(_served(router)), "the router to learn w and x")
    headers = {"Authorization": f"Bearer {TENANT}"}
    rng = random.Random(1)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            # keep worker 0 busy with `w` (sent straight to it)
            hold = [asyncio.ensure_future(client.post(workers[0].url + "/v1/completions", json={
                "model": "w", "prompt": [rng.randrange(3, 49152) for _ in range(8)],
                "max_tokens": 480, "ignore_eos": True})) for _ in range(2)]
            # until the router's load poll (every 0.2 s) has seen both on worker 0
            async with asyncio.timeout(30):
                while True:
                    seen = (await client.get(router.url + "/scaling",
                                             params={"model": "w", "role": "decode"})).json()
                    if seen["running"] + seen["waiting"] >= 2:
                        break
                    assert not any(h.done() for h in hold), "a held request ended early"
                    await asyncio.sleep(0.05)
            before = [_routed(router, w) for w in workers]
            for name in ("w", "x", "w", "x"):
                r = await client.post(router.url + "/v1/completions", headers=headers, json={
                    "model": name, "prompt": [rng.randrange(3, 49152) for _ in range(8)],
                    "max_tokens": 1})
                assert r.status_code == 200, r.text
                after = [_routed(router, w) for w in workers]
                went = [i for i in range(2) if after[i] > before[i]]
                assert went == ([0] if name == "w" else [1]), (name, went)
                before = after
            for h in hold:
                assert (await h).status_code == 200

    asyncio.run(run())
    # the same 64-token prompt for `x` twice: the second is a prefix hit; for `w`: a miss
    prompt = [rng.randrange(3, 49152) for _ in range(64)]
    hits = []
    for name in ("x", "x", "w"):
        before = _metric(router.url, "tandem_router_prefix_matched_tokens_total")
        r = httpx.post(router.url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": name, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        hits.append(_metric(router.url, "tandem_router_prefix_matched_tokens_total") - before)
    assert hits[0] == 0 and hits[1] >= 56 and hits[2] == 0, hits
