"""The KV connector's loading path, end to end: the scheduler asks the connector at
admission (`get_num_new_matched_tokens`), counts the tokens it loads as computed in the step
that admits the request, and the model runner loads them before each layer attends
(`start_load_kv`, `wait_for_layer_load`); loaded blocks join the prefix cache only after
that step. Proven with a real host-memory page store on a tiny model (tokens and logprobs
equal a run that computes everything) and with the write-tracking simulation (`kv_sim`) over
thousands of random traces whose connector answers random external matches. The same
store at tensor_parallel_size 2 (its worker side reads and writes full-head pages through
`KVConnectorWorker.pages`, which hands every rank its heads) gives the same tokens."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

import pytest
import torch

from tandem import SamplingParams
from tandem.engine.async_engine import AddRequest, AsyncLLMEngine
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import KVCacheManager, cdiv
from tandem.engine.kv_connector.base import (
    ConnectorMetadata,
    ExternalMatch,
    FinishAction,
    KVConnectorScheduler,
    KVConnectorWorker,
    register,
)
from tandem.engine.kv_connector.pd import PDConnector
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.scheduler import Scheduler

from .kv_sim import Sim, SimViolation, run_trace, sim_tokenizer
from .utils import make_request, make_tiny_model_dir

SIM_TRACES = 3000


class SimConnector(KVConnectorScheduler, KVConnectorWorker):
    """Both sides of a host-memory KV tier keyed by block hash (one "layer"): saves the
    computed full blocks of each normally finished request, answers a random number of
    tokens within the stored run after the local hit, loads a step's blocks when asked."""

    def __init__(self, sim: Sim, rng: random.Random) -> None:
        self.sim, self.rng = sim, rng
        self.store: dict[bytes, tuple[int, ...]] = {}
        self._asked: dict[str, int] = {}  # request id -> num_computed_tokens last asked with
        self._loads: dict[str, tuple[tuple[int, ...], tuple[bytes, ...]]] = {}
        self._sources: dict[str, tuple[bytes, ...]] = {}  # the built step's, by request id
        self._step: list[tuple[tuple[int, ...], tuple[bytes, ...]]] = []
        self.loaded_blocks = 0

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens) -> ExternalMatch:
        bs = self.sim.block_size
        if num_computed_tokens % bs:
            self.sim._fail(f"asked from {num_computed_tokens}, inside a block")
        hashes = request.update_block_hashes(bs)
        first = run = num_computed_tokens // bs
        while run < len(hashes) and hashes[run] in self.store:
            run += 1
        self._asked[request.request_id] = num_computed_tokens
        if run == first:
            return ExternalMatch(0)
        stored = (run - first) * bs
        whole = self.rng.random() < 0.5  # the whole stored run, or a random part of it
        return ExternalMatch(stored if whole else self.rng.randint(1, stored))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        if not num_external_tokens:
            return
        bs, rid = self.sim.block_size, request.request_id
        first = self._asked.pop(rid) // bs
        end = first + cdiv(num_external_tokens, bs)
        self._loads[rid] = (tuple(block_ids[first:end]),
                            tuple(request.update_block_hashes(bs)[first:end]))

    def build_connector_meta(self) -> ConnectorMetadata:
        loads, self._loads = self._loads, {}
        self._sources = {rid: hashes for rid, (_, hashes) in loads.items()}
        return ConnectorMetadata({rid: ids for rid, (ids, _) in loads.items()}, {})

    def request_finished(self, request, block_ids) -> FinishAction:
        sim, bs = self.sim, self.sim.block_size
        hashes = request.update_block_hashes(bs)
        n = min(request.num_computed_tokens // bs, len(hashes))
        want = sim._idents(request, n * bs)  # what its computed positions must hold
        for i in range(n):
            held = tuple(sim.cache[block_ids[i]])
            if held != tuple(want[i * bs:(i + 1) * bs]):
                sim._fail(f"{request.request_id} finished with block {block_ids[i]} not "
                          "holding its computed tokens")
            self.store.setdefault(hashes[i], held)
            sim.hash_ident.setdefault(hashes[i], list(held))  # (accepted drafts' blocks too)
        return FinishAction(request.keep_kv)

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, layout) -> None:
        pass

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self._step = [(ids, self._sources[rid]) for rid, ids in metadata.loads.items()]

    def wait_for_layer_load(self, layer: int) -> None:
        for ids, hashes in self._step:
            for block_id, h in zip(ids, hashes, strict=True):
                self.sim.cache[block_id] = list(self.store[h])
                self.loaded_blocks += 1
        self._step = []

    def save_kv_layer(self, request_id: str, layer: int, event: object) -> None:
        pass

    def wait_for_save(self) -> None:
        pass



