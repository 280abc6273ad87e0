"""Multi-LoRA (engine/lora): the batched update against a per-token reference, mixed batches
against merged-weight models run alone, adapter validation and path confinement, the
adapter in every block hash, and the scheduler's bound on adapters per step."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.engine.errors import ConfigError, UnknownAdapterError
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.lora.layers import LoRABatch, LoRAContext, LoRALinear, ModuleSlots
from tandem.engine.lora.paths import AdapterPathError, resolve_adapter_dir
from tandem.engine.native import load_native
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.protocol.file_digest import file_sha256
from tandem.protocol.kv_events import BlockStored

from .utils import finish_step, make_peft_adapter, make_request, make_tiny_model_dir, merge_adapter

VOCAB = 1024


@pytest.mark.parametrize(("native", "shape"), [
    (False, "small"), (True, "small"),
    (True, "large"),  # big enough for the kernel's OpenMP path (both threads, both phases)
], ids=["torch", "native", "native-parallel"])
def test_batched_update_equals_a_per_token_reference(native, shape):
    """Random slot maps (base tokens, one adapter, many, long runs): every plan (bmm, loop,
    and the C kernel when built) gives, for every token, base(x) + x A_s^T B_s^T of its own
    slot, within float32 rounding; the kernel's odd layouts fall back to the loop plan."""
    lib = load_native() if native else None
    if native and lib is None:
        pytest.fail("the native CPU kernels did not build on this machine")
    rng = random.Random(0)
    torch.manual_seed(0)
    n_in, outs, rank, num_slots = 24, [(0, 16), (16, 8), (24, 8)], 4, 5
    iterations, max_t = 1500, 40
    if shape == "large":
        n_in, outs, rank, num_slots, iterations, max_t = 256, [(0, 300), (300, 200)], 8, 3, 150, 64
    base = torch.nn.Linear(n_in, sum(n for _, n in outs), bias=False)
    slots = ModuleSlots.allocate(num_slots, rank, n_in, outs, torch.device("cpu"),
                                 torch.float32)
    dense = {}
    for s in range(num_slots):
        for j, (_, n) in enumerate(outs):
            r = rng.randint(1, rank)
            a, b = torch.randn(r, n_in), torch.randn(n, r)
            slots.set(s, j, a, b)
            dense[(s, j)] = b @ a
    ctx = LoRAContext()
    layer = LoRALinear(base, slots, ctx)
    modes = set()
    for _ in range(iterations):
        t = rng.randint(1, max_t)
        used = rng.sample(range(num_slots), rng.randint(1, num_slots))
        runs = rng.random() < 0.3
        token_slots = np.array([
            (used[0] if runs and i < t // 2 else rng.choice(used + [-1]))
            for i in range(t)])
        x = torch.randn(t, n_in)
        if native and rng.random() < 0.1:  # a strided input: the loop plan instead
            x = torch.randn(t, 2 * n_in)[:, ::2]
        batch = LoRABatch.build(token_slots, num_slots, torch.device("cpu"), lib, rank)
        with ctx.use(batch):
            got = layer(x)
        want = base(x)
        for i, s in enumerate(token_slots.tolist()):
            if s >= 0:
                for j, (off, n) in enumerate(outs):
                    want[i, off:off + n] += dense[(s, j)] @ x[i]
        if batch is None:
            assert (token_slots < 0).all()
        else:
            modes.add(batch.mode)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert ctx.current is None
    assert modes == ({"native"} if native else {"bmm", "loop"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer tiny Llama, three adapters (all linears rank 8; q/v only rank 4 with rsLoRA;
    MLP only rank 6 with an alpha pattern) and a merged-weights checkpoint of each."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    make_tiny_model_dir(base, "llama", seed=3, num_hidden_layers=3, vocab_size=VOCAB)
    cfg = json.loads((base / "config.json").read_text())
    specs = {
        "sql": dict(rank=8, alpha=16.0, seed=1),
        "code": dict(rank=4, alpha=8.0, seed=2, targets=("q_proj", "v_proj"), use_rslora=True),
        "chat": dict(rank=6, alpha=12.0, seed=3, targets=("gate_proj", "up_proj", "down_proj"),
                     alpha_pattern={"down_proj": 3.0}),
    }
    adapters = {}
    for name, spec in specs.items():
        w = make_peft_adapter(root / name, cfg, **spec)
        r, alpha = spec["rank"], spec["alpha"]
        scale = alpha / r ** 0.5 if spec.get("use_rslora") else alpha / r
        if "alpha_pattern" in spec:  # down_proj has its own alpha
            scale = {t: 3.0 / r if t == "down_proj" else scale for t in spec["targets"]}
        merge_adapter(base, root / f"{name}-merged", w, scale)
        adapters[name] = root / name
    return root, base, adapters


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    return [(shared if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 30))]
            for i in range(n)]


def test_mixed_batch_equals_each_merged_model_alone(tiny):
    """Twelve requests over three adapters and the base model in one engine (2 slots, so
    adapters wait and are evicted; prefix caching and 16-token chunks on): each request's
    greedy tokens equal those of the merged model run alone, its logprobs within float32
    tolerance."""
    root, base, adapters = tiny
    rng = random.Random(7)
    prompts = _prompts(rng, 12)
    names = [None, "sql", "code", "chat"] * 3
    rng.shuffle(names)
    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    ref = {}
    for name in set(names):
        path = base if name is None else root / f"{name}-merged"
        llm = LLM(model=str(path), device="cpu", dtype="float32")
        idx = [i for i, n in enumerate(names) if n == name]
        for i, out in zip(idx, llm.generate([prompts[i] for i in idx], sp), strict=True):
            ref[i] = out.outputs[0]
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_num_batched_tokens=16, max_cpu_loras=2)
    ids = {n: i for i, n in enumerate(adapters, start=1)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    got = llm.generate(prompts, sp, lora_request=reqs)
    for i, out in enumerate(got):
        assert out.outputs[0].token_ids == ref[i].token_ids, (i, names[i])
        for lp_ref, lp in zip(ref[i].logprobs, out.outputs[0].logprobs, strict=True):
            for tok, v in lp_ref.items():
                assert lp[tok] == pytest.approx(v, abs=2e-4)
    manager = llm.engine.lora
    assert manager.num_loads >= 3 and len(manager.host) <= 2
    # the same adapters by name alone, now that they are registered; an unknown one: 404
    again = llm.generate(prompts[:4], sp, lora_request=[
        None if n is None else LoRARequest(n, ids[n]) for n in names[:4]])
    assert [o.outputs[0].token_ids for o in again] == [ref[i].token_ids for i in range(4)]
    with pytest.raises(UnknownAdapterError):
        llm.generate(prompts[:1], sp, lora_request=LoRARequest("nope", 9))


def test_an_adapter_never_shares_blocks_with_the_base_or_another(tiny):
    root, base, adapters = tiny
    llm = LLM(model=str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, enable_kv_events=True)
    sql, code = LoRARequest("sql", 1, str(adapters["sql"])), LoRARequest("code", 2,
                                                                         str(adapters["code"]))
    prompt = list(range(10, 50))
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(lora) -> int:
        return llm.generate([prompt], sp, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(sql) == 0  # the base model's blocks are not the adapter's
    assert cached(code) == 0
    assert cached(sql) == 36 and cached(None) == 36  # each hits its own
    # KV events name the adapter that computed the blocks (its hashes are its own)
    stored = [e for e in llm.engine.take_kv_events() if isinstance(e, BlockStored)]
    by_adapter = {}
    for e in stored:
        by_adapter.setdefault(e.lora_name, set()).update(e.block_hashes)
    assert set(by_adapter) == {"", "sql", "code"}
    assert all(len(v) >= 9 for v in by_adapter.values())  # the whole prompt's blocks
    assert not by_adapter[""] & by_adapter["sql"] and not by_adapter["sql"] & by_adapter["code"]


def _write_adapter(dirpath, cfg, **kw):
    return make_peft_adapter(dirpath, cfg, rank=kw.pop("rank", 4), **kw)


def test_bad_adapters_are_refused_with_clear_errors(tiny, tmp_path):
    root, base, _ = tiny
    cfg = json.loads((base / "config.json").read_text())
    llm = LLM(model=str(base), device="cpu", enable_lora=True, max_lora_rank=8,
              lora_dirs=[str(tmp_path)])
    manager = llm.engine.lora

    def refused(name: str, match: str, trusted: bool = False, **write) -> None:
        path = tmp_path / name
        _write_adapter(path, cfg, **write)
        with pytest.raises(ConfigError, match=match):
            manager.add(LoRARequest(name, 50 + len(manager.registered), str(path)),
                        trusted=trusted)
        assert name not in manager.registered

    refused("big", "exceeds max_lora_rank", rank=16)
    refused("dora", "DoRA", use_dora=True)
    refused("saved", "modules_to_save", modules_to_save=["lm_head"])
    refused("bias", "biases", bias="all")
    refused("deep", "names layer 7", layers=[7])
    refused("untargeted", "not in the adapter's target_modules",
            targets=("q_proj",), target_modules=["v_proj"])
    # a B of the wrong shape
    path = tmp_path / "shape"
    _write_adapter(path, cfg)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.zeros(3, 4)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="the base model needs"):
        manager.add(LoRARequest("shape", 60, str(path)))
    # a missing lora_B
    del tensors[key]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="without lora_B"):
        manager.add(LoRARequest("shape", 60, str(path)))
    # garbage weights, bad JSON
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError, match="safetensors"):
        manager.add(LoRARequest("shape", 60, str(path)))
    ok = tmp_path / "ok"
    _write_adapter(ok, cfg)
    digest = file_sha256(ok / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="does not match the pinned"):
        manager.add(LoRARequest("ok", 61, str(ok), sha256="0" * 64))
    manager.add(LoRARequest("ok", 61, str(ok), sha256=digest))
    with pytest.raises(ValueError, match="already loaded"):
        manager.add(LoRARequest("ok", 62, str(ok)))
    (ok / "adapter_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        manager.add(LoRARequest("ok2", 63, str(ok)))


def test_adapter_paths_stay_inside_the_allowed_directories(tiny, tmp_path):
    root, base, adapters = tiny
    cfg = json.loads((base / "config.json").read_text())
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    _write_adapter(allowed / "good", cfg)
    _write_adapter(outside / "evil", cfg)
    (allowed / "link").symlink_to(outside / "evil")
    (allowed / "halflink").mkdir()
    (allowed / "halflink" / "adapter_config.json").write_text("{}")
    (allowed / "halflink" / "adapter_model.safetensors").symlink_to(
        outside / "evil" / "adapter_model.safetensors")
    roots = [str(allowed)]
    assert resolve_adapter_dir(str(allowed / "good"), roots) == (allowed / "good").resolve()
    assert resolve_adapter_dir("good", roots) == (allowed / "good").resolve()
    for bad, why in [(str(outside / "evil"), "outside"), ("../outside/evil", "'..'"),
                     (str(allowed / "link"), "outside"), (str(allowed / "halflink"), "links"),
                     ("https://example.com/a", "URL"), ("file:///etc", "URL"),
                     ("s3://bucket/a", "URL"), ("a\x00b", "non-empty"), ("", "non-empty"),
                     (str(allowed), "has no adapter_config.json"),
                     (str(allowed / "missing"), "not a directory")]:
        with pytest.raises(AdapterPathError, match=why):
            resolve_adapter_dir(bad, roots)
    with pytest.raises(AdapterPathError, match="no adapter directory"):
        resolve_adapter_dir(str(allowed / "good"), [])
    # nothing outside the root was opened: an unreadable file there stays unread
    os.chmod(outside / "evil" / "adapter_model.safetensors", 0)
    try:
        with pytest.raises(AdapterPathError):
            resolve_adapter_dir(str(allowed / "link"), roots)
    finally:
        os.chmod(outside / "evil" / "adapter_model.safetensors", 0o644)


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_keeps_running_adapters_within_max_loras(seed):
    """Random arrivals over 6 adapters and the base model, max_loras = 2: no step ever runs
    more than 2 distinct adapters, nobody starves, every block comes back."""
    rng = random.Random(seed)
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=32, max_loras=2)
    names = [None, "a", "b", "c", "d", "e", "f"]
    pending = 60
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(min(rng.randint(0, 2), pending)):
            req = make_request([rng.randrange(1, 100) for _ in range(rng.randint(1, 12))],
                               max_tokens=rng.randint(1, 6))
            req.lora_name = rng.choice(names)
            sched.add_request(req)
            pending -= 1
        out = sched.schedule()
        step = {s.request.lora_name for s in out.scheduled} - {None}
        running = {r.lora_name for r in sched.running} - {None}
        assert len(step) <= 2 and len(running) <= 2
        assert dict(sched.running_loras) == {
            n: sum(r.lora_name == n for r in sched.running) for n in running}
        finish_step(sched, out)
        for r in list(sched.running):
            if r.status is RequestStatus.RUNNING and rng.random() < 0.05:
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
        steps += 1
        assert steps < 5000
    assert not sched.running_loras
    assert kv.pool.num_free_blocks() == 64


