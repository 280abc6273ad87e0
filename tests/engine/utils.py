"""Factories for engine unit tests."""

from __future__ import annotations

import itertools

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 16, request_id: str | None = None,
                 priority: int = 0, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id or f"r{next(_ids)}", list(prompt), sp, max_tokens,
                   priority=priority)
