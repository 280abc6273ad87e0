"""The GPU check's decode-attention sweep, its launch config and its per-step device clock."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402,F401  (settles TRITON_INTERPRET before the kernels import)
import gpu_e2e  # noqa: E402
import gpu_kernels as gk  # noqa: E402
import gpu_sweep  # noqa: E402
from tandem.engine.kernels import triton_attention as ta  # noqa: E402

CPU = torch.device("cpu")


def test_decode_launch_parameters_come_from_one_config(monkeypatch):
    assert ta.DecodeConfig(block_n=64, num_warps=4, num_stages=3) == ta.DECODE_CONFIG
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    monkeypatch.setattr(ta, "_decode_kernel", Recorder())
    q = torch.zeros(1, 4, 32)
    cache = torch.zeros(2, 2, 16, 32)
    args = (q, cache, cache, torch.zeros_like(q), torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))
    ta.paged_decode_attention(*args, scale=1.0)
    monkeypatch.setattr(ta, "DECODE_CONFIG", ta.DecodeConfig(128, 8, 5))
    ta.paged_decode_attention(*args, scale=1.0)
    ta.paged_decode_attention(*args, scale=1.0, config=ta.DecodeConfig(16, 2, 4))
    got = [(kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) for kw in launches]
    assert got == [(64, 4, 3), (128, 8, 5), (16, 2, 4)]
    for bad in ({"block_n": 96}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ValueError):
            ta.DecodeConfig(**bad)


def test_a_config_other_than_the_default_computes_the_same_attention():
    sets = gk._paged_sets([[(30, 1), (7, 1), (52, 1)]], gk.DRY, torch.float32, CPU,
                          random.Random(0))
    s = sets[0]
    scale = gk.DRY.head_dim ** -0.5
    ref = gk.ref_attention(s, scale)
    for cfg, splits in ((ta.DecodeConfig(16, 4, 5), 1), (ta.DecodeConfig(128, 8, 5), 2)):
        s.out.fill_(math.nan)
        ta.paged_decode_attention(s.q, s.k_cache, s.v_cache, s.out, s.block_tables, s.seq_lens,
                                  scale=scale, num_splits=splits, config=cfg)
        assert gk.rel_err(s.out, ref) < 1e-4, (cfg, splits)


def test_the_sweep_checks_each_launch_before_timing_it_and_recommends_one(monkeypatch):
    real = ta.paged_decode_attention

    def five_stages_wrong(*args, config=None, **kw):  # a launch config that miscomputes
        real(*args, config=config, **kw)
        if config is not None and config.num_stages == 5:
            args[3].mul_(2)

    monkeypatch.setattr(ta, "paged_decode_attention", five_stages_wrong)
    res = gpu_sweep.decode_sweep(gpu_sweep.SWEEP_DRY, torch.bfloat16, CPU, gk.Timer(CPU),
                                 10.0, 4, 50 << 20)
    (bucket,) = res["buckets"].values()
    runs = bucket["runs"]
    assert len(runs) == 2 * len(gpu_sweep.SWEEP_DRY.splits)
    for r in runs:
        if r["num_stages"] == 5:  # wrong: never timed, never best
            assert r["status"] == "wrong" and not r["ok"] and "median_ms" not in r
        else:
            assert r["status"] == "ok" and r["rel_err"] <= bucket["tol"] and r["median_ms"] > 0
    assert not res["all_ok"]
    assert bucket["best"]["num_stages"] == 3
    assert bucket["default"] == next(r for r in runs if r["num_splits"] == 1)
    rec = res["recommended"]
    assert rec["decode_config"] == {"num_stages": 3, "num_warps": 4, "block_n": 64}
    assert rec["how"] == ("DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=4, "
                          "num_stages=3) in src/tandem/engine/kernels/triton_attention.py")
    assert rec["speedup_over_default"] == 1.0


def test_recommend_takes_the_lowest_geometric_mean_over_the_contexts():
    def run(stages, warps, block_n, splits, ms):
        return {"num_stages": stages, "num_warps": warps, "block_n": block_n,
                "num_splits": splits, "median_ms": ms}

    # A wins 1k by 2x, B wins 8k by 1.5x and is never worse than 1.2x: geomeans A 1.5, B 1.1
    buckets = {"1024": [run(3, 4, 64, 1, 1.0), run(5, 8, 128, 1, 1.2), run(5, 8, 128, 2, 2.0)],
               "8192": [run(3, 4, 64, 4, 2.25), run(5, 8, 128, 1, 9.0),
                        run(5, 8, 128, 4, 1.0)]}
    b = {ctx: {"best": min(runs, key=lambda r: r["median_ms"]), "runs": runs,
               "heuristic_splits": 1} for ctx, runs in buckets.items()}
    rec = gpu_sweep.recommend(b, {"num_stages": 3, "num_warps": 4, "block_n": 64})
    assert rec["decode_config"] == {"num_stages": 5, "num_warps": 8, "block_n": 128}
    assert rec["geomean_over_best"] == pytest.approx(math.sqrt(1.2))
    assert rec["default_geomean_over_best"] == pytest.approx(1.5)
    assert rec["best_splits"] == {"1024": 1, "8192": 4}


def test_decode_kernel_pipelining_at_3_stages_is_single_buffered_and_at_5_double():
    res = gpu_sweep.pipelining((3, 4, 5), CPU)
    assert res["target"] == "cuda 90"
    stages = res["stages"]
    for ns in ("3", "4"):
        assert stages[ns]["kv_tile_buffers"] == [1, 1] and not stages[ns]["double_buffered"]
        assert set(stages[ns]["async_wait_nums"]) == {0}  # waits for every copy
    assert stages["5"]["kv_tile_buffers"] == [2, 2] and stages["5"]["double_buffered"]
    assert max(stages["5"]["async_wait_nums"]) > 0
    assert "num_stages 5: double-buffered" in res["finding"]


class _Graph:
    def __init__(self, model):
        self.model = model

    def replay(self):
        time.sleep(0.002)


class _Runner:
    def __init__(self):
        self.model = torch.nn.Linear(4, 4)
        graph = _Graph(self.model)
        self.graphs = type("G", (), {"graphs": {8: graph}})()


def test_forward_clock_splits_each_step_into_forward_and_host_time():
    runner = _Runner()
    clock = gpu_e2e.ForwardClock(runner, CPU)
    x = torch.zeros(1, 4)

    def step_eager():
        time.sleep(0.004)  # host work
        runner.model(x)

    def step_graph():
        runner.graphs.graphs[8].replay()
        time.sleep(0.004)

    clock.step(step_eager)
    clock.step(step_graph)
    clock.step(lambda: None)  # a step with no forward
    clock.close()
    runner.model(x)  # after close: neither hook nor wrapper records
    runner.graphs.graphs[8].replay()
    assert "replay" not in vars(runner.graphs.graphs[8])
    t = clock.summary()
    assert t["timer"].startswith("wall_clock") and t["steps"] == 3 and t["forwards"] == 2
    assert t["device_ms_total"] >= 2.0 and t["wall_ms_total"] >= 8.0 + t["device_ms_total"]
    assert 0.5 < t["host_share"] < 1
    assert t["device_ms_per_step"] <= t["wall_ms_per_step"]


def test_the_sweep_hands_over_each_finished_context():
    sz = dataclasses.replace(gpu_sweep.SWEEP_DRY, contexts=(24, 40), splits=(1,))
    seen = []
    res = gpu_sweep.decode_sweep(sz, torch.bfloat16, CPU, gk.Timer(CPU), 10.0, 4, 50 << 20,
                                 lambda partial: seen.append(sorted(partial["buckets"])))
    assert seen == [["24"], ["24", "40"]] and sorted(res["buckets"]) == ["24", "40"]
    assert res["buckets"]["24"]["context"] == [19, 24]
    assert set(res["recommended"]["best_splits"]) == {"24", "40"}


def test_a_pipelining_report_that_cannot_compile_says_why_instead_of_raising(monkeypatch):
    monkeypatch.setattr(gpu_sweep, "__file__", str(REPO / "bench" / "no_such_script.py"))
    res = gpu_sweep.pipelining((3,), CPU)
    assert set(res) == {"error"} and "compiling the decode kernel failed" in res["error"]
