"""The worker's periodic status line (vLLM's `Avg prompt throughput: ...`), from synthetic
engine snapshots."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from tandem.engine.core import EngineStats
from tandem.serving.stats_logger import StatsLogger, kv_label, log_stats_forever

IDLE = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=64,
                   prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                   prompt_tokens=0, generation_tokens=0, kv_unused_slots=0,
                   in_flight_tokens=0)


def later(s: EngineStats, **changes: int | float) -> EngineStats:
    return dataclasses.replace(s, **changes)


def test_a_loaded_interval_gives_vllms_line():
    log = StatsLogger()
    assert log.observe(IDLE, 100.0) is None  # the first snapshot only starts the clock
    busy = later(IDLE, num_running=3, num_waiting=2, kv_cache_usage=0.2345,
                 prompt_tokens=8124, generation_tokens=960, prefix_cache_queries=400,
                 prefix_cache_hits=100)
    assert log.observe(busy, 110.0) == (
        logging.INFO,
        "Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 23.4%, "
        "Prefix cache hit rate: 25.0%")
    # the next interval counts from the last snapshot: 5 s, 50 more tokens, no lookups
    more = later(busy, generation_tokens=1010, num_waiting=0)
    assert log.observe(more, 115.0) == (
        logging.INFO,
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 23.4%, "
        "Prefix cache hit rate: 0.0%")


def test_idle_logs_one_last_line_then_only_debug():
    log = StatsLogger(kv_label("cuda"))
    log.observe(IDLE, 0.0)
    assert log.observe(IDLE, 10.0)[0] == logging.DEBUG  # idle from the start: quiet
    busy = later(IDLE, num_running=1, generation_tokens=20, prompt_tokens=30)
    assert log.observe(busy, 20.0) == (
        logging.INFO,
        "Avg prompt throughput: 3.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, "
        "Prefix cache hit rate: 0.0%")
    done = later(busy, num_running=0)
    assert log.observe(done, 30.0) == (  # the load ended: one line of zeros, at INFO
        logging.INFO,
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, "
        "Prefix cache hit rate: 0.0%")
    assert log.observe(done, 40.0)[0] == logging.DEBUG
    assert log.observe(done, 50.0)[0] == logging.DEBUG
    # a request waiting (nothing produced yet) is load
    assert log.observe(later(done, num_waiting=1), 60.0)[0] == logging.INFO


def test_kv_label_names_the_gpu_on_cuda_only():
    assert kv_label("cuda") == "GPU KV cache usage"
    assert kv_label("cpu") == "KV cache usage"


def test_the_task_logs_each_interval(caplog: pytest.LogCaptureFixture):
    """The server's task: one record per interval at the level `observe` gives (the idle
    intervals after the first are DEBUG, so not captured at INFO)."""
    snapshots = [IDLE, later(IDLE, num_running=1, generation_tokens=5),
                 later(IDLE, generation_tokens=5)]
    calls = [0]

    def snapshot() -> EngineStats:
        calls[0] += 1
        return snapshots[min(calls[0] - 1, len(snapshots) - 1)]

    async def run() -> None:
        task = asyncio.ensure_future(log_stats_forever(snapshot, "KV cache usage", 0.01,
                                                       clock=lambda: float(calls[0])))
        while calls[0] < 6:
            await asyncio.sleep(0.01)
        task.cancel()

    caplog.set_level(logging.INFO, logger="tandem.serving.stats_logger")
    asyncio.run(run())
    assert [r.getMessage().split(", Running")[0] for r in caplog.records] == [
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s",
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s"]
