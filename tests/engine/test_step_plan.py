"""The step plan's wire form (`engine/parallel/plan.py`): random plans of every kind
round-trip exactly (dtypes included: the block table stays int32 for the attention
kernels; the forward's decisions too: LoRA slots per token, graphs, hidden states, the
blocks whose layers are gathered as they are written), and malformed arrays (bad magic,
unknown kind, negative or oversized counts, unknown flags, a LoRA slot count other than 0
or T, a payload shorter or longer than its header says, `save_layers` outside an eager
FORWARD plan with blocks, a FORWARD plan naming blocks without it, KV group tables outside
a FORWARD plan) are a ValueError, never a plan. A hybrid model's FORWARD plan carries each
KV group's slots and tables (padded to the widest)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.engine.parallel.plan import (
    HEADER,
    MAX_ELEMENTS,
    GroupTables,
    PlanKind,
    StepPlan,
)


def _random_plan(rng: random.Random) -> StepPlan:
    b = rng.randrange(0, 6)
    q = [rng.randrange(1, 9) for _ in range(b)]
    t = sum(q)
    w = rng.randrange(1, 7) if b else 0
    ints = lambda n, hi=1 << 40: np.array([rng.randrange(hi) for _ in range(n)],  # noqa: E731
                                          dtype=np.int64)
    kind = rng.choice(list(PlanKind))
    graphs = rng.random() < 0.5
    # a FORWARD plan names blocks only to gather their layers, which an eager step does
    save = kind == PlanKind.FORWARD and not graphs and rng.random() < 0.5
    n_ids = rng.randrange(1, 5) if save else (
        0 if kind == PlanKind.FORWARD else rng.randrange(0, 5))
    return StepPlan(
        kind=kind, tokens=ints(t), positions=ints(t), slots=ints(t),
        logits_idx=ints(rng.randrange(0, t + 1)), query_lens=np.array(q, dtype=np.int64),
        seq_lens=ints(b), block_table=ints(b * w, 1 << 30).astype(np.int32).reshape(b, w),
        table_lens=ints(b, w + 1).astype(np.int32), num_decode=rng.randrange(0, t + 1),
        return_hidden=rng.random() < 0.5, block_ids=ints(n_ids),
        lora_slots=(np.array([rng.randrange(-1, 4) for _ in range(t)], dtype=np.int64)
                    if rng.random() < 0.5 else np.empty(0, np.int64)),
        graphs=graphs, save_layers=save, groups=tuple(
            GroupTables(ints(t), ints(b * gw, 1 << 30).astype(np.int32).reshape(b, gw),
                        ints(b, gw + 1).astype(np.int32))
            for gw in ([rng.randrange(1, 7) if b else 0 for _ in range(rng.randrange(5))]
                       if kind == PlanKind.FORWARD else ())))


def test_random_plans_round_trip() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        plan = _random_plan(rng)
        got = StepPlan.decode(plan.encode())
        assert got.kind == plan.kind and got.num_decode == plan.num_decode
        assert got.return_hidden == plan.return_hidden and got.graphs == plan.graphs
        assert got.save_layers == plan.save_layers
        for name in ("tokens", "positions", "slots", "logits_idx", "query_lens", "seq_lens",
                     "block_table", "table_lens", "block_ids", "lora_slots"):
            a, b = getattr(got, name), getattr(plan, name)
            assert a.shape == b.shape and np.array_equal(a, b), name
        assert got.block_table.dtype == np.int32 and got.block_table.flags.c_contiguous
        assert got.table_lens.dtype == np.int32 and got.tokens.dtype == np.int64
        assert len(got.groups) == len(plan.groups)
        for a, b in zip(got.groups, plan.groups, strict=True):  # tables padded with zeros
            w = b.block_table.shape[1]
            assert np.array_equal(a.slots, b.slots) and np.array_equal(a.table_lens,
                                                                       b.table_lens)
            assert np.array_equal(a.block_table[:, :w], b.block_table)
            assert not a.block_table[:, w:].any() and a.block_table.dtype == np.int32


def _header(**over: int) -> np.ndarray:
    plan = StepPlan(tokens=np.arange(3), positions=np.arange(3), slots=np.arange(3),
                    logits_idx=np.array([2]), query_lens=np.array([3]),
                    seq_lens=np.array([3]), block_table=np.array([[1]], np.int32),
                    table_lens=np.array([1], np.int32))
    data = plan.encode()
    names = ["magic", "kind", "t", "l", "b", "w", "nd", "flags", "p", "s", "g", "gw"]
    for k, v in over.items():
        data[names.index(k)] = v
    return data


@pytest.mark.parametrize("over,message", [
    (dict(magic=7), "bad magic"),
    (dict(kind=9), "is not a valid PlanKind"),
    (dict(t=-1), "out of range"),
    (dict(nd=4), "out of range"),
    (dict(flags=8), "out of range"),
    (dict(flags=4), "save_layers needs"),  # no blocks to gather
    (dict(flags=6), "save_layers needs"),  # a graph step has no layer hook
    (dict(magic=0x7A4E_0002), "bad magic"),  # the format before save_layers
    (dict(magic=0x7A4E_0003), "bad magic"),  # the format before KV group tables
    (dict(kind=int(PlanKind.STOP), g=1), "out of range"),  # group tables: FORWARD only
    (dict(g=256), "out of range"),
    (dict(gw=-1), "out of range"),
    (dict(s=2), "out of range"),  # LoRA slots for some tokens only
    (dict(s=-3), "out of range"),
    (dict(magic=0x7A4E_0001), "bad magic"),  # the format before LoRA slots and graphs
    (dict(t=MAX_ELEMENTS), "too large"),
    (dict(b=2), "payload"),
])
def test_malformed_plans_are_refused(over: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepPlan.decode(_header(**over))


def test_lora_slots_for_some_tokens_only_do_not_encode() -> None:
    plan = StepPlan(tokens=np.arange(3), positions=np.arange(3), slots=np.arange(3),
                    lora_slots=np.array([0, -1]))
    with pytest.raises(ValueError, match="2 LoRA slots for 3 tokens"):
        plan.encode()


def test_blocks_travel_in_a_forward_plan_only_to_gather_their_layers() -> None:
    ids = np.array([5, 2, 9], dtype=np.int64)
    plan = StepPlan(tokens=np.arange(3), positions=np.arange(3), slots=np.arange(3),
                    block_ids=ids, save_layers=True)
    got = StepPlan.decode(plan.encode())
    assert got.save_layers and np.array_equal(got.block_ids, ids)
    with pytest.raises(ValueError, match="names blocks only with save_layers"):
        StepPlan(tokens=np.arange(3), positions=np.arange(3), slots=np.arange(3),
                 block_ids=ids).encode()
    with pytest.raises(ValueError, match="save_layers needs"):
        StepPlan(kind=PlanKind.KV_GATHER, block_ids=ids, save_layers=True).encode()
    data = plan.encode()
    data[1] = int(PlanKind.KV_SCATTER)  # a control plan with the flag: refused on decode
    with pytest.raises(ValueError, match="save_layers needs"):
        StepPlan.decode(data)


def test_truncated_and_padded_payloads_are_refused() -> None:
    data = _header()
    with pytest.raises(ValueError, match="payload"):
        StepPlan.decode(data[:-1])
    with pytest.raises(ValueError, match="payload"):
        StepPlan.decode(np.concatenate([data, [0]]))
    with pytest.raises(ValueError, match="shorter than its header"):
        StepPlan.decode(data[: HEADER - 1])


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as the kernel writes them) LISTENing on `port`, IPv4 and IPv6."""
    out = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    out.add(addr)
    return out


def test_rank_zeros_store_listens_on_its_host_only():
    """A TCPStore left to bind itself listens on every interface: the mp executor's store
    (host 127.0.0.1) must be reachable from this machine only, and still serve its ranks."""
    import datetime

    import torch.distributed as dist

    from tandem.engine.parallel.comm import host_store

    store = host_store("127.0.0.1", 10.0, world=2)
    assert _listening(store.port) == {"0100007F"}  # 127.0.0.1, nothing else
    peer = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False,
                         timeout=datetime.timedelta(seconds=10))
    peer.set("k", "v")
    assert store.get("k") == b"v"
