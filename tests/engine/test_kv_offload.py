"""The KV offload connector end to end on a tiny model: blocks the small device pool evicts
are saved to the host tier (and spilled to the disk tier), and a second round of prompts
sharing those prefixes loads them instead of computing them. Tokens and logprobs equal a
run whose larger pool hits the same prefixes locally; a record that does not verify is
recomputed, never served."""

from __future__ import annotations

import asyncio
import functools
import random
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from tandem import SamplingParams
from tandem.engine.async_engine import AddRequest, AsyncLLMEngine, _tier_snapshot
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.kv_connector.base import ConnectorMetadata
from tandem.engine.kv_connector.offload import OffloadConnector, OffloadScheduler
from tandem.engine.kv_tiers.codec import BlockMeta
from tandem.engine.kv_tiers.store import EventInfo, TierStore
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request
from tandem.protocol import worker_pb2
from tandem.protocol.block_hash import hash_block_chain, request_hash_keys, root_hash
from tandem.serving.metrics import ServerMetrics
from tandem.serving.worker import byte_size

from .utils import make_tiny_model_dir

BS = 4
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
# 4 prefixes of 3 blocks; each prompt adds 2 tokens (never block-aligned), so a local hit
# and a tier load cover the same 3 blocks
PREFIXES = [list(range(100 + 20 * i, 112 + 20 * i)) for i in range(4)]
ROUND_1 = [p + [900 + i, 901 + i] for i, p in enumerate(PREFIXES)]
ROUND_2 = [p + [950 + i, 951 + i] for i, p in enumerate(PREFIXES)]


def _serve(eng: AsyncLLMEngine, prompts: list[list[int]], tag: str) -> list[tuple]:
    """Each prompt alone (the pool evicts in a fixed order): greedy tokens and logprobs."""
    async def main() -> list[tuple]:
        results = []
        for i, p in enumerate(prompts):
            (_, stream), = await eng.add_many([AddRequest(f"{tag}{i}", p, GREEDY)])
            while not (out := await stream.get()).finished:
                pass
            results.append((list(out.outputs[0].token_ids), out.outputs[0].logprobs))
        return results
    return asyncio.run(main())


def _run(model_dir: Path, num_kv_blocks: int, corrupt=None, second=ROUND_2,
         **offload) -> dict:
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), block_size=BS, num_kv_blocks=num_kv_blocks, num_threads=1,
        enable_kv_events=True, **offload)))
    try:
        core, sched = eng.engine, eng.engine.scheduler
        out = {"first": _serve(eng, ROUND_1, "a")}
        tiers = core.kv_tiers
        if tiers is not None:
            tiers.flush()
            out["snapshot"] = asyncio.run(eng._call(_tier_snapshot))
            if corrupt is not None:
                corrupt(tiers)
        loaded, hits = sched.tokens_loaded, core.kv.prefix_hits
        out["second"] = _serve(eng, second, "b")
        out["loaded"], out["hits"] = sched.tokens_loaded - loaded, core.kv.prefix_hits - hits
        out["stats"] = core.stats()
        if tiers is not None:
            assert isinstance(eng.kv_connector, OffloadConnector)
            assert eng.kv_connector.scheduler.staged_blocks == 0  # nothing held between steps
            out["tiers"] = {c.tier: c for c in tiers.stats()}
        return out
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model_dir(path, "llama", seed=5, tokenizer="trained", vocab_size=1024)
    return path


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """A pool big enough to keep every prefix: round 2 hits all 4 x 3 blocks locally."""
    got = _run(model_dir, 64)
    assert (got["loaded"], got["hits"]) == (0, 4 * 12)
    return got


def _block_bytes(model_dir) -> int:
    # 2 layers x (K, V) x 2 KV heads x 4 tokens x head_dim 16 x float32
    return 2 * 2 * 2 * BS * 16 * 4


