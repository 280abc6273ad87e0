"""Host/disk tier hits and peer pulls in the routing decision (`kvcredit`, `peer`), on a real
`Router` with constructed workers and index contents: measured credits order device over host
over disk, an unmeasured tier counts as a miss, and the KV peer is named exactly when the cost
model says pulling beats recomputing."""

from __future__ import annotations

import pytest

from tandem.protocol.kv_events import MEDIUM_DISK, MEDIUM_HOST
from tandem.protocol.web import PEER_BLOCKS_HEADER, PEER_HEADER, PREFILL_HEADER
from tandem.router import prompt as prompts
from tandem.router.core import Router, RouterSettings
from tandem.router.index import Hit
from tandem.router.kvcredit import saved_tokens
from tandem.router.pd import Route
from tandem.router.peer import DEFAULT_PULL_BYTES_PER_S
from tandem.router.workers import Worker, WorkerLoad

RATE = 1e-3  # s per prefill token
STEP = 1e-3  # s per decode step
BLOCKS = 16  # the prompt's full blocks (16 tokens each)


def fleet(policy: str = "cost", peer_pull: bool = False, n: int = 3, **load: object
          ) -> tuple[Router, list[Worker]]:
    r = Router(RouterSettings(policy=policy, seed=0, peer_pull=peer_pull), lambda m: None)
    ws = []
    for i in range(n):
        w = Worker(id=f"http://w{i}", model="m", ready=True, events_connected=True,
                   block_size=16, grpc_target=f"w{i}:50051", kv_transfer_backend="grpc",
                   kv_cache_dtype="auto",
                   load=WorkerLoad(prefill_s_per_token=RATE, decode_step_s=STEP,
                                   num_total_blocks=1000, **load))
        r.add_worker(w)
        ws.append(w)
    return r, ws


def request(seed: int) -> tuple[prompts.ParsedPrompt, list[bytes]]:
    ids = [seed * 1000 + i for i in range(BLOCKS * 16)]
    parsed = prompts.parse("completions", {"model": "m", "prompt": ids}, None)
    return parsed, prompts.block_hashes(parsed, "m", 16)


def routed(r: Router, parsed: prompts.ParsedPrompt):  # noqa: ANN201 - (Decision, ctx)
    decision, ctx = r.route(parsed, "m", now=1.0)
    assert decision is not None
    return decision, ctx


@pytest.mark.parametrize("policy", ["cost", "cache-aware"])
def test_device_beats_host_beats_disk_as_the_measured_load_times_say(policy):
    r, (a, b, c) = fleet(policy, host_load_s_per_block=1e-3, disk_load_s_per_block=8e-3)
    parsed, chain = request(1)
    r.index.stored(a.id, chain)
    r.index.stored(b.id, chain, MEDIUM_HOST)
    r.index.stored(c.id, chain, MEDIUM_DISK)
    decision, ctx = routed(r, parsed)
    assert decision.worker is a
    assert ctx.tier_hits == {b.id: Hit(0, BLOCKS), c.id: Hit(0, 0, BLOCKS)}
    # a host block saves its 16 tokens' prefill (16 ms) less its 1 ms load; disk 16 - 8
    assert ctx.credit_tokens == pytest.approx({b.id: 256 - 16 * 1e-3 / RATE,
                                               c.id: 256 - 16 * 8e-3 / RATE})
    parsed, chain = request(2)
    r.index.stored(b.id, chain, MEDIUM_HOST)
    r.index.stored(c.id, chain, MEDIUM_DISK)
    assert routed(r, parsed)[0].worker is b
    # the host tier not measured yet: credited as a miss, so the measured disk tier wins
    b.load.host_load_s_per_block = 0.0
    parsed, chain = request(3)
    r.index.stored(b.id, chain, MEDIUM_HOST)
    r.index.stored(c.id, chain, MEDIUM_DISK)
    decision, ctx = routed(r, parsed)
    assert decision.worker is c and b.id not in ctx.credit_tokens
    # a disk tier slower than recomputing saves nothing
    c.load.disk_load_s_per_block = 1.0
    assert saved_tokens(16, 1.0, RATE) == 0.0


def test_a_run_that_leaves_the_device_pool_counts_its_tier_blocks_after_the_device_ones():
    r, (a, b, _c) = fleet(host_load_s_per_block=2e-3)
    parsed, chain = request(4)
    r.index.stored(a.id, chain[:4])
    r.index.stored(a.id, chain[4:12], MEDIUM_HOST)
    r.index.stored(b.id, chain[:6])
    decision, ctx = routed(r, parsed)
    assert ctx.tier_hits[a.id] == Hit(4, 8, 0)
    assert ctx.matched_tokens == {a.id: 64, b.id: 96}
    # a: 64 cached + 8 host blocks saving 128 - 16 tokens = 176 (costed as cached) > 96
    assert ctx.credit_tokens[a.id] == pytest.approx(128 - 8 * 2e-3 / RATE)
    assert decision.worker is a and decision.matched_tokens == 64


def test_device_only_decisions_are_unchanged_by_an_empty_tier_index():
    picks = []
    for tiers in (False, True):
        r, ws = fleet()
        if tiers:  # tier blocks of another prompt: every decision below reads the tiers
            other = request(99)[1]
            r.index.stored(ws[2].id, other, MEDIUM_HOST)
            r.index.removed(ws[2].id, other, MEDIUM_HOST)
        got = []
        for seed in range(40):
            parsed, chain = request(seed % 7)
            if seed % 3 == 0:
                r.index.stored(ws[seed % 3].id, chain[:seed % BLOCKS])
            d, ctx = routed(r, parsed)
            got.append((d.worker.id, d.matched_tokens, d.scores["cost"]))
            assert not ctx.tier_hits and not ctx.credit_tokens
        picks.append(got)
    assert picks[0] == picks[1]