def _sim_connector(sim: Sim) -> SimConnector:
    return SimConnector(sim, random.Random(sim.seed * 104729 + 3))


def _run_sims(seeds: range, connector=_sim_connector) -> dict:
    logging.disable(logging.CRITICAL)  # injected faults log a traceback each
    stats = dict(traces=0, loaded_tokens=0, loaded_blocks=0, computed=0, violations=[])
    try:
        for seed in seeds:
            try:
                sim = run_trace(seed, sim_tokenizer(), connector=connector)
            except SimViolation as exc:
                stats["violations"].append(str(exc))
                continue
            stats["traces"] += 1
            stats["loaded_tokens"] += sim.sched.tokens_loaded
            stats["computed"] += sim.sched.tokens_computed
            stats["loaded_blocks"] += sim.connector.loaded_blocks
    finally:
        logging.disable(logging.NOTSET)
    return stats


# -- a real loading connector: a host-memory page store keyed by block hash -----------------
@dataclass(frozen=True)
class StoreMeta(ConnectorMetadata):
    """The step's loads, with the stored block hash of each block id they go into."""

    sources: dict[str, tuple[bytes, ...]] = field(default_factory=dict)


class StoreScheduler(KVConnectorScheduler):
    def __init__(self, conn: HostStoreConnector, block_size: int) -> None:
        self.conn, self.bs = conn, block_size
        self._asked: dict[str, int] = {}
        self._loads: dict[str, tuple[tuple[int, ...], tuple[bytes, ...]]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens) -> ExternalMatch:
        hashes = request.update_block_hashes(self.bs)
        first = run = num_computed_tokens // self.bs
        while run < len(hashes) and hashes[run] in self.conn.store:
            run += 1
        self._asked[request.request_id] = num_computed_tokens
        return ExternalMatch((run - first) * self.bs)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        if num_external_tokens:
            first = self._asked.pop(request.request_id) // self.bs
            end = first + cdiv(num_external_tokens, self.bs)
            self._loads[request.request_id] = (
                tuple(block_ids[first:end]), tuple(request.update_block_hashes(self.bs)[first:end]))

    def build_connector_meta(self) -> StoreMeta:
        loads, self._loads = self._loads, {}
        return StoreMeta({r: ids for r, (ids, _) in loads.items()}, {},
                         {r: hashes for r, (_, hashes) in loads.items()})

    def request_finished(self, request, block_ids) -> FinishAction:
        """Save the computed full blocks' pages (every layer, every KV head) the store does
        not hold."""
        hashes = request.update_block_hashes(self.bs)
        new = [i for i in range(min(request.num_computed_tokens // self.bs, len(hashes)))
               if hashes[i] not in self.conn.store]
        if new:
            pages = self.conn.worker.pages.read([block_ids[i] for i in new])
            for j, i in enumerate(new):
                self.conn.store[hashes[i]] = [p[:, j:j + 1].clone() for p in pages]
        return FinishAction(request.keep_kv)


class StoreWorker(KVConnectorWorker):
    def __init__(self, conn: HostStoreConnector) -> None:
        self.conn = conn
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._step: list[tuple[list[int], tuple[bytes, ...]]] = []
        self.waits: list[list[int]] = []  # the layers waited for, per step with loads
        self.steps = self.saves = 0

    def register_kv_caches(self, kv_caches, layout) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: StoreMeta) -> None:
        self.steps += 1
        self._step = [(list(ids), metadata.sources[r]) for r, ids in metadata.loads.items()]
        if self._step:
            self.waits.append([])

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer `layer`'s pages go in only now: a layer that attends before its wait reads
        garbage, and the tokens differ."""
        self.waits[-1].append(layer)
        for ids, hashes in self._step:
            pages = torch.cat([self.conn.store[h][layer] for h in hashes], dim=1)
            self.pages.write(layer, ids, pages)

    def save_kv_layer(self, request_id, layer, event) -> None:
        pass

    def wait_for_save(self) -> None:
        self.saves += 1


@register("test-host-store")
class HostStoreConnector(PDConnector):
    """The P/D connector's page API, with a host tier as its scheduler and worker sides."""

    loads_kv = True

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.store: dict[bytes, list[torch.Tensor]] = {}
        core = engine.engine
        self.scheduler = StoreScheduler(self, core.kv.block_size)
        self.worker = StoreWorker(self)
        self.attach(core)


BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
A, B = list(range(300, 312)), list(range(400, 408))
C, D = list(range(500, 517)), list(range(600, 616))  # 4 full blocks + 1 token; 4 exactly
ROUND_1 = [A + [900, 901, 902], B + [910, 911], C, D]
ROUND_2 = [A + [920, 921, 922, 923, 924], B + [930, 931, 932], C]


def _serve(eng: AsyncLLMEngine, prompts: list[list[int]], tag: str) -> list[tuple]:
    """Greedy tokens and logprobs of `prompts`, added together (one step admits them)."""
    async def main() -> list[tuple]:
        added = await eng.add_many([AddRequest(f"{tag}{i}", p, GREEDY)
                                    for i, p in enumerate(prompts)])
        results = []
        for _, stream in added:
            while not (out := await stream.get()).finished:
                pass
            c = out.outputs[0]
            results.append((list(c.token_ids), c.logprobs))
        return results
    return asyncio.run(main())


def _scramble(core: LLMEngine) -> None:
    """Random pages into every block of every rank's cache."""
    k = core.runner.kv_caches[0][0]
    shape = (2, k.shape[0], core.num_kv_heads, *k.shape[2:])
    core.import_kv(list(range(k.shape[0])), [torch.randn(shape, dtype=k.dtype)
                                             for _ in core.runner.kv_caches])


def _rounds(path, connector: str | None, tp: int = 1) -> dict:
    """Round 1; with the connector the prefix cache is then reset, so round 2 (prefixes of
    round 1's prompts) and round 3 (D again) find nothing locally and load from the store;
    without it they hit the local cache. Round 4 shares A with round 2."""
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), block_size=BS,
                                                num_kv_blocks=24, num_threads=1,
                                                tensor_parallel_size=tp)))
    try:
        core, sched = eng.engine, eng.engine.scheduler
        if connector is not None:
            eng.kv_connector_name = connector
            assert isinstance(eng.kv_connector, HostStoreConnector)
        out = {"first": _serve(eng, ROUND_1, "a")}
        if connector is not None:
            assert asyncio.run(eng._call(lambda e: e.reset_prefix_cache()))
            asyncio.run(eng._call(_scramble))  # no page computed in round 1 is left
        for name, prompts in (("second", ROUND_2), ("third", [D]), ("fourth", [A + [7, 8]])):
            loaded, computed, hits = sched.tokens_loaded, sched.tokens_computed, core.kv.prefix_hits
            out[name] = _serve(eng, prompts, name)
            out[name + "_counts"] = (sched.tokens_loaded - loaded,
                                     sched.tokens_computed - computed, core.kv.prefix_hits - hits)
        if connector is not None:
            out["connector"] = eng.kv_connector
        # the worker's /metrics count what was loaded
        assert core.stats().kv_connector_loaded_tokens == sched.tokens_loaded
        return out
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model_dir(path, "llama", seed=3, tokenizer="trained", vocab_size=1024)
    return path


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """The rounds without a connector (the prefix cache serves what it holds)."""
    return _rounds(model_dir, None)


