"""Multi-LoRA through a real worker process and the real `openai` client: the `model` field
picks the adapter (outputs equal the merged-weights model's), `/v1/models` lists base and
adapters, vLLM's load/unload endpoints (admin-only under the router's signature, confined
to `--lora-dir`, 400 / 404 / 409 with OpenAI error bodies), unloading under traffic loses
no request, and `vllm:lora_requests_info` on /metrics."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

from tandem import LLM, SamplingParams
from tandem.protocol.signing import SIGNATURE_HEADER, admin_target, sign
from tests.engine.utils import make_peft_adapter, make_tiny_model_dir, merge_adapter
from tests.serving.helpers import WORKER_KEY, start_worker

SPECS = {"sql": dict(rank=8, alpha=16.0, seed=11),
         "code": dict(rank=4, alpha=4.0, seed=12, targets=("q_proj", "v_proj", "down_proj")),
         "chat": dict(rank=8, alpha=8.0, seed=13, targets=("o_proj", "gate_proj"))}
MAX_TOKENS = 12
LONG = 160  # the unload-under-traffic streams: long enough to be running when it comes


@pytest.fixture(scope="module")
def lora_worker(tmp_path_factory):
    """A tiny model, three adapters under an allowed root (`sql` loaded at start), the
    merged-weights reference tokens of fixed prompts, and a worker with 2 slots."""
    root = tmp_path_factory.mktemp("lora-http")
    base = root / "base"
    make_tiny_model_dir(base, "llama", seed=5, num_hidden_layers=2)
    cfg = json.loads((base / "config.json").read_text())
    allowed = root / "adapters"
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ref = {None: [o.outputs[0].text for o in
                  LLM(model=str(base), device="cpu").generate(prompts, sp)]}
    for name, spec in SPECS.items():
        w = make_peft_adapter(allowed / name, cfg, **spec)
        merge_adapter(base, root / f"{name}-merged", w, spec["alpha"] / spec["rank"])
        llm = LLM(model=str(root / f"{name}-merged"), device="cpu")
        ref[name] = [o.outputs[0].text for o in llm.generate(prompts, sp)]
        if name == "sql":
            long = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
            ref["sql-long"] = [o.outputs[0].text for o in llm.generate(prompts, long)]
    assert len({tuple(ref[k]) for k in (None, *SPECS)}) == 4  # the adapters matter
    worker = start_worker(root, "--model", str(base), "--device", "cpu", "--enable-lora",
                          "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2",
                          "--lora-modules", f"sql={allowed / 'sql'}",
                          "--lora-dir", str(allowed))
    yield worker, root, allowed, prompts, ref
    worker.stop()


def _client(worker) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


def admin(worker, path: str, payload: dict, signed: bool = True) -> httpx.Response:
    """A load/unload call as the router sends it (signed with the worker key for
    `admin:<path>`)."""
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if signed:
        headers[SIGNATURE_HEADER] = sign(WORKER_KEY, body, admin_target(path))
    return httpx.post(worker.url + path, content=body, headers=headers, timeout=30)


async def _complete(client, model: str, prompt: list[int]) -> str:
    out = await client.completions.create(model=model, prompt=[prompt], max_tokens=MAX_TOKENS,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert out.model == model and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].text


def test_model_field_selects_the_adapter_in_mixed_batches(lora_worker):
    """Concurrent requests for the base model and three adapters (two slots: adapters wait
    and swap) each equal the merged model's greedy tokens; `/v1/models` lists them."""
    worker, _, allowed, prompts, ref = lora_worker
    r = admin(worker, "/v1/load_lora_adapter",
              {"lora_name": "code", "lora_path": str(allowed / "code")})
    assert r.status_code == 200 and r.json()["status"] == "loaded", r.text
    r = admin(worker, "/v1/load_lora_adapter",
              {"lora_name": "chat", "lora_path": "chat"})  # relative to the --lora-dir
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in httpx.get(worker.url + "/v1/models").json()["data"]}
    base = next(m for m in models.values() if m["parent"] is None)["id"]
    assert {k: m["parent"] for k, m in models.items()} == {
        base: None, "sql": base, "code": base, "chat": base}
    assert models["code"]["root"] == str((allowed / "code").resolve())
    ready = httpx.get(worker.url + "/ready").json()
    assert ready["max_loras"] == 2 and ready["lora_adapters"] == ["sql", "code", "chat"]

    async def run() -> list[tuple[str | None, int, list[int]]]:
        client = _client(worker)
        jobs = [(name, i) for name in (None, "sql", "code", "chat") for i in range(len(prompts))]
        random.Random(1).shuffle(jobs)
        got = await asyncio.gather(*[_complete(client, name or base, prompts[i])
                                     for name, i in jobs])
        return [(n, i, g) for (n, i), g in zip(jobs, got, strict=True)]

    for name, i, text in asyncio.run(run()):
        assert text == ref[name][i], (name, i)
    metrics = httpx.get(worker.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line  # idle now


def test_unknown_adapters_and_bad_loads_get_clear_errors(lora_worker):
    worker, root, allowed, prompts, _ = lora_worker
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert err.value.body["message"] == "The model `nope` does not exist."
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "hi"}])
    outside = root / "outside"
    make_peft_adapter(outside, json.loads((root / "base" / "config.json").read_text()))
    (allowed / "escape").symlink_to(outside)
    cases = [({"lora_name": "x", "lora_path": str(outside)}, 400, "outside"),
             ({"lora_name": "x", "lora_path": "../outside"}, 400, "'..'"),
             ({"lora_name": "x", "lora_path": str(allowed / "escape")}, 400, "outside"),
             ({"lora_name": "x", "lora_path": "https://example.com/a"}, 400, "URL"),
             ({"lora_name": "x", "lora_path": str(allowed)}, 400, "adapter_config.json"),
             ({"lora_name": "x", "lora_path": "sql", "sha256": "0" * 64}, 400, "sha256"),
             ({"lora_name": "bad name", "lora_path": "sql"}, 400, "whitespace"),
             ({"lora_name": "sql", "lora_path": "code"}, 409, "already loaded"),
             ({"lora_name": "x"}, 400, "lora_path")]
    for payload, status, words in cases:
        r = admin(worker, "/v1/load_lora_adapter", payload)
        assert r.status_code == status, (payload, r.text)
        assert words in r.json()["error"]["message"], (payload, r.text)
    r = admin(worker, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "sql"},
              signed=False)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert admin(worker, "/v1/unload_lora_adapter", {"lora_name": "sql"},
                 signed=False).status_code == 403
    r = admin(worker, "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert r.status_code == 404
    # the same name and files again is a no-op; nothing above was registered
    r = admin(worker, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
    assert r.status_code == 200 and r.json()["status"] == "already_loaded", r.text
    names = [m["id"] for m in httpx.get(worker.url + "/v1/models").json()["data"]]
    assert "x" not in names and "sql" in names


def test_unloading_under_traffic_loses_no_request(lora_worker):
    """Streams for `sql` are running when it is unloaded: they finish with its exact tokens;
    new requests for it get 404 at once; once they end it is gone, and it loads again."""
    worker, _, allowed, prompts, ref = lora_worker
    if not any(m["id"] == "sql" for m in httpx.get(worker.url + "/v1/models").json()["data"]):
        assert admin(worker, "/v1/load_lora_adapter",
                     {"lora_name": "sql", "lora_path": "sql"}).status_code == 200

    async def run() -> None:
        client = _client(worker)
        streams = [await client.completions.create(
            model="sql", prompt=[p], max_tokens=LONG, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}) for p in prompts]
        firsts = [await s.__anext__() for s in streams]  # every one is running
        r = await asyncio.to_thread(admin, worker, "/v1/unload_lora_adapter",
                                    {"lora_name": "sql"})
        assert r.status_code == 200 and r.json()["status"] == "unloading", r.text
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="sql", prompt=[prompts[0]], max_tokens=2)
        for i, (s, first) in enumerate(zip(streams, firsts, strict=True)):
            text = first.choices[0].text
            async for chunk in s:
                text += "".join(c.text for c in chunk.choices)
            assert text == ref["sql-long"][i], i

    asyncio.run(run())
    names = [m["id"] for m in httpx.get(worker.url + "/v1/models").json()["data"]]
    assert "sql" not in names
    assert admin(worker, "/v1/load_lora_adapter",
                 {"lora_name": "sql", "lora_path": "sql"}).json()["status"] == "loaded"
    assert asyncio.run(_complete(_client(worker), "sql", prompts[2])) == ref["sql"][2]