def _peer_fleet(**load: object) -> tuple[Router, list[Worker], prompts.ParsedPrompt]:
    r, ws = fleet(peer_pull=True, **load)
    parsed, chain = request(5)
    holder = ws[0]
    r.index.stored(holder.id, chain)
    holder.load.num_running, holder.load.pending_prefill_tokens = 40, 100_000  # saturated
    return r, ws, parsed


def test_the_peer_is_named_when_pulling_beats_recomputing():
    # 1 MB blocks at the default 1 GB/s: 1 ms a block against 16 ms of prefill
    r, (holder, b, c), parsed = _peer_fleet(kv_block_bytes=1 << 20)
    decision, ctx = routed(r, parsed)
    assert decision.worker in (b, c)
    pull = ctx.peers[decision.worker.id]
    assert (pull.holder, pull.blocks, pull.extra, pull.medium) == (holder, BLOCKS, BLOCKS,
                                                                   "device")
    assert pull.pull_s == pytest.approx(BLOCKS * (1 << 20) / DEFAULT_PULL_BYTES_PER_S)
    assert pull.recompute_s == pytest.approx(BLOCKS * 16 * RATE)
    route = Route(decision, peer=pull)
    assert route.headers() == {PEER_HEADER: "w0:50051", PEER_BLOCKS_HEADER: str(BLOCKS)}
    # the ranking credits no pull: the holder keeps its affinity unless it is busier
    assert decision.worker.id not in ctx.credit_tokens
    # the worker's own measured pull time wins over the prior: now slower than computing
    for w in (b, c):
        w.load.peer_pull_s_per_block = 0.02
    decision, ctx = routed(r, parsed)
    assert not ctx.peers


def test_no_peer_without_a_block_size_a_signature_or_a_compatible_dtype():
    def peers(r: Router, parsed: prompts.ParsedPrompt) -> dict:
        decision, ctx = routed(r, parsed)
        r.retract(decision, 1.0)  # each pick starts from the confirmed blocks
        return ctx.peers

    r, (_holder, b, c), parsed = _peer_fleet()  # no kv_block_bytes, no measured pull
    assert not peers(r, parsed)
    r, (holder, b, c), parsed = _peer_fleet(kv_block_bytes=1 << 20)
    holder.kv_cache_dtype = "fp8"  # its pages would be refused
    assert not peers(r, parsed)
    holder.kv_cache_dtype = None  # not known: allowed (a mismatch is refused and recomputed)
    assert peers(r, parsed)
    r.settings.peer_pull = False  # no worker key (main) or --no-peer-pull
    assert not peers(r, parsed)
    r.settings.peer_pull = True
    b.kv_transfer_backend = c.kv_transfer_backend = None  # stock servers: they cannot pull
    assert not peers(r, parsed)
    b.kv_transfer_backend = c.kv_transfer_backend = "grpc"
    holder.grpc_target = None
    assert not peers(r, parsed)


def test_a_host_held_peer_block_adds_the_holders_load_and_p_d_takes_precedence():
    r, (holder, b, c), parsed = _peer_fleet(kv_block_bytes=1 << 20,
                                            host_load_s_per_block=5e-3)
    chain = prompts.block_hashes(parsed, "m", 16)
    r.index.removed(holder.id, chain[8:])
    r.index.stored(holder.id, chain[8:], MEDIUM_HOST)
    decision, ctx = routed(r, parsed)
    pull = ctx.peers[decision.worker.id]
    assert pull.medium == "host" and pull.blocks == BLOCKS
    assert pull.pull_s == pytest.approx(BLOCKS * 1e-3 * 1.048576 + 8 * 5e-3)
    prefill = Route(decision, prefill=decision, peer=pull)  # P/D: the prefill header only
    assert set(prefill.headers()) == {PREFILL_HEADER}


def test_the_endpoint_picker_signs_the_peer_and_strips_a_clients_own(tmp_path):
    from types import SimpleNamespace

    from tandem.protocol.signing import SIGNATURE_HEADER, WorkerKey, verify
    from tandem.protocol.web import forward_target
    from tandem.router.extproc.picker import STRIPPED, upstream_headers
    from tests.serving.helpers import WORKER_KEY, worker_key_file

    r, (_holder, _b, _c), parsed = _peer_fleet(kv_block_bytes=1 << 20)
    decision, ctx = routed(r, parsed)
    route = Route(decision, peer=ctx.peers[decision.worker.id])
    ra = SimpleNamespace(settings=SimpleNamespace(worker_key=WorkerKey(worker_key_file(tmp_path))))
    pick = SimpleNamespace(rid="r1", body=b'{"prompt": [1]}', route=route)
    out = upstream_headers(ra, pick)
    assert (out[PEER_HEADER], out[PEER_BLOCKS_HEADER]) == ("w0:50051", str(BLOCKS))
    verify([WORKER_KEY], out[SIGNATURE_HEADER], pick.body, forward_target(None, "w0:50051"))
    assert {PEER_HEADER, PEER_BLOCKS_HEADER} <= set(STRIPPED)
