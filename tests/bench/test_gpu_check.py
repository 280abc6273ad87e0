"""bench/gpu_check.py: its CPU dry run end to end (a real subprocess, with `gguf` and
`platformdirs` made unimportable as on the GPU image), and its verdicts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import gpu_e2e  # noqa: E402
import gpu_kernels  # noqa: E402


def _numbers(node, path=""):
    """Every int/float in a JSON tree, with its path."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


# what the GPU image lacks (bench/README.md): a `sitecustomize` on PYTHONPATH puts None in
# `sys.modules` for each, in the check and in the pytest processes it starts
IMAGE_LACKS = ("gguf", "platformdirs")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "result.json"
    site = tmp_path_factory.mktemp("image-site")
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor name in {IMAGE_LACKS!r}:\n    sys.modules[name] = None\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          # platformdirs ships a pytest plugin, which the image lacks with
                          # it: pytest's plugin scan cannot read a module blocked this way
                          env={**os.environ, "PYTHONPATH": path,
                               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), str(out), time.monotonic() - t0


def test_dry_run_writes_every_section_with_finite_numbers(dry_run):
    report, out, _ = dry_run
    assert report["dry_run"] is True
    assert report["command"] == f"python bench/gpu_check.py --dry-run --out {out}"
    env = report["env"]
    assert env["torch"] and env["triton"] and env["device"] == "cpu"
    assert env["absent_packages"] == list(IMAGE_LACKS)  # as on the GPU image
    for name in ("copy", "kernels", "e2e", "tests"):
        assert report[name]["status"] == "ok", (name, report[name].get("traceback"))
    bad = [(p, v) for p, v in _numbers(report) if not math.isfinite(v)]
    assert not bad, bad
    assert report["copy"]["gb_per_s"] > 0


def test_dry_run_kernels_match_their_references(dry_run):
    results = dry_run[0]["kernels"]["results"]
    expected = {"paged_attention_mixed", "paged_attention_mixed_window", "add_rms_norm",
                "rms_norm_no_residual_add", "silu_mul", "rope", "reshape_and_cache"}
    assert expected <= set(results)
    decode = {k for k in results if k.startswith(("decode_batch_splits", "decode_small_splits"))}
    assert "decode_batch_splits1" in decode and "decode_small_splits1" in decode
    assert any(results[k]["num_splits"] > 1 for k in decode)  # split-KV ran too
    for name, r in results.items():
        assert r["ok"] and 0 <= r["rel_err"] <= r["tol"], (name, r)
    assert results["reshape_and_cache"]["rel_err"] == 0.0  # a cache write is exact
    for name in ("paged_attention_mixed", "decode_batch_splits1", "silu_mul"):
        r = results[name]
        assert r["median_ms"] > 0 and r["sets"] >= 2 and r["copy_fraction"] > 0


def test_dry_run_e2e_runs_each_engine_and_every_sampling_mode(dry_run):
    e2e = dry_run[0]["e2e"]
    runs = e2e["runs"]
    assert set(runs) == set(gpu_e2e.ENGINES)
    assert runs["torch_eager"]["attention_backend"] == "torch"
    assert runs["triton_graphs"]["attention_backend"] == "triton"
    # on the CPU the "graphs" engine runs the static-buffer decode path, the eager ones none
    assert runs["triton_graphs"]["graphs"]["steps_by_size"]
    assert runs["triton_eager"]["graphs"] is None
    for r in runs.values():
        d = r["decode"]
        assert d["tokens"] == d["steps"] * d["batch"] and d["tokens_per_s"] > 0
        assert r["prefill"]["tokens_per_s"] > 0
    assert set(e2e["ratios"]) == {"decode_triton_over_torch", "decode_graphs_over_eager",
                                  "prefill_triton_over_torch", "prefill_graphs_over_eager"}
    assert e2e["model"]["num_layers"] == gpu_e2e.E2E_DRY.layers
    sampling = e2e["sampling"]
    assert sampling["ok"], sampling
    assert {"greedy", "seeded", "top_p", "top_k", "min_p", "penalties", "logprobs",
            "n2"} <= set(sampling["modes"])
    assert sampling["modes"]["seeded"]["repeat_equal"]


def test_dry_run_collects_the_test_files_and_leaves_targets_open(dry_run):
    report, _, seconds = dry_run
    tests = report["tests"]
    assert tests["mode"] == "collect-only" and tests["rc"] == 0
    present = {f: v for f, v in tests["files"].items() if v["status"] != "missing"}
    assert "tests/engine/test_hf_parity.py" in present
    assert all(v["status"] == "collected" and v["collected"] > 0 for v in present.values())
    for t in report["targets"].values():
        assert t["verdict"] == "n/a (dry run)"
    assert report["seconds"] < seconds


