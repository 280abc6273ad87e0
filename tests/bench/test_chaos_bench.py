"""bench/chaos.py: its verdicts, and a real CI-size run (a tiny random model; kill -9 of a
decode worker, the prefill worker, a router replica and Redis, nothing restarted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import chaos  # noqa: E402
from tests.engine.utils import make_tiny_model_dir  # noqa: E402

ERROR = {"error": {"message": "m", "type": "server_error", "param": None, "code": 502}}


def test_only_well_formed_openai_errors_are_clean():
    assert chaos.openai_error(ERROR) == "502"
    assert chaos.openai_error({"error": {**ERROR["error"], "code": None}}) == "server_error"
    assert chaos.openai_error({"error": {"message": "m", "type": "x"}}) is None  # no param/code
    assert chaos.openai_error({"error": "boom"}) is None
    assert chaos.openai_error({**ERROR, "choices": []}) is None
    assert chaos.openai_error([ERROR]) is None


def test_judge_compares_each_request_with_the_undisturbed_run():
    ref = [chaos.Outcome(i, "ok", text=f"t{i}", finish="length") for i in range(6)]
    ref.append(chaos.Outcome(6, "hung"))
    got = [chaos.Outcome(0, "ok", text="t0", finish="length"),
           chaos.Outcome(1, "ok", text="tX", finish="length"),
           chaos.Outcome(2, "clean_error", code="502"),
           chaos.Outcome(3, "router_cut"),
           chaos.Outcome(4, "lost", detail="the stream ended without [DONE]"),
           chaos.Outcome(5, "hung"),
           chaos.Outcome(6, "ok", text="t6", finish="length")]
    j = chaos.judge(got, ref)
    assert (j["exact"], j["differing"], j["clean_error"], j["router_cut"], j["lost"],
            j["hung"], j["unreferenced"]) == (1, 1, 1, 1, 1, 1, 1)
    assert j["clean_error_by_code"] == {"502": 1}
    assert [p["index"] for p in j["problems"]] == [1, 4, 5]


def test_migrations_count_only_what_replicas_alive_at_both_readings_saw():
    before = {"router0": {"resumed": 2.0}, "router1": {"resumed": 5.0, "limit": 1.0}}
    after = {"router0": {"resumed": 4.0, "no_worker": 1.0}}  # router1 was killed
    assert chaos.migrated(before, after) == {"resumed": 2.0, "no_worker": 1.0}
    assert chaos.migrated(after, after) == {}


def test_a_quick_chaos_run_loses_nothing_and_leaves_nothing(tmp_path):
    model = tmp_path / "tiny"
    make_tiny_model_dir(model)
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--no-restart",
         "--model", str(model), "--duration", "3", "--rate", "4", "--settle", "20",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.exists(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [p["fault"] for p in report["phases"]] == list(chaos.FAULTS), run.stderr[-3000:]
    assert report["reference_complete"]
    for phase in report["phases"]:
        assert phase["kill"]["target"].rstrip("01") == {"router": "router"}.get(
            phase["fault"], phase["fault"])
        assert (phase["differing"], phase["lost"], phase["hung"]) == (0, 0, 0), phase
        assert phase["exact"] + phase["clean_error"] + phase["router_cut"] == phase["requests"]
        assert all(v > 0 for v in phase["migrations"].values()), phase["migrations"]
    # every gauge of every survivor was exported and read 0: no request, pin, lease,
    # transfer or upstream connection left behind
    readings = report["leaks"]["gauges"]
    assert set(readings) == {"decode1", "router0"}  # the others were killed, not restarted
    assert set(readings["decode1"]) == set(chaos.WORKER_GAUGES)
    assert set(readings["router0"]) == set(chaos.ROUTER_GAUGES)
    assert report["leaks"]["left"] == []
    assert report["nothing_lost"] is True and run.returncode == 0