@pytest.mark.parametrize("seed", range(3))
def test_load_unload_under_traffic_never_loses_a_request(tiny, seed):
    """A seeded trace of arrivals, aborts, unloads and reloads over three adapters and the
    base model (2 slots, 16-token chunks): every request that is not aborted finishes with
    its merged model's exact tokens, even when its adapter was unloaded while it ran; a
    request for an unloaded adapter is refused at once; a retiring adapter is freed with
    its last request and no slot ever holds a freed one."""
    root, base, adapters = tiny
    rng = random.Random(100 + seed)
    pool = _prompts(random.Random(seed), 6)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = {}
    for name in (None, *adapters):
        path = base if name is None else root / f"{name}-merged"
        outs = LLM(model=str(path), device="cpu", dtype="float32").generate(pool, sp)
        ref[name] = [o.outputs[0].token_ids for o in outs]
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_num_batched_tokens=16, max_cpu_loras=3)
    engine = llm.engine
    loaded = set()

    def load(name: str) -> None:
        engine.load_lora(LoRARequest(name, 1, str(adapters[name])), trusted=True,
                         fresh_id=True)
        loaded.add(name)

    for name in adapters:
        load(name)
    live: dict[str, tuple[str | None, int]] = {}
    aborted: set[str] = set()
    done = busy = 0
    for step in range(600):
        op = rng.random()
        name = rng.choice([None, *adapters])
        if op < 0.35 and len(live) < 8:
            rid, i = f"r{step}", rng.randrange(len(pool))
            if name is None or name in loaded:
                engine.add_request(rid, pool[i], sp, lora_request=name)
                live[rid] = (name, i)
            else:
                with pytest.raises(UnknownAdapterError):
                    engine.add_request(rid, pool[i], sp, lora_request=name)
        elif op < 0.45 and name in loaded:
            engine.unload_lora(name)
            loaded.discard(name)
            busy += name in engine.lora.retiring  # its requests still run
        elif op < 0.55 and name is not None and name not in loaded:
            if name in engine.lora.retiring:
                with pytest.raises(ValueError, match="being unloaded"):
                    load(name)
            else:
                load(name)
        elif op < 0.58 and live:
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished and out.request_id in live:
                who, i = live.pop(out.request_id)
                if out.request_id not in aborted:
                    assert out.outputs[0].token_ids == ref[who][i], (out.request_id, who)
                    done += 1
        lora = engine.lora
        in_use = {r.lora_name for r in engine.scheduler.requests.values()} - {None}
        assert lora.retiring <= in_use  # nothing retires without a request left
        assert set(lora.slot_of) <= set(lora.registered)
        assert set(lora.names()) == loaded
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in live:
                who, i = live.pop(out.request_id)
                if out.request_id not in aborted:
                    assert out.outputs[0].token_ids == ref[who][i]
                    done += 1
    assert not live and not engine.lora.retiring and done > 30 and busy >= 3, (done, busy)
    assert engine.kv.pool.num_free_blocks() == engine.state.num_kv_blocks


