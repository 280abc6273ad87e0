"""`BlockTable` (the persistent per-request block ids) and `BatchLayout`'s two table forms."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.engine.attention.base import BatchLayout
from tandem.engine.kv_cache.block_table import BlockTable


def test_grows_by_doubling_and_keeps_rows():
    bt = BlockTable(rows=2, width=2)
    bt.append("a", [1, 2])
    bt.append("b", [3])
    bt.append("a", [4, 5, 6])  # width 2 -> 8
    assert bt.shape == (2, 8)
    bt.append("c", [7])  # rows 2 -> 4
    assert bt.shape == (4, 8)
    assert bt.row("a").tolist() == [1, 2, 4, 5, 6]
    assert bt.row("b").tolist() == [3] and bt.row("c").tolist() == [7]
    assert bt.row("a").dtype == np.int32
    assert len(bt) == 3 and "c" in bt and "d" not in bt
    assert bt.row("d").tolist() == []


def test_dropped_rows_are_zeroed_and_reused():
    bt = BlockTable(rows=2, width=4)
    bt.append("a", [9, 9, 9, 9])
    bt.append("b", [5])
    bt.drop("a")
    bt.drop("a")  # idempotent
    assert "a" not in bt and bt.table[0].tolist() == [0, 0, 0, 0]
    bt.append("c", [1])
    assert bt.row_of["c"] == 0 and bt.shape == (2, 4)  # the freed row, no growth
    table, lens = bt.gather(["c", "b"])
    assert table.tolist() == [[1], [5]] and lens.tolist() == [1, 1]


def test_gather_pads_with_zeros_to_the_longest_row():
    bt = BlockTable(rows=1, width=1)
    bt.append("long", [4, 5, 6])
    bt.append("short", [8])
    bt.append("empty", [])
    table, lens = bt.gather(["short", "empty", "long"])
    assert table.dtype == np.int32 and table.flags.c_contiguous
    assert table.tolist() == [[8, 0, 0], [0, 0, 0], [4, 5, 6]]
    assert lens.tolist() == [1, 0, 3]
    table[0, 0] = 99  # a copy: the persistent rows are untouched
    assert bt.row("short").tolist() == [8]
    empty, no_lens = bt.gather([])
    assert empty.shape == (0, 0) and no_lens.shape == (0,)
    with pytest.raises(KeyError):
        bt.gather(["nobody"])


def test_random_operations_match_lists():
    rng = random.Random(7)
    bt = BlockTable(rows=1, width=1)
    model: dict[str, list[int]] = {}
    for _ in range(3000):
        rid = f"r{rng.randrange(40)}"
        op = rng.random()
        if op < 0.7:  # mostly a block or a few; now and then a long prompt's worth
            size = rng.randrange(0, 9) if op < 0.6 else rng.randrange(0, 40)
            ids = [rng.randrange(1, 10_000) for _ in range(size)]
            bt.append(rid, ids)
            model.setdefault(rid, []).extend(ids)
        elif op < 0.85:
            bt.drop(rid)
            model.pop(rid, None)
        assert bt.row_of.keys() == model.keys()
        for r, ids in model.items():
            assert bt.row(r).tolist() == ids
        past = np.arange(bt.table.shape[1])[None, :] >= bt.lens[:, None]
        assert not bt.table[past].any()
        if model:
            some = rng.sample(sorted(model), rng.randint(1, len(model)))
            table, lens = bt.gather(some)
            width = max(len(model[r]) for r in some)
            assert table.shape == (len(some), width)
            assert table.tolist() == [model[r] + [0] * (width - len(model[r])) for r in some]
            assert lens.tolist() == [len(model[r]) for r in some]
    assert len(set(bt.row_of.values())) == len(bt.row_of)  # no row shared


def test_layout_from_array_derives_lists_and_back():
    table = np.array([[3, 4, 0], [5, 6, 7]], dtype=np.int32)
    layout = BatchLayout([1, 2], [20, 40], None, torch.arange(3), 1, 16,
                         block_table=table, table_lens=np.array([2, 3], dtype=np.int32))
    assert layout.block_tables == [[3, 4], [5, 6, 7]]
    assert layout.block_table is table
    from_lists = BatchLayout([1, 2], [20, 40], [[3, 4], [5, 6, 7]], torch.arange(3), 1, 16)
    assert from_lists.block_table.tolist() == table.tolist()
    assert from_lists.block_table.dtype == np.int32
    assert from_lists.table_lens.tolist() == [2, 3]
    from_lists.block_tables = [[9]]  # replacing the lists re-derives the array
    assert from_lists.block_table.tolist() == [[9]]
    with pytest.raises(ValueError, match="needs block_tables"):
        BatchLayout([1], [1], None, torch.arange(1), 1, 16, block_table=table)