def test_evicted_prefixes_reload_from_the_host_tier_with_exact_tokens(model_dir, reference):
    # 8 blocks: each request holds 4 (14 tokens + 5 outputs), so round 1 evicts the
    # earlier prefixes and round 2 finds none of the first three locally
    got = _run(model_dir, 8, kv_offload_host_bytes=1 << 20)
    assert got["first"] == reference["first"]
    assert got["second"] == reference["second"]  # the same pages: exactly equal
    host = got["tiers"]["host"]
    assert got["loaded"] >= 3 * 12 and host.loads * BS == got["loaded"]
    assert got["loaded"] + got["hits"] == 4 * 12
    assert host.validation_failures == 0 and host.stores >= 9
    s = got["stats"]
    assert s.kv_block_bytes == _block_bytes(model_dir)
    assert s.host_load_s_per_block > 0 and s.disk_load_s_per_block == 0
    # the KV event snapshot after round 1: the 3 evicted prefixes' 9 blocks (and the
    # evicted parts of the last two requests) are held in host memory only
    host_only, disk_only = got["snapshot"]
    assert len(host_only) >= 9 and disk_only == []
    # GetLoad and /metrics report them
    load = worker_pb2.Load(host_load_s_per_block=s.host_load_s_per_block,
                           kv_block_bytes=s.kv_block_bytes)
    assert load.kv_block_bytes == _block_bytes(model_dir)
    text = generate_latest(ServerMetrics("m", lambda: s).registry).decode()
    assert f'tandem_kv_tier_loads_total{{model_name="m",tier="host"}} {host.loads}.0' in text
    assert 'tandem_kv_tier_capacity_bytes{model_name="m",tier="host"} 1.048576e+06' in text
    assert 'tandem_kv_tier_validation_failures_total{model_name="m",tier="host"} 0.0' in text


def test_host_evictions_spill_to_disk_and_reload_exactly(model_dir, reference, tmp_path):
    record = _block_bytes(model_dir) + 400  # the header: well under 400 bytes
    got = _run(model_dir, 8, kv_offload_host_bytes=2 * record,
               kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_bytes=1 << 20)
    assert got["second"] == reference["second"]
    host, disk = got["tiers"]["host"], got["tiers"]["disk"]
    # which tier serves a block depends on how far the offload thread has spilled
    assert disk.loads >= 3 and host.loads + disk.loads == got["loaded"] // BS
    assert got["loaded"] + got["hits"] == 4 * 12
    assert host.used_bytes <= 2 * record and disk.used_bytes <= 1 << 20
    assert len(list((tmp_path / "kv").glob("*.kvb"))) == disk.stores - disk.evictions
    assert got["stats"].disk_load_s_per_block > 0