@pytest.mark.slow
def test_bundled_model_adapters_equal_merged_weights(bundled_gguf, tmp_path):
    """Two random rank-8 adapters (all linears; q/v only) on the bundled SmolLM2 in one
    batch with the base model: greedy tokens equal an engine whose linears have W + s B A
    merged in place, logprobs within float32 tolerance."""
    llm = LLM(device="cpu", dtype="float32", cpu_linear="torch", enable_lora=True,
              max_loras=2, max_lora_rank=8, num_kv_blocks=64)  # (not a tenth of RAM)
    arch = llm.engine.model.config
    cfg = {"hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
           "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
           "head_dim": arch.head_dim, "num_hidden_layers": arch.num_layers}
    w1 = make_peft_adapter(tmp_path / "one", cfg, rank=8, alpha=16.0, seed=4, std=0.05)
    w2 = make_peft_adapter(tmp_path / "two", cfg, rank=8, alpha=8.0, seed=5, std=0.08,
                           targets=("q_proj", "v_proj"))
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village,")]
    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)
    one, two = LoRARequest("one", 1, str(tmp_path / "one")), LoRARequest("two", 2,
                                                                         str(tmp_path / "two"))
    loras = [one, two, None, two, one, None]
    got = llm.generate(prompts + prompts, sp, lora_request=loras)
    assert got[0].outputs[0].token_ids != got[2].outputs[0].token_ids  # the adapter matters
    del llm

    ref = LLM(device="cpu", dtype="float32", cpu_linear="torch", num_kv_blocks=64)
    model = ref.engine.model
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    where = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", q),
             "v_proj": ("self_attn", "qkv_proj", q + kv), "o_proj": ("self_attn", "o_proj", 0),
             "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", inter),
             "down_proj": ("mlp", "down_proj", 0)}

    def merged(weights, scale, sign):
        with torch.no_grad():
            for (i, t), (a, b) in weights.items():
                group, fused, off = where[t]
                lin = getattr(getattr(model.layers[i], group), fused)
                lin.weight[off:off + b.shape[0]] += sign * scale * (b @ a)

    for weights, scale, lora in ((None, 0.0, None), (w1, 2.0, one), (w2, 1.0, two)):
        if weights is not None:
            merged(weights, scale, 1.0)
        idx = [i for i, x in enumerate(loras) if x is lora]
        outs = ref.generate([(prompts + prompts)[i] for i in idx], sp)
        for i, out in zip(idx, outs, strict=True):
            assert got[i].outputs[0].token_ids == out.outputs[0].token_ids, i
            for a, b in zip(got[i].outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
                for t, v in b.items():
                    assert a[t] == pytest.approx(v, abs=1e-3)
        if weights is not None:
            merged(weights, scale, -1.0)


def _copy_adapter(src, dst, **config_changes) -> None:
    """The adapter at `src` under `dst`: the same weight file, its config with changes."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "adapter_model.safetensors", dst / "adapter_model.safetensors")
    cfg = json.loads((src / "adapter_config.json").read_text()) | config_changes
    (dst / "adapter_config.json").write_text(json.dumps(cfg))


def test_a_replaced_adapter_never_hits_the_old_weights_blocks(tiny, tmp_path):
    """`x` runs a prompt with adapter A, is unloaded, and B is loaded under the same name:
    the same prompt reuses no cached token and gives exactly a fresh engine's tokens with B.
    The same files as A under `x` again hit A's blocks (same digest); A's weights with
    another alpha do not. KV events and the manager's state name the adapter by digest."""
    root, base, adapters = tiny
    _copy_adapter(adapters["sql"], tmp_path / "sql-again")
    _copy_adapter(adapters["sql"], tmp_path / "sql-alpha", lora_alpha=4.0)
    prompt = list(range(10, 50))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    fresh = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True,
                max_lora_rank=8, block_size=4)
    want_b = fresh.generate([prompt], sp, lora_request=LoRARequest(
        "x", 1, str(adapters["code"])))[0].outputs[0].token_ids
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True,
              max_lora_rank=8, block_size=4, enable_kv_events=True)
    engine = llm.engine

    def run(path=None) -> tuple[int, list[int]]:
        lora = LoRARequest("x", 1, str(path)) if path is not None else "x"
        out = llm.generate([prompt], sp, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached, want_a = run(adapters["sql"])
    digest_a = engine.lora.digest("x")
    assert cached == 0 and run() == (36, want_a)  # warm on its own blocks
    assert engine.unload_lora("x")
    assert run(adapters["code"]) == (0, want_b)  # nothing of A's computation is reused
    digest_b = engine.lora.digest("x")
    assert want_b != want_a and digest_b != digest_a
    assert engine.unload_lora("x")
    assert run(tmp_path / "sql-again") == (36, want_a)  # identical files: A's cache is warm
    assert engine.lora.digest("x") == digest_a
    assert engine.unload_lora("x")
    cached, _ = run(tmp_path / "sql-alpha")  # same weight file, other scaling: other outputs
    digest_alpha = engine.lora.digest("x")
    assert cached == 0 and digest_alpha not in (digest_a, digest_b)
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    assert {e.lora_digest for e in stored} == {digest_a, digest_b, digest_alpha}
    assert {e.lora_name for e in stored} == {"x"}
    state = engine.lora.state  # 4 loads, 3 unloads (retired, then freed): 10 versions
    assert state.adapters == (("x", digest_alpha),) and state.version == 10


@pytest.mark.parametrize("seed", range(2))
def test_no_block_is_ever_hit_under_other_adapter_weights(tiny, tmp_path, seed):
    """Thousands of random load / unload / replace / request events through the engine's
    request path (real `add_request`, scheduler and prefix cache; forwards pretended) over
    four adapter variants (A, A's files copied, B, A with another alpha) under three names
    and a 24-block pool (constant eviction): every prefix hit is a block computed with the
    same weights as the request's adapter (the test's own labels, not the digests), and
    identical reloads do get hits."""
    root, base, adapters = tiny
    variants = {"A": adapters["sql"], "A-copy": tmp_path / "a-copy", "B": adapters["code"],
                "A-alpha": tmp_path / "a-alpha"}
    _copy_adapter(adapters["sql"], variants["A-copy"])
    _copy_adapter(adapters["sql"], variants["A-alpha"], lora_alpha=5.0)
    weights_of = {"A": "A", "A-copy": "A", "B": "B", "A-alpha": "A-alpha"}
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_cpu_loras=3, block_size=4, num_kv_blocks=24)
    engine = llm.engine
    sched = engine.scheduler
    rng = random.Random(1000 + seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(3)]
    loaded: dict[str, str] = {}  # name -> variant
    computed_with: dict[bytes, str] = {}  # block hash -> the weights that computed it
    label: dict[str, str | None] = {}  # request id -> its weights
    hits = warm = 0
    seen: set[str] = set()
    for step in range(4000):
        r = rng.random()
        if r < 0.08:  # load, or replace: unload then load another variant under the name
            name, variant = rng.choice(["x", "y", "z"]), rng.choice(list(variants))
            if name in loaded and rng.random() < 0.5:
                engine.unload_lora(name)
                loaded.pop(name)
            if name not in loaded and name not in engine.lora.retiring:
                engine.load_lora(LoRARequest(name, engine.lora.next_id(),
                                             str(variants[variant])), trusted=True)
                loaded[name] = variant
        elif r < 0.25:
            name = rng.choice([None, *loaded])
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(3, VOCAB)
                                             for _ in range(rng.randint(0, 6))]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 3)),
                               lora_request=name)
            label[rid] = None if name is None else weights_of[loaded[name]]
        else:
            out = sched.schedule()
            for s in out.scheduled:
                req = s.request
                if req.request_id not in seen:
                    seen.add(req.request_id)
                    n = s.start // 4  # the prefix hit at admission: whose blocks?
                    for h in req.block_hashes[:n]:
                        assert computed_with[h] == label[req.request_id], (step, req.lora_name)
                    hits += n
                    warm += n and label[req.request_id] == "A" and any(
                        v == "A-copy" for v in loaded.values())
            finish_step(sched, out)
            for s in out.scheduled:
                req = s.request
                for h in req.block_hashes[:req.num_computed_tokens // 4]:
                    assert computed_with.setdefault(h, label[req.request_id]) == label[
                        req.request_id]
            engine._reap_loras()
    assert hits > 200 and warm > 0


def _rewrite_header(path, key_shapes: dict, sparse_key: str | None = None) -> None:
    """Rewrite `path`'s safetensors file: tensors in `key_shapes` declared with those shapes
    (zeros); `sparse_key` placed last as float16, its data a hole (a sparse file: nothing on
    disk)."""
    import struct

    from safetensors.torch import load_file

    tensors = load_file(str(path))
    keys = sorted(tensors, key=lambda k: k == sparse_key)
    header, chunks, off = {}, [], 0
    for k in keys:
        shape = key_shapes.get(k, list(tensors[k].shape))
        dtype = "F16" if k == sparse_key else "F32"
        n = (2 if k == sparse_key else 4) * int(np.prod(shape))
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        chunks.append(b"" if k == sparse_key else (
            tensors[k].numpy().tobytes() if k not in key_shapes else bytes(n)))
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))
        f.truncate(8 + len(raw) + off)


