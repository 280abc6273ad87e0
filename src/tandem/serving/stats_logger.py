"""vLLM's periodic status line, from the engine's stats snapshots.

Every `--log-stats-interval` seconds (default 10) a worker under load logs one INFO line:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s,
    Running: 8 reqs, Waiting: 2 reqs, KV cache usage: 23.4%, Prefix cache hit rate: 50.0%

Throughputs are the interval's tokens over its length (prompt tokens as the engine counts
them: those of requests that produced a token); Running, Waiting and KV cache usage are the
latest snapshot's (`GPU KV cache usage` on a CUDA device, as vLLM says); the prefix cache hit
rate is the interval's prompt tokens found in the cache over those looked up (0.0% when
none were looked up). An interval counts as loaded when requests are running or waiting or
tokens were produced; the first idle interval after load logs its line (all zeros) too, and
further idle intervals log at DEBUG only, so an idle worker stays quiet, as vLLM's does.
`--disable-log-stats` turns the line off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.core import EngineStats

logger = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 10.0


@dataclass(frozen=True)
class StatsLine:
    """One interval's numbers; `loaded`: there was work in it (module doc)."""

    prompt_throughput: float  # tokens/s
    generation_throughput: float  # tokens/s
    running: int
    waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    prefix_cache_hit_rate: float  # fraction of the interval's looked-up prompt tokens
    loaded: bool

    def text(self, kv_label: str = "KV cache usage") -> str:
        return (f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s, "
                f"Running: {self.running} reqs, Waiting: {self.waiting} reqs, "
                f"{kv_label}: {self.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%")


class StatsLogger:
    """Turns successive `EngineStats` snapshots into status lines. `observe` the first
    snapshot to start; each later call covers the time since the previous one."""

    def __init__(self, kv_label: str = "KV cache usage") -> None:
        self.kv_label = kv_label
        self._last: tuple[EngineStats, float] | None = None
        self._was_loaded = False

    def observe(self, stats: EngineStats, now: float) -> tuple[int, str] | None:
        """(log level, message) for the interval ending `now`, or None for the first
        snapshot. INFO while loaded and for the first idle interval after load, else
        DEBUG."""
        last, self._last = self._last, (stats, now)
        if last is None:
            return None
        line = interval(last[0], stats, now - last[1])
        level = logging.INFO if line.loaded or self._was_loaded else logging.DEBUG
        self._was_loaded = line.loaded
        return level, line.text(self.kv_label)


def interval(before: EngineStats, after: EngineStats, seconds: float) -> StatsLine:
    """The numbers of the interval between two snapshots `seconds` apart."""
    prompt = max(0, after.prompt_tokens - before.prompt_tokens)
    generated = max(0, after.generation_tokens - before.generation_tokens)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    span = max(seconds, 1e-9)
    return StatsLine(prompt_throughput=prompt / span, generation_throughput=generated / span,
                     running=after.num_running, waiting=after.num_waiting,
                     kv_cache_usage=after.kv_cache_usage,
                     prefix_cache_hit_rate=hits / queries if queries > 0 else 0.0,
                     loaded=bool(after.num_running or after.num_waiting or prompt or generated))


def kv_label(device_type: str) -> str:
    """vLLM's words for the KV cache's place: "GPU KV cache usage" on CUDA."""
    return "GPU KV cache usage" if device_type == "cuda" else "KV cache usage"


async def log_stats_forever(snapshot: Callable[[], EngineStats], label: str,
                            interval_s: float = DEFAULT_INTERVAL_S,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """Log a status line every `interval_s` (a task of the server's loop; cancel it)."""
    stats = StatsLogger(label)
    stats.observe(snapshot(), clock())
    while True:
        await asyncio.sleep(interval_s)
        out = stats.observe(snapshot(), clock())
        if out is not None:
            logger.log(*out)