def _flip_every_disk_file_and_host_record(tiers) -> None:
    for f in Path(tiers.disk.path).glob("*.kvb") if tiers.disk is not None else ():
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x40
        f.write_bytes(bytes(data))
    for h, record in list(tiers.host._records.items()):
        tiers.host._records[h] = record[:-3] + bytes([record[-3] ^ 1]) + record[-2:]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_corrupt_records_are_recomputed_never_served(model_dir, reference, tmp_path, tier):
    record = _block_bytes(model_dir) + 400
    tiers = ({"kv_offload_host_bytes": 1 << 20} if tier == "host" else
             {"kv_offload_host_bytes": 2 * record, "kv_offload_disk_path": str(tmp_path),
              "kv_offload_disk_bytes": 1 << 20})
    # round 2 asks for prefixes 0 and 1 only: round 1 left them in the tiers alone
    got = _run(model_dir, 8, corrupt=_flip_every_disk_file_and_host_record,
               second=ROUND_2[:2], **tiers)
    # nothing loads: the first block of each prefix fails its digest, is dropped and the
    # prefix computed
    counts = got["tiers"]
    assert got["loaded"] == 0 and sum(c.loads for c in counts.values()) == 0
    assert counts[tier].validation_failures >= 1
    assert sum(c.validation_failures for c in counts.values()) == 2
    # greedy tokens as the reference's (computed over other step shapes: logprobs equal
    # up to float noise)
    for (toks, lps), (ref_toks, ref_lps) in zip(got["second"], reference["second"][:2],
                                                strict=True):
        assert toks == ref_toks
        for row, ref_row in zip(lps, ref_lps, strict=True):
            assert row.keys() == ref_row.keys()
            assert all(abs(row[t] - ref_row[t]) < 1e-4 for t in row)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_offload_disk_path": "/tmp/x", "kv_offload_disk_bytes": 10},
     "a KV disk tier needs the host tier"),
    ({"kv_offload_host_bytes": 10, "kv_offload_disk_path": "/tmp/x"},
     "kv_offload_disk_path and kv_offload_disk_bytes go together"),
    ({"kv_offload_host_bytes": -1}, "kv_offload_host_bytes must be bytes >= 0"),
    ({"kv_offload_host_bytes": 10, "kv_offload_compression": "lzma"},
     "kv_offload_compression must be one of"),
    ({"kv_offload_host_bytes": 10, "enable_prefix_caching": False},
     "KV offload needs prefix caching"),
])
def test_bad_offload_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_byte_sizes_of_the_offload_flags():
    assert [byte_size(t) for t in ("0", "4096", "4Gi", "4GiB", "512Mi", "2G", "1.5k")] == [
        0, 4096, 4 << 30, 4 << 30, 512 << 20, 2 * 10**9, 1500]
    for bad in ("-1", "4Gx", "", "nan", "1e30Ti"):
        with pytest.raises(Exception, match="bytes like 4Gi"):
            byte_size(bad)


def test_the_worker_refuses_a_disk_tier_without_the_host_tier(tmp_path, capsys):
    from tandem.cli import main
    from tests.serving.helpers import free_port

    with pytest.raises(SystemExit) as e:
        main(["worker", "--model", str(tmp_path), "--kv-offload-disk-path", str(tmp_path),
              "--kv-offload-disk-bytes", "1Gi", "--port", str(free_port())])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tandem worker: error: a KV disk tier needs the host tier (kv_offload_host_bytes > "
        "0): blocks reach disk from host memory")


def test_the_offline_llm_refuses_offload_tiers():
    from tandem import LLM

    with pytest.raises(ConfigError, match="KV offload tiers .* run in a served worker"):
        LLM(model="/nonexistent", kv_offload_host_bytes=1 << 20)