def test_verdicts_read_the_measured_numbers():
    def report(frac, speed):
        return {"kernels": {"results": {
                    "decode_batch_splits1": {"copy_fraction": 0.1, "chosen_by_heuristic": False},
                    "decode_batch_splits2": {"copy_fraction": frac,
                                             "chosen_by_heuristic": True}}},
                "e2e": {"ratios": {"decode_triton_over_torch": speed}}}

    t = gpu_check.targets(report(0.71, 2.9), dry=False)
    assert t["decode_attention_copy_fraction"] == {"value": 0.71, "target": 0.7,
                                                   "verdict": "PASS"}
    assert t["triton_over_torch_decode_batch64"]["verdict"] == "FAIL"
    t = gpu_check.targets(report(0.69, 3.0), dry=False)
    assert [v["verdict"] for v in t.values()] == ["FAIL", "PASS"]
    t = gpu_check.targets({}, dry=False)
    assert [v["verdict"] for v in t.values()] == ["n/a (not measured)"] * 2


def test_rotation_exceeds_l2_and_unwritten_outputs_count_as_infinite_error():
    import torch

    assert gpu_kernels.num_sets(10 << 20, 50 << 20) == 10  # 100 MiB >= 2 x L2
    assert gpu_kernels.num_sets(1 << 30, 50 << 20) == 2
    assert gpu_kernels.num_sets(1, 50 << 20) == 32  # capped
    ref = torch.tensor([1.0, -2.0, 4.0])
    assert gpu_kernels.rel_err(ref + torch.tensor([0.0, 0.0, 0.04]), ref) == pytest.approx(0.01)
    assert gpu_kernels.rel_err(torch.tensor([1.0, math.nan, 4.0]), ref) == math.inf


def test_a_real_run_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: a real run would start")
    assert gpu_check.main([]) == 2


def test_a_real_runs_pytest_step_counts_outcomes_per_file(tmp_path, monkeypatch):
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import os, pytest\n"
        "def test_interpreter_is_off():\n"
        "    assert 'TRITON_INTERPRET' not in os.environ\n"  # the kernels must compile for CUDA
        "def test_ok():\n    pass\n"
        "def test_broken():\n    assert 1 == 2, 'boom'\n"
        # skips as a GPU file's tests do where their dependency is absent (not a marker)
        "def test_needs_a_missing_module():\n"
        "    pytest.importorskip('tandem_no_such_module')\n")
    monkeypatch.setattr(gpu_check, "TEST_FILES", (str(tests), "tests/engine/test_nothing.py"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = gpu_check.run_tests(dry=False, cap_s=120)
    got = res["files"][str(tests)]
    assert (got["status"], got["passed"], got["failed"], got["skipped"]) == ("failed", 2, 1, 1)
    assert "test_broken" in got["tail"] and "boom" in got["tail"]
    assert res["files"]["tests/engine/test_nothing.py"] == {"status": "missing"}
    assert (res["passed"], res["failed"]) == (2, 1)


def test_dry_run_times_each_step_and_sweeps_decode_attention(dry_run):
    report = dry_run[0]
    e2e = report["e2e"]
    for name, r in e2e["runs"].items():
        for point in ("decode", "prefill"):
            t = r[point]["step_time"]
            assert t["timer"].startswith("wall_clock") and t["steps"] >= 1 and t["forwards"]
            assert 0 < t["device_ms_total"] <= t["wall_ms_total"], (name, point, t)
            assert 0 <= t["host_share"] < 1
        decode = r["decode"]["step_time"]
        assert decode["steps"] == r["decode"]["steps"]
        # the profiled steps ran; the CPU has no kernel time to report
        assert decode["kernel_steps"] == 1 and decode["kernel_ms_per_step"] is None
    assert set(e2e["device_ratios"]) == set(e2e["ratios"]) and e2e["kernel_ratios"] == {}
    sweep = report["sweep"]
    assert sweep["status"] == "ok" and sweep["all_ok"], sweep.get("traceback")
    (bucket,) = sweep["buckets"].values()
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in bucket["runs"])
    assert bucket["best"] in bucket["runs"] and bucket["default"] in bucket["runs"]
    assert sweep["recommended"]["how"].startswith("DECODE_CONFIG = DecodeConfig(")
    stages = sweep["pipelining"]["stages"]
    assert not stages["3"]["double_buffered"] and stages["5"]["double_buffered"]
    assert list(report).index("sweep") > list(report).index("tests")  # the one a cut loses


def test_the_tests_section_says_so_without_pytest(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest" else real(name, *a))
    assert gpu_check.run_tests(dry=False, cap_s=60) == {
        "mode": "skipped", "reason": "pytest is not installed here", "files": {}}
