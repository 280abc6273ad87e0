"""The resume header a router sends a worker (`protocol.migration.Resume`): it round-trips,
and whatever else a worker receives is refused with a ValueError naming the fault, within
its bounds (ids counted before they are decoded)."""

from __future__ import annotations

import random

import pytest

from tandem.protocol.migration import MAX_RESUME_TOKENS, Resume


def test_random_resumes_round_trip():
    rng = random.Random(42)
    for _ in range(200):
        r = Resume(rng.choice(["cmpl-1", "chatcmpl-a.b:c_d", "x" * 128]),
                   rng.randrange(1 << 40), rng.randrange(10**13),
                   [rng.randrange(1 << 32) for _ in range(rng.randint(1, 300))])
        assert Resume.decode(r.encode()) == r
    r = Resume("a", 1, 0, [7] * MAX_RESUME_TOKENS)  # the most ids
    assert Resume.decode(r.encode()) == r


@pytest.mark.parametrize("bad", [
    "", "a;1;0", "a;1;0;AQAAAA==;x", "a b;1;0;AQAAAA==", ";1;0;AQAAAA==",
    "a;-1;0;AQAAAA==", "a;1;-1;AQAAAA==", "a;\u00b2;0;AQAAAA==", "a;1;\u00b9;AQAAAA==",
    "a;1;" + "9" * 14 + ";AQAAAA==", f"a;{1 << 40};0;AQAAAA==", "a;1;0;!!", "a;1;0;AQA=",
    "a;1;0;", Resume("a", 1, 0, [1] * (MAX_RESUME_TOKENS + 1)).encode(),
    "a;1;0;" + "A" * 10_000_000,
])
def test_malformed_resumes_are_refused(bad):
    with pytest.raises(ValueError):
        Resume.decode(bad)