def test_loaded_prefixes_equal_cached_ones_and_only_the_last_token_is_computed(model_dir,
                                                                               reference):
    got, ref = _rounds(model_dir, "test-host-store"), reference
    # round 2 loads A's 3 blocks, B's 2 and C's 4 (16 tokens: its 17th is computed) and
    # computes the rest of each prompt and 5 decode steps each; without the connector the
    # same tokens hit the local cache
    assert got["second_counts"] == (12 + 8 + 16, 5 + 3 + 1 + 3 * 5, 0)
    assert ref["second_counts"] == (0, 5 + 3 + 1 + 3 * 5, 12 + 8 + 16)
    assert got["first"] == ref["first"]
    # the same steps over the same pages: greedy tokens and logprobs are equal, exactly
    assert got["second"] == ref["second"]
    # D: the store holds all 16 tokens; 15 load and the last is computed, so it samples
    # (the local cache serves 12: the last block is never hit); equal up to the float noise
    # of steps of another shape
    assert got["third_counts"] == (15, 1 + 5, 0) and ref["third_counts"] == (0, 4 + 5, 12)
    (tokens, lps), = got["third"]
    (ref_tokens, ref_lps), = ref["third"]
    assert tokens == ref_tokens
    for row, ref_row in zip(lps, ref_lps, strict=True):
        assert row.keys() == ref_row.keys()
        assert all(abs(row[t] - ref_row[t]) < 1e-4 for t in row)
    # loaded blocks joined the prefix cache after the step that loaded them: A hits locally
    assert got["fourth_counts"] == ref["fourth_counts"] == (0, 2 + 5, 12)
    conn = got["connector"]
    worker = conn.worker
    # every step started its loads and waited for its saves; each step with loads waited
    # for every layer once, in order, before that layer attended
    assert worker.steps == worker.saves > 0
    assert len(worker.waits) == 2
    assert all(w == list(range(len(worker.kv_caches))) for w in worker.waits)
    # each normally finished request's computed full blocks (prompt + 5 outputs): round
    # 1's 5 + 3 + 5 + 5, round 2's 2 after A and 2 after B (C's are stored), round 4's 1
    assert len(conn.store) == 5 + 3 + 5 + 5 + 2 + 2 + 1