def _random_rounds(model_dir: Path, seed: int, rounds: list[list[list[int]]],
                   num_kv_blocks: int, **offload) -> dict:
    """Serve `rounds` (each a batch of prompts added at once) on one engine; between rounds,
    with tiers, load a random chain run from the tiers into the device pool as a peer pull's
    holder would (`load_into_cache`). Answers each prompt's greedy tokens and, with tiers,
    what was left held afterwards."""
    rng = random.Random(seed)
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(model_dir), block_size=BS, num_kv_blocks=num_kv_blocks, num_threads=1,
        enable_kv_events=True, **offload)))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def serve(batch: list[list[int]], tag: str) -> list[list[int]]:
        added = await eng.add_many([AddRequest(f"{tag}-{i}", p, params)
                                    for i, p in enumerate(batch)])
        out = []
        for _, stream in added:
            while not (o := await stream.get()).finished:
                pass
            out.append(list(o.outputs[0].token_ids))
        return out

    try:
        core = eng.engine
        tokens = []
        for r, batch in enumerate(rounds):
            tokens += asyncio.run(serve(batch, f"r{r}"))
            if core.kv_tiers is None:
                continue
            conn = eng.kv_connector
            assert isinstance(conn, OffloadConnector)
            prompt = rng.choice(batch)
            keys = request_hash_keys(core.state.model_name)
            chain = hash_block_chain(prompt, BS, keys)
            start = rng.randrange(len(chain))
            parent = chain[start - 1] if start else root_hash(keys)
            asyncio.run(eng._call(functools.partial(
                conn.load_into_cache, hashes=chain[start:], parent_hash=parent,
                token_ids=prompt[start * BS:])))
        out: dict = {"tokens": tokens}
        if core.kv_tiers is not None:
            core.kv_tiers.flush()
            pool = core.kv.pool
            out["pinned"] = pool.num_usable_blocks - pool.num_free_blocks()
            out["staged"] = eng.kv_connector.scheduler.staged_blocks
            out["pending"] = len(core.kv_tiers._pending) + len(core.kv_tiers._spilling)
            out["stats"] = {c.tier: c for c in core.kv_tiers.stats()}
        return out
    finally:
        eng.shutdown()


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_over_the_tiers_serve_exact_tokens_and_leave_nothing_pinned(
        model_dir, tmp_path, seed):
    rng = random.Random(seed)
    prefixes = [list(range(100 + 20 * i, 100 + 20 * i + BS * rng.randint(1, 3)))
                for i in range(5)]
    rounds = [[rng.choice(prefixes) + [rng.randrange(900, 1000)
                                       for _ in range(rng.randint(1, BS))]
               for _ in range(rng.randint(1, 3))] for _ in range(8)]
    reference = _random_rounds(model_dir, seed, rounds, 256)
    record = _block_bytes(model_dir) + 400
    offload: dict = {"kv_offload_host_bytes": rng.randint(1, 6) * record}
    if seed % 2:
        offload.update(kv_offload_disk_path=str(tmp_path / "kv"),
                       kv_offload_disk_bytes=rng.randint(2, 12) * record)
    got = _random_rounds(model_dir, seed, rounds, 14, **offload)
    assert got["tokens"] == reference["tokens"], f"seed {seed}"
    # nothing held once the engine is idle: no pinned block, no staged load, no pending save
    assert (got["pinned"], got["staged"], got["pending"]) == (0, 0, 0), f"seed {seed}"
    for c in got["stats"].values():
        assert c.used_bytes <= c.capacity_bytes, f"seed {seed}: {c}"
        assert c.validation_failures == 0, f"seed {seed}: {c}"
    # not vacuous: blocks were saved and served from the tiers
    assert sum(c.loads for c in got["stats"].values()) > 0, f"seed {seed}: nothing loaded"


class _PDStub:
    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        pass

    def build_connector_meta(self):
        return ConnectorMetadata({}, {})


def test_a_request_waiting_for_room_is_not_read_from_the_tiers_again_each_step():
    shape = (2, 2, 1, 2, BS, 16)
    store = TierStore(1 << 20)
    try:
        req = Request("w", list(range(100, 100 + 3 * BS + 2)), GREEDY, 5)
        hashes = req.update_block_hashes(BS)
        parent = root_hash(req.hash_keys)
        store.save([(BlockMeta(h, parent, ""), EventInfo(parent, (), BS),
                     torch.full(shape, float(i))) for i, h in enumerate(hashes)])
        store.flush()
        sched = OffloadScheduler(_PDStub(), store, BS, shape, torch.float32)
        host = store.counters["host"]
        for step in range(3):  # asked each step, never admitted: read once
            assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 3 * BS
            sched.build_connector_meta()
            assert host.loads == 3 and sched.staged_blocks == 3, step
        # asked at another position: read again (that run only)
        assert sched.get_num_new_matched_tokens(req, BS).num_tokens == 2 * BS
        assert host.loads == 5
        sched.build_connector_meta()
        # not asked in a step: dropped
        sched.build_connector_meta()
        assert sched.staged_blocks == 0
        # admitted: the step loads the pages fetched while it waited
        sched.get_num_new_matched_tokens(req, 0)
        sched.build_connector_meta()
        assert sched.get_num_new_matched_tokens(req, 0).num_tokens == 3 * BS
        sched.update_state_after_alloc(req, [7, 8, 9, 10], 3 * BS)
        meta = sched.build_connector_meta()
        assert meta.loads == {"w": (7, 8, 9)} and sched.staged_blocks == 0
        assert [float(p[0, 0, 0, 0, 0, 0]) for p in meta.pages["w"]] == [0.0, 1.0, 2.0]
        assert host.loads == 8
    finally:
        store.close()