def test_shapes_are_checked_from_the_header_before_any_data_is_read(tiny, tmp_path):
    """A header declaring a 512 MiB float16 lora_A of the wrong shape (its data a sparse
    hole) is refused naming the module and both shapes, without reading or converting the
    tensor (a few page faults, not the 262,144 of a float32 copy); a header whose extents
    run past the file is a clean error; rank_pattern 0 is refused as a config error, not a
    division by zero."""
    import resource

    root, base, _ = tiny
    cfg = json.loads((base / "config.json").read_text())
    llm = LLM(model=str(base), device="cpu", enable_lora=True, max_lora_rank=8,
              lora_dirs=[str(tmp_path)])
    manager = llm.engine.lora
    path = tmp_path / "huge"
    _write_adapter(path, cfg)
    weights = path / "adapter_model.safetensors"
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _rewrite_header(weights, {key: [4, 1 << 26]}, sparse_key=key)
    assert weights.stat().st_size > 1 << 29 and weights.stat().st_blocks * 512 < 1 << 24
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.q_proj has lora_A "
                                          r"\(4, 67108864\) and lora_B \(\d+, 4\); the base "
                                          r"model needs \(4, \d+\) and \(\d+, 4\)"):
        manager.read(LoRARequest("huge", 1, str(path)))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 20_000
    # a header whose tensor runs past the end of the file (truncated data)
    _write_adapter(path, cfg)
    blob = weights.read_bytes()
    weights.write_bytes(blob[:-100])
    with pytest.raises(ConfigError, match="truncated or its header lies"):
        manager.read(LoRARequest("huge", 1, str(path)))
    for value, shown in [(0, "0"), (-2, "-2"), ("8", "'8'")]:
        _write_adapter(path, cfg, rank_pattern={"q_proj": value})
        with pytest.raises(ConfigError, match=r"rank_pattern\['q_proj'\] must be a positive "
                                              rf"integer, got {shown}"):
            manager.read(LoRARequest("huge", 1, str(path)))