def test_random_traces_with_a_loading_connector_read_only_written_kv():
    """Every slot a step reads was computed or loaded; no block is cached (nor announced)
    before its step completed; every request's tokens are exact; every pin is released."""
    stats = _run_sims(range(SIM_TRACES))
    assert stats["violations"] == []
    assert stats["traces"] == SIM_TRACES
    # the traces loaded a good share of what they ran (not vacuous)
    assert stats["loaded_blocks"] > 3 * SIM_TRACES
    assert stats["loaded_tokens"] > 6 * SIM_TRACES


class _Forgetful(SimConnector):
    """Answers and is told of loads, but never writes the pages."""

    def wait_for_layer_load(self, layer: int) -> None:
        self._step = []


def test_the_simulation_flags_loads_that_never_reach_the_cache():
    stats = _run_sims(range(200), lambda sim: _Forgetful(sim, random.Random(sim.seed)))
    assert len(stats["violations"]) >= 50


class _Asking(KVConnectorScheduler):
    def __init__(self, match: ExternalMatch) -> None:
        self.match = match
        self.asked: list[tuple[str, int]] = []
        self.allocs: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens) -> ExternalMatch:
        self.asked.append((request.request_id, num_computed_tokens))
        return self.match

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(self, request, block_ids) -> FinishAction:
        return FinishAction()


