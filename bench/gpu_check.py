"""One-shot GPU check of the engine (issue 21): exactness, kernels, bandwidth, throughput.

    python bench/gpu_check.py                    # on a CUDA GPU (<= ~6 min on an H200)
    python bench/gpu_check.py --dry-run          # anywhere: the same code paths, tiny sizes

Sections, in order (each under a time cap; the JSON is rewritten after each one, so a run cut
short keeps what it measured):
* `copy`: the device-to-device copy rate, 2 x bytes / median time of `dst.copy_(src)`.
* `kernels`: every Triton kernel (`engine/kernels`) against a torch reference in bf16 at
  Llama-8B-like sizes (32 query / 8 KV heads, head dim 128, block 16, contexts 1k-8k), timed
  with CUDA events (median, rotating input sets larger than L2); decode attention's KV bytes
  read per second as a fraction of the copy rate (`bench/gpu_kernels.py`).
* `quant`: the quantized matmuls (`kernels/triton_quant.py` INT8 / INT4, FP8 W8A8 through
  `torch._scaled_mm` and FP8 weight-only) against float64 references of their dequantized
  weights and timed beside `torch.matmul` on bf16 weights, at SmolLM2's gate/up, down and
  LM-head shapes and 4096 x 4096, M = 1 / 16 / 256: achieved weight GB/s and its share of
  the copy rate (`gpu_kernels.quant_checks`).
* `e2e`: a random-weight ~1B Llama (hidden 2048, 16 layers, 32/8 heads, vocab 32000) written
  as an HF directory and loaded through `LLM(model=dir)`: batch-64 decode and a
  prefill-heavy point, for the Triton backend with CUDA graphs, without (`enforce_eager`),
  and the torch backend; tokens/s and the ratios, and per step the forwards' device time
  (CUDA events) beside the wall time: the host share, and the ratios on device time alone
  (`bench/gpu_e2e.py`).
* `sampling`: every sampling mode in one mixed batch on that engine, run twice (seeded and
  greedy rows must repeat), with the output invariants checked.
* `tests`: the exactness test files under pytest on CUDA (TRITON_INTERPRET unset); with
  `--dry-run`, `--collect-only`; skipped, saying so, where pytest is not installed.
* `sweep`: decode attention's launch parameters (`num_stages` 3/5, `num_warps` 4/8, 64/128
  keys per tile, KV splits 1/2/4) at batch 64 over contexts 1k-8k, each checked against the
  reference before it is timed; the best per context, the recommended `DECODE_CONFIG`, and
  how many buffers the pipeliner gives the K/V tiles per `num_stages` (`bench/gpu_sweep.py`);
  last, so the outer timeout cuts it rather than the tests (each context saved as it ends).

Targets (PASS/FAIL; "n/a (dry run)" with `--dry-run`): decode attention >= 70 % of the copy
rate; the Triton backend >= 3x the torch backend end to end at batch 64. Output:
`bench/results/gpu_check-<date>.json` (a temp file with `--dry-run`; `--out` overrides).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "src"))  # this checkout, also where tandem is not installed

import torch  # noqa: E402

# @triton.jit reads TRITON_INTERPRET when a kernel module is imported: settle it first.
if torch.cuda.is_available():
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

import gpu_e2e  # noqa: E402
import gpu_kernels as gk  # noqa: E402
import gpu_sweep  # noqa: E402

# in priority order (the time cap skips the tail); a missing file is reported as missing
TEST_FILES = ("tests/engine/test_hf_parity.py", "tests/engine/test_triton_parity.py",
              "tests/engine/test_triton_backend.py", "tests/engine/test_sampler_device.py",
              "tests/engine/test_triton_attention.py", "tests/engine/test_triton_ops.py",
              "tests/engine/test_cuda_graphs.py", "tests/engine/test_memory.py",
              "tests/engine/test_devices.py", "tests/engine/test_triton_quant.py",
              "tests/engine/test_fp8.py")
DECODE_TARGET, SPEEDUP_TARGET = 0.70, 3.0
# packages the device image may lack: the engine needs none of them to serve an HF directory,
# the tests section needs pytest and transformers (reported in env.absent_packages)
OPTIONAL_PACKAGES = ("gguf", "platformdirs", "pytest", "transformers")
L2_FALLBACK = 50 << 20


def environment(device: torch.device) -> dict:
    import triton

    env = {"python": platform.python_version(), "executable": sys.executable,
           "platform": platform.platform(), "torch": torch.__version__,
           "triton": triton.__version__,
           "cuda": torch.version.cuda, "device": str(device), "device_name": platform.processor()
           or platform.machine(), "l2_bytes": L2_FALLBACK, "num_sms": os.cpu_count() or 1,
           "absent_packages": [n for n in OPTIONAL_PACKAGES if importlib.util.find_spec(n) is None]}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, l2_bytes=int(getattr(props, "L2_cache_size", 0))
                   or L2_FALLBACK, num_sms=props.multi_processor_count,
                   total_memory=props.total_memory, capability=[props.major, props.minor])
    try:
        env["git_rev"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                                        capture_output=True, timeout=10).stdout.strip()
        env["git_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, text=True,
            capture_output=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        env["git_rev"] = None
    return env


# ----------------------------------------------------------------------------- pytest


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_SUMMARY = re.compile(r"\d+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)"
                      r".* in [\d.]+s")


def _test_env(dry: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if not dry:
        env.pop("TRITON_INTERPRET", None)
    return env


# the repository's pytest configuration (markers, addopts) for any file given
_PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
           str(REPO), "-c", str(REPO / "pyproject.toml"))


def _outcomes(output: str) -> dict[str, int]:
    """Counts from pytest's final summary line ("2 passed, 1 failed, 1 skipped in 0.3s")."""
    for line in reversed(output.splitlines()):
        if _SUMMARY.search(line):
            return {k.rstrip("s") if k.startswith("error") else k: int(n)
                    for n, k in _COUNT.findall(line)}
    return {}


