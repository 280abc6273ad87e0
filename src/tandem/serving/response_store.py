"""The worker's store of Responses API responses (`store: true`), for `previous_response_id`
and `GET` / `DELETE /v1/responses/{id}`.

Each entry is one response: its body (the `Response` object as answered) and its
conversation (the chat messages after the instructions: the previous conversation, the
input, the output), which a follow-up request continues. Entries are kept per tenant: a
lookup with another tenant's key finds nothing, exactly like an unknown id. Bounded in
number (`max_entries`, least recently used first out), in time (`ttl_s` since it was stored;
expired entries are dropped on access and whenever one is stored) and in bytes
(`max_bytes`, the entries' JSON size; one larger than that is not stored). In memory only:
a worker's restart forgets them. Not thread-safe: used on the event loop.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.protocol import engine_flags as flags

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object
    conversation: list[dict[str, Any]]  # chat messages, instructions excluded
    stored_at: float
    size: int  # bytes of JSON, for the byte bound


class ResponseStore:
    """`max_entries` 0: nothing is stored (`enabled` is False)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._by_age: deque[tuple[float, tuple[str, str]]] = deque()  # in storing order
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response_id: str, body: dict[str, Any],
            conversation: list[dict[str, Any]]) -> bool:
        """Store a response (replacing one of the same id); False when it is not stored
        (the store is off, or the entry alone is over `max_bytes`)."""
        if not self.enabled:
            return False
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return False
        key = (tenant, response_id)
        self._drop(key)
        entry = StoredResponse(body, conversation, self.clock(), size)
        self._entries[key] = entry
        self._by_age.append((entry.stored_at, key))
        self.bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response `response_id` (now the most recently used), or None:
        unknown, expired, evicted, or another tenant's."""
        self._expire()
        key = (tenant, response_id)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the tenant's response; False when there was none."""
        self._expire()
        return self._drop((tenant, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        ages = self._by_age
        while ages and ages[0][0] <= cutoff:
            stored_at, key = ages.popleft()
            entry = self._entries.get(key)
            if entry is not None and entry.stored_at == stored_at:
                self._drop(key)
        if len(ages) > 2 * len(self._entries) + 64:  # records of entries dropped since
            self._by_age = deque(sorted((e.stored_at, k) for k, e in self._entries.items()))


def _entries(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_responses_store_args(p: argparse.ArgumentParser) -> None:
    """`--responses-store-max` and `--responses-store-ttl` (the worker's flags)."""
    p.add_argument(flags.RESPONSES_STORE_MAX, type=_entries, default=DEFAULT_MAX_ENTRIES,
                   metavar="N",
                   help="keep at most N Responses API responses (store: true) for "
                        "previous_response_id and GET /v1/responses/{id}, least recently "
                        "used out first; 0: store none")
    p.add_argument(flags.RESPONSES_STORE_TTL, type=_ttl, default=DEFAULT_TTL_S,
                   metavar="SECONDS",
                   help="forget a stored response SECONDS after it was stored")