def test_an_external_match_is_cut_to_leave_the_last_token_and_due_prompt_logprobs():
    kv = KVCacheManager(16, BS)
    kv.connector = side = _Asking(ExternalMatch(100))
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make_request(list(range(10, 19)), request_id="r"))  # 9 tokens
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.num_external_tokens) == (8, 1, 8) and s.samples
    assert side.asked == [("r", 0)] and side.allocs == [("r", [0, 1, 2], 8)]
    assert out.kv_connector_meta == ConnectorMetadata()
    # prompt logprobs from position 0 are due: nothing is loaded
    plp = make_request(list(range(30, 39)), request_id="p")
    plp.sampling_params.prompt_logprobs = 0
    plp.prompt_logprobs_pos = 0
    sched.add_request(plp)
    (s,) = [x for x in sched.schedule().scheduled if x.request.request_id == "p"]
    assert (s.start, s.num_external_tokens) == (0, 0)


def test_asynchronous_loads_are_refused():
    kv = KVCacheManager(16, BS)
    kv.connector = _Asking(ExternalMatch(4, load_async=True))
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make_request(list(range(10, 19)), request_id="r"))
    with pytest.raises(ConfigError, match="answered load_async for 'r': this engine loads "
                                          "external KV synchronously only"):
        sched.schedule()


def _close(got: list[tuple], want: list[tuple]) -> None:
    """Equal greedy tokens and logprob keys; logprobs equal up to float noise."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lps), (_, ref_lps) in zip(got, want, strict=True):
        for row, ref_row in zip(lps, ref_lps, strict=True):
            assert row.keys() == ref_row.keys()
            assert all(abs(row[t] - ref_row[t]) < 1e-4 for t in row)


def test_a_loading_connector_at_tensor_parallel_size_2_gives_the_same_tokens(model_dir,
                                                                            reference):
    """Every rank's cache is scrambled after round 1; the loads reach each rank's heads
    (one KV head each), so the loaded rounds give the tokens of a run that computes or
    hits everything."""
    got, ref = _rounds(model_dir, "test-host-store", tp=2), reference
    assert got["second_counts"] == (12 + 8 + 16, 5 + 3 + 1 + 3 * 5, 0)
    assert got["third_counts"] == (15, 1 + 5, 0)
    assert got["fourth_counts"] == ref["fourth_counts"] == (0, 2 + 5, 12)
    for name in ("first", "second", "third", "fourth"):
        _close(got[name], ref[name])
    conn = got["connector"]
    assert len(conn.worker.waits) == 2
    assert all(w == list(range(len(conn.worker.kv_caches))) for w in conn.worker.waits)
    assert len(conn.store) == 5 + 3 + 5 + 5 + 2 + 2 + 1
    (page,) = {tuple(p.shape) for pages in conn.store.values() for p in pages}
    assert page[:3] == (2, 1, 2)  # stored with both KV heads, gathered from the two ranks


def test_leases_past_their_time_end_at_the_next_step_boundary(model_dir):
    """The engine thread expires them between steps."""
    core = LLMEngine(EngineConfig(model=str(model_dir), block_size=BS, num_kv_blocks=16,
                                  num_threads=1))
    now = [1000.0]
    core.kv.clock = lambda: now[0]
    core.kv.keep_lease_s = 5.0
    core.add_request("k", list(range(10, 19)), GREEDY, keep_blocks=True)
    while core.has_unfinished_requests():
        core.step()
    assert len(core.kv.kept_blocks("k")) == 4
    now[0] += 4.9
    core.step()
    assert core.kv.kept_blocks("k") is not None
    now[0] += 0.1
    assert core.step() == []
    assert core.kv.kept_blocks("k") is None and core.kv.pool.num_free_blocks() == 16
    assert core.kv.lease_stats().expired == 1