def start_collect() -> subprocess.Popen:
    """`pytest --collect-only` over the test files, started now (a dry run overlaps it with
    the other sections) and read by `run_tests`."""
    present = [f for f in TEST_FILES if (REPO / f).is_file()]
    return subprocess.Popen([*_PYTEST, "--collect-only", *present], cwd=REPO,
                            env=_test_env(True), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def run_tests(dry: bool, cap_s: float, collecting: subprocess.Popen | None = None) -> dict:
    """The exactness test files under pytest in subprocesses (CUDA present, TRITON_INTERPRET
    unset): pass/fail counts per file. Dry run: `--collect-only`, test counts per file."""
    if importlib.util.find_spec("pytest") is None:
        if collecting is not None:
            collecting.kill()
            collecting.wait()
        return {"mode": "skipped", "reason": "pytest is not installed here", "files": {}}
    env = _test_env(dry)
    files: dict[str, dict] = {f: {"status": "missing"} for f in TEST_FILES
                              if not (REPO / f).is_file()}
    present = [f for f in TEST_FILES if (REPO / f).is_file()]
    base = list(_PYTEST)
    deadline = time.perf_counter() + cap_s
    if dry:
        proc = collecting or start_collect()
        try:
            stdout, _ = proc.communicate(timeout=cap_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        for f in present:
            n = sum(1 for line in stdout.splitlines() if line.startswith(f + "::"))
            files[f] = {"status": "collected" if proc.returncode == 0 else "error",
                        "collected": n}
        return {"mode": "collect-only", "rc": proc.returncode, "files": files,
                "tail": stdout[-1500:] if proc.returncode else ""}
    for f in present:
        left = deadline - time.perf_counter()
        if left < 5:
            files[f] = {"status": "skipped (time cap)"}
            continue
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([*base, "-rfE", f], cwd=REPO, env=env, text=True,
                                  capture_output=True, timeout=left)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or b""  # bytes even under text=True
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            files[f] = {"status": "timeout", "seconds": time.perf_counter() - t0,
                        "tail": out[-1500:]}
            continue
        counts = _outcomes(proc.stdout)
        files[f] = {"status": "passed" if proc.returncode == 0 else "failed",
                    "rc": proc.returncode, "seconds": time.perf_counter() - t0, **counts,
                    "tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]}
    return {"mode": "run", "files": files,
            "passed": sum(v.get("passed", 0) for v in files.values()),
            "failed": sum(v.get("failed", 0) + v.get("error", 0) for v in files.values())}


# ----------------------------------------------------------------------------- driver


def targets(report: dict, dry: bool) -> dict:
    """PASS/FAIL of the two targets from what the sections measured."""
    decode = report.get("kernels", {}).get("results", {})
    chosen = [v for k, v in decode.items() if k.startswith("decode_batch")
              and v.get("chosen_by_heuristic")]
    frac = chosen[0].get("copy_fraction") if chosen else None
    speed = report.get("e2e", {}).get("ratios", {}).get("decode_triton_over_torch")

    def verdict(value: float | None, target: float) -> str:
        if dry:
            return "n/a (dry run)"
        return "n/a (not measured)" if value is None else "PASS" if value >= target else "FAIL"

    return {"decode_attention_copy_fraction": {"value": frac, "target": DECODE_TARGET,
                                               "verdict": verdict(frac, DECODE_TARGET)},
            "triton_over_torch_decode_batch64": {"value": speed, "target": SPEEDUP_TARGET,
                                                 "verdict": verdict(speed, SPEEDUP_TARGET)}}


def section(report: dict, name: str, out: Path, fn: Callable[[], dict]) -> None:
    """Run one section into report[name] (its error recorded, not raised); save the JSON."""
    t0 = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        report[name] = {"status": "ok", **fn()}
    except Exception as exc:  # a broken section must not lose the others
        report[name] = {**report.get(name, {}), "status": "error",
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-4000:]}
    report[name]["seconds"] = time.perf_counter() - t0
    gpu_e2e.free_memory()  # what a section cached must not shrink the next one's GPU
    print(f"[gpu_check] {name}: {report[name]['status']} ({report[name]['seconds']:.1f}s)",
          flush=True)
    out.write_text(json.dumps(report, indent=1, default=str, allow_nan=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny sizes on whatever device there is (the CPU: Triton interpreted)")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/gpu_check-"
                    "<date>.json; a temp file with --dry-run)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip "
                    "(copy,kernels,quant,e2e,tests,sweep)")
    ap.add_argument("--tests-cap", type=float, default=150.0, help="seconds for pytest")
    ap.add_argument("--sweep-cap", type=float, help="seconds for the decode sweep's timed "
                    f"launches (default {gpu_sweep.SWEEP_REAL.cap_s:g}; a dry run "
                    f"{gpu_sweep.SWEEP_DRY.cap_s:g})")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device here: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    date = dt.datetime.now(dt.UTC)
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_check-")) / "gpu_check.json"
                       if args.dry_run else
                       REPO / "bench" / "results" / f"gpu_check-{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    ksz, esz = (gk.DRY, gpu_e2e.E2E_DRY) if args.dry_run else (gk.REAL, gpu_e2e.E2E_REAL)
    dtype = torch.bfloat16
    t_start = time.perf_counter()
    report: dict = {"benchmark": "gpu_check", "date": date.isoformat(timespec="seconds"),
                    "dry_run": args.dry_run,
                    "command": " ".join(["python", "bench/gpu_check.py", *(argv or sys.argv[1:])]),
                    "env": environment(device)}
    env = report["env"]
    # a dry run's collection runs beside the other sections; a real run's tests after them
    collecting = start_collect() if args.dry_run and "tests" not in skip else None
    timer = gk.Timer(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # references in true float32
    if "copy" not in skip:
        section(report, "copy", out, lambda: gk.copy_bandwidth(
            device, (1 << 30) if cuda and not args.dry_run else 8 << 20, timer,
            ksz.iters))
    copy_gbps = report.get("copy", {}).get("gb_per_s") or math.nan
    if "kernels" not in skip:
        def kernels() -> dict:
            from tandem.engine.kernels import triton_unavailable_reason

            reason = triton_unavailable_reason(device)
            if reason:
                raise RuntimeError(reason)
            res = gk.attention_checks(ksz, dtype, device, timer, copy_gbps, env["num_sms"],
                                      env["l2_bytes"])
            res |= gk.elementwise_checks(ksz, dtype, device, timer, copy_gbps,
                                         env["l2_bytes"])
            return {"dtype": "bfloat16", "sizes": dataclasses.asdict(ksz), "results": res,
                    "all_ok": all(r["ok"] for r in res.values())}
        section(report, "kernels", out, kernels)
    if "quant" not in skip:
        def quant() -> dict:
            from tandem.engine.kernels import triton_unavailable_reason

            reason = triton_unavailable_reason(device)
            if reason:
                raise RuntimeError(reason)
            qsz = gk.QUANT_DRY if args.dry_run else gk.QUANT_REAL
            res = gk.quant_checks(qsz, dtype, device, timer, copy_gbps, env["l2_bytes"])
            return {"dtype": "bfloat16", "sizes": dataclasses.asdict(qsz), "results": res,
                    "all_ok": all(r["ok"] for r in res.values())}
        section(report, "quant", out, quant)
    if "e2e" not in skip:
        with tempfile.TemporaryDirectory(prefix="gpu_check-model-") as work:
            partial: dict = {"sizes": dataclasses.asdict(esz)}
            report["e2e"] = partial
            section(report, "e2e", out, lambda: gpu_e2e.e2e(esz, device, Path(work),
                                                                  partial))
    if "tests" not in skip:
        section(report, "tests", out, lambda: run_tests(args.dry_run, args.tests_cap,
                                                        collecting))
    if "sweep" not in skip:  # last: the outer timeout may cut it; each bucket is saved
        def sweep() -> dict:
            from tandem.engine.kernels import triton_unavailable_reason

            reason = triton_unavailable_reason(device)
            if reason:
                raise RuntimeError(reason)
            ssz = gpu_sweep.SWEEP_DRY if args.dry_run else gpu_sweep.SWEEP_REAL
            if args.sweep_cap is not None:
                ssz = dataclasses.replace(ssz, cap_s=args.sweep_cap)
            res = {"pipelining": gpu_sweep.pipelining(ssz.stages, device)}

            def save(partial: dict) -> None:
                report["sweep"] = {"status": "partial", **res, **partial}
                out.write_text(json.dumps(report, indent=1, default=str, allow_nan=True))

            save({})
            return res | gpu_sweep.decode_sweep(ssz, dtype, device, timer, copy_gbps,
                                                env["num_sms"], env["l2_bytes"], save)
        section(report, "sweep", out, sweep)
    report["targets"] = targets(report, args.dry_run)
    report["seconds"] = time.perf_counter() - t_start
    out.write_text(json.dumps(report, indent=1, default=str, allow_nan=True))
    summary(report)
    print(f"wrote {out}")
    return 0


def summary(report: dict) -> None:
    print(f"device {report['env']['device_name']}  torch {report['env']['torch']}  "
          f"triton {report['env']['triton']}")
    copy = report.get("copy", {})
    if "gb_per_s" in copy:
        print(f"copy: {copy['gb_per_s']:.0f} GB/s")
    for name, r in report.get("kernels", {}).get("results", {}).items():
        timing = f"{r['median_ms']:.3f} ms" if "median_ms" in r else "(check only)"
        frac = f"  {r['copy_fraction']:.0%} of copy" if "copy_fraction" in r else ""
        print(f"  {name:32s} err {r['rel_err']:.1e} {'ok ' if r['ok'] else 'BAD'} "
              f"{timing}{frac}")
    for name, r in report.get("quant", {}).get("results", {}).items():
        speed = f"  {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""
        print(f"  {name:40s} err {r['rel_err']:.1e} {'ok ' if r['ok'] else 'BAD'} "
              f"{r['median_ms']:.3f} ms  {r['weight_gb_per_s']:.0f} GB/s "
              f"({r['copy_fraction']:.0%} of copy){speed}")
    for name, r in report.get("e2e", {}).get("runs", {}).items():
        print(f"  {name:14s} decode {r['decode']['tokens_per_s']:9.0f} tok/s  "
              f"prefill {r['prefill']['tokens_per_s']:9.0f} tok/s")
    for name, r in report.get("e2e", {}).get("runs", {}).items():
        for point in ("decode", "prefill"):
            t = r.get(point, {}).get("step_time", {})
            if t.get("steps"):
                kernels = t.get("kernel_ms_per_step")
                print(f"  {name:14s} {point:7s} wall {t['wall_ms_per_step']:8.2f} ms/step  "
                      f"forward on device {t['device_ms_per_step']:8.2f} ms/step  "
                      f"host share {t['host_share']:.0%}"
                      + (f"  kernels {kernels:.2f} ms/step" if kernels else ""))
    for k, v in report.get("e2e", {}).get("ratios", {}).items():
        dev = report["e2e"].get("device_ratios", {}).get(k)
        kern = report["e2e"].get("kernel_ratios", {}).get(k)
        print(f"  {k}: {v:.2f}x" + (f"  (device time alone: {dev:.2f}x)" if dev else "")
              + (f"  (kernels alone: {kern:.2f}x)" if kern else ""))
    sweep_summary(report.get("sweep", {}))
    for name, f in report.get("tests", {}).get("files", {}).items():
        print(f"  {name}: {f['status']} {({k: v for k, v in f.items() if k in _COUNTS})}")
    for name, t in report["targets"].items():
        print(f"target {name} >= {t['target']}: {t['value']} -> {t['verdict']}")
    for name in ("copy", "kernels", "quant", "e2e", "tests", "sweep"):
        if report.get(name, {}).get("status") == "error":
            print(f"section {name} FAILED: {report[name]['error']}")


_COUNTS = ("passed", "failed", "skipped", "error", "collected")


def sweep_summary(sweep: dict) -> None:
    """The decode sweep's best launch per context, its recommendation, the pipelining."""
    for ctx, b in sweep.get("buckets", {}).items():
        best, default = b.get("best"), b.get("default") or {}
        if best:
            base = f"  default {default['median_ms']:.3f} ms" if "median_ms" in default else ""
            print(f"  decode sweep ctx {ctx:>5s}: best stages {best['num_stages']} warps "
                  f"{best['num_warps']} block_n {best['block_n']} splits "
                  f"{best['num_splits']} {best['median_ms']:.3f} ms "
                  f"({best['copy_fraction']:.0%} of copy){base}  heuristic splits "
                  f"{b['heuristic_splits']}")
    rec = sweep.get("recommended", {})
    if rec.get("decode_config"):
        speed = rec.get("speedup_over_default")
        print(f"  recommended decode default: {rec['how']}"
              + (f" ({speed:.2f}x the current default)" if speed else ""))
    pipe = sweep.get("pipelining")
    if pipe:
        print(f"  decode pipelining ({pipe.get('target')}, triton {pipe.get('triton')}): "
              f"{pipe.get('finding') or pipe.get('error')}")

if __name__ == "__main__":
    raise SystemExit(main())
