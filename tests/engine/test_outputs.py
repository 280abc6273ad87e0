"""`TokenPrefix`, the O(1) view of a running request's output ids, reads as the list prefix
it stands for, whatever is appended to the list afterwards (seeded random traces)."""

from __future__ import annotations

import random

import pytest

from tandem.engine.outputs import TokenPrefix


def _read(seq, key):
    try:
        return seq[key]
    except IndexError:
        return IndexError


def test_a_view_reads_as_its_prefix_while_the_list_grows():
    rng = random.Random(0)
    for _ in range(5000):
        ids = [rng.randrange(100) for _ in range(rng.randrange(12))]
        n = rng.randrange(len(ids) + 1)
        view, ref = TokenPrefix(ids, n), ids[:n]
        ids.extend(rng.randrange(100) for _ in range(rng.randrange(1, 4)))
        start, stop = (rng.choice([None, *range(-14, 14)]) for _ in range(2))
        step = rng.choice([None, -3, -1, 1, 2])
        assert view[start:stop:step] == ref[start:stop:step]
        j = rng.randrange(-15, 15)
        assert _read(view, j) == _read(ref, j)
        assert view == ref and ref == view and view == tuple(ref) and list(view) == ref
        assert len(view) == n and repr(view) == repr(ref)
        assert view != ref + [0]


def test_a_view_is_not_hashable_and_not_equal_to_other_types():
    view = TokenPrefix([1, 2], 2)
    with pytest.raises(TypeError):
        hash(view)
    assert view != "12" and view != {1, 2}