def test_rank_pattern_zero_is_a_400_and_a_stale_probe_cannot_undo_a_load(lora_worker):
    """An adapter whose rank_pattern holds 0 gets 400 naming it (not a 500). Then the
    router's view of the worker: a readiness probe answered before a load but delivered
    after the load's answer (held back by a proxy) does not take the new adapter away; the
    load's answer and the next probe carry the same, newer version and the adapter's
    digest."""
    from tandem.router.index import PrefixIndex
    from tandem.router.lora_admin import LOAD_PATH, _apply
    from tandem.router.monitor import MonitorSettings, WorkerMonitor
    from tandem.router.workers import Worker

    worker, root, allowed, _, _ = lora_worker
    cfg = json.loads((root / "base" / "config.json").read_text())
    make_peft_adapter(allowed / "zero", cfg, rank=4, rank_pattern={"q_proj": 0})
    r = admin(worker, "/v1/load_lora_adapter", {"lora_name": "zero", "lora_path": "zero"})
    assert r.status_code == 400, r.text
    assert "rank_pattern['q_proj'] must be a positive integer, got 0" in r.json()[
        "error"]["message"]

    async def run() -> None:
        held, release = asyncio.Event(), asyncio.Event()

        async def slow_ready(reader, writer) -> None:  # fetch /ready now, answer later
            await reader.readuntil(b"\r\n\r\n")
            async with httpx.AsyncClient() as c:
                answer = (await c.get(worker.url + "/ready")).json()
            answer.pop("grpc_port", None)  # only the probe reports here
            held.set()
            await release.wait()
            body = json.dumps(answer).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body),
                                                                                   body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(slow_ready, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        w = Worker(id=f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient() as http:
            monitor = WorkerMonitor(w, PrefixIndex(), http, MonitorSettings(probe_timeout_s=30))
            first = asyncio.ensure_future(monitor.probe())  # answered by the worker now
            await held.wait()
            answer = await asyncio.to_thread(admin, worker, "/v1/load_lora_adapter",
                                             {"lora_name": "late", "lora_path": "chat"})
            assert answer.status_code == 200, answer.text
            state = answer.json()["lora"]
            assert state["adapters"]["late"] == answer.json()["digest"]
            _apply(w, LOAD_PATH, "late", answer.json())  # the router's fan-out, at once
            assert w.serves("late")
            release.set()
            await first  # the stale answer arrives: it lists no `late`
            assert w.serves("late") and w.lora_version == (state["instance"],
                                                           state["version"])
            assert w.lora_digests["late"] == answer.json()["digest"]
            await monitor.probe()  # a fresh probe agrees
            assert w.serves("late") and w.lora_version[1] == state["version"]
            await monitor.stop()
        server.close()

    try:
        asyncio.run(run())
    finally:
        admin(worker, "/v1/unload_lora_adapter", {"lora_name": "late"})