def test_a_symlink_swapped_in_after_the_check_is_not_followed(tiny, tmp_path, monkeypatch):
    """The adapter directory passes the confinement check, then (before its files are read)
    is replaced by a symlink to an adapter outside `--lora-dir`: the load fails naming the
    change instead of reading the outside files. Without a swap the same path loads."""
    import tandem.engine.lora.paths as paths

    root, base, _ = tiny
    cfg = json.loads((base / "config.json").read_text())
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    _write_adapter(allowed / "good", cfg, seed=1)
    _write_adapter(outside / "evil", cfg, seed=2)
    llm = LLM(model=str(base), device="cpu", enable_lora=True, max_lora_rank=8,
              lora_dirs=[str(allowed)])
    manager = llm.engine.lora
    assert manager.read(LoRARequest("good", 1, "good")).path == str(allowed / "good")
    real_isfile = os.path.isfile

    def isfile_then_swap(p):  # the check's last look at the directory, then the attack
        ok = real_isfile(p)
        if p.endswith("adapter_model.safetensors") and (allowed / "good").is_dir() and not (
                allowed / "good").is_symlink():
            (allowed / "good").rename(allowed / "moved")
            (allowed / "good").symlink_to(outside / "evil")
        return ok

    monkeypatch.setattr(paths.os.path, "isfile", isfile_then_swap)
    with pytest.raises(AdapterPathError, match="changed after it was checked"):
        manager.read(LoRARequest("good", 1, "good"))
    assert "good" not in manager.registered
