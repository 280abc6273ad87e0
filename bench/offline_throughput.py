"""Offline throughput: Tandem vs Hugging Face ``generate`` vs vLLM, in one invocation.

    .venv/bin/python bench/offline_throughput.py [--quick] [--engines tandem,hf,vllm]
        [--workloads mixed,shared-prefix] [--out bench/results/offline_throughput-DATE.json]
        [--tandem-baseline PATH] [--quantization MODE[,MODE...]] [--dtypes bfloat16]
        [--vllm-dtypes float32,bfloat16] [--no-roofline]

Every engine gets the same seeded token-id prompts (``bench/workload.py``), greedy decoding,
``ignore_eos`` and exactly ``max_tokens`` new tokens per request, all submitted at once.  Wall
time runs from submission to the last completion (model load excluded).  Each engine runs in
its own subprocess (``bench/runners/*_runner.py``; vLLM from ``.venv-vllm``, made by
``bench/setup_vllm.sh``) that prints one JSON result line.  On the shared-prefix workload
Tandem runs twice, with prefix caching on and off.  ``--tandem-baseline PATH`` adds
``tandem-baseline``: the same runner on another checkout's ``src`` (``git worktree add PATH
REV``), so a change is measured against its parent in the same invocation.
``--quantization int8`` (or a comma list) adds ``tandem-int8``: the same runner with
``quantization="int8"`` beside float32 Tandem (vLLM stays float32: its CPU build has no
weight-only int8/int4 path for this model). ``--dtypes bfloat16`` adds ``tandem-bfloat16``
the same way (``dtype="bfloat16"``), and ``--vllm-dtypes float32,bfloat16`` runs vLLM in
each (``vllm`` is float32, ``vllm-bfloat16``); every Tandem run is compared with every vLLM
run.

Roofline (``bench/roofline.py``, unless ``--no-roofline``): before the runs, the machine's
memory read bandwidth and float32 / bfloat16 / int8 GEMM peaks are measured; each run then
reports its achieved fraction of the weight-bandwidth limit (steps x weight bytes / wall)
and of its compute dtype's matrix peak (computed tokens x 2 x linear parameters / wall),
and Tandem runs their host share (1 - forward seconds / wall: scheduling, input building,
sampling, output processing and anything else outside the model's forward).

Prints a table, throughput ratios and a greedy-agreement check (first 4 requests' token ids
against HF's), and writes the raw results with machine details to one JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from roofline import fractions, measure_limits, safetensors_facts  # noqa: E402
from workload import WORKLOADS, make_workload, save_workload, workload_params  # noqa: E402

RUNNERS = BENCH_DIR / "runners"
CACHE = BENCH_DIR / ".cache"
HF_EXPORT = CACHE / "smollm2-hf"
VLLM_VENV = REPO / ".venv-vllm"
ENGINES = ("tandem", "hf", "vllm")
# Warn when other processes took more than this share of the CPUs during a timed run.
BUSY_WARN_SHARE = 0.05


def project_python() -> str:
    venv_py = REPO / ".venv" / "bin" / "python"
    return str(venv_py) if venv_py.exists() else sys.executable


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import torch

    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _revision(checkout: Path) -> str | None:
    """The git commit of `checkout` (with "+dirty" when its tree has changes), or None."""
    try:
        rev = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def vllm_python() -> Path | None:
    py = VLLM_VENV / "bin" / "python"
    return py if py.exists() else None


def ensure_hf_export() -> None:
    if (HF_EXPORT / "config.json").exists():
        return
    print(f"exporting the bundled GGUF to {HF_EXPORT} (for vLLM) ...", flush=True)
    subprocess.run([project_python(), str(BENCH_DIR / "export_hf.py"), "--out", str(HF_EXPORT)],
                   check=True)


def runner_cmd(engine: str, wl_path: Path, prefix_caching: bool = True,
               tandem_src: Path | None = None,
               engine_args: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if engine == "tandem":
        src = str(tandem_src or REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [project_python(), str(RUNNERS / "tandem_runner.py"), str(wl_path)]
        if not prefix_caching:
            cmd.append("--no-prefix-caching")
        for arg in engine_args:  # KEY=VALUE: quantization=int8, dtype=bfloat16
            cmd += ["--engine-arg", arg]
    elif engine == "hf":
        cmd = [project_python(), str(RUNNERS / "hf_runner.py"), str(wl_path)]
    elif engine == "vllm":
        cmd = [str(vllm_python()), str(RUNNERS / "vllm_runner.py"), str(wl_path),
               "--model", str(HF_EXPORT)]
        for arg in engine_args:  # dtype=bfloat16
            key, _, value = arg.partition("=")
            cmd += [f"--{key}", value]
        env.pop("PYTHONPATH", None)  # keep the project's packages out of vLLM's venv
    else:
        raise ValueError(engine)
    return cmd, env


def parse_result(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "engine" in obj:
                return obj
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_engine(label: str, engine: str, wl_name: str, wl_path: Path, timeout: float,
               prefix_caching: bool = True, tandem_src: Path | None = None,
               engine_args: tuple[str, ...] = ()) -> dict:
    cmd, env = runner_cmd(engine, wl_path, prefix_caching, tandem_src, engine_args)
    log_path = CACHE / "logs" / f"{wl_name}-{label}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"  running {label} ... (log: {log_path.relative_to(REPO)})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as errf:
        # Own session, so a timeout or Ctrl-C also ends the runner's children (vLLM's engine
        # core and worker processes).
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errf, text=True,
                                cwd=str(REPO), start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, rc = "", None
        except BaseException:
            _kill_group(proc)
            raise
    elapsed = time.perf_counter() - t0
    result = parse_result(stdout) if rc == 0 else None
    if result is None:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        why = "timed out" if rc is None else f"exit code {rc}"
        print(f"  {label} FAILED ({why}); last log lines:\n    " + "\n    ".join(tail), flush=True)
        return {"engine": label, "error": why, "process_s": round(elapsed, 1),
                "log_tail": tail}
    result["engine"] = label
    result["process_s"] = round(elapsed, 1)
    print(f"  {label}: {result['wall_s']:.1f}s wall, {result['output_tokens_per_s']:.1f} out tok/s"
          f" (load {result['load_s']:.0f}s, threads {result.get('threads')}, "
          f"process {elapsed:.0f}s)", flush=True)
    share = result.get("other_cpu_share")
    if share is not None and share > BUSY_WARN_SHARE:
        print(f"  WARNING: other processes used {share:.0%} of the machine's CPU during the "
              f"{label} run ({result['other_cpu_s']:.0f} CPU s); its numbers are unreliable",
              flush=True)
    return result


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy agreement of the first requests: exact matches and matching-prefix fraction."""
    n = min(len(ref), len(other))
    exact, fracs = 0, []
    for a, b in zip(ref[:n], other[:n], strict=True):
        common = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            common += 1
        exact += a == b
        fracs.append(common / max(len(a), 1))
    return {"requests": n, "exact": exact,
            "prefix_match_fraction": round(sum(fracs) / n, 4) if n else None,
            "per_request_prefix_fraction": [round(f, 4) for f in fracs]}


def ratio(a: dict | None, b: dict | None, key: str = "output_tokens_per_s") -> float | None:
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return round(a[key] / b[key], 3)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def print_table(wl_name: str, results: list[dict]) -> None:
    head = (f"{'engine':<24}{'wall s':>9}{'out tok':>9}{'out tok/s':>11}{'req/s':>8}"
            f"{'total tok/s':>13}{'threads':>9}{'load s':>8}{'other cpu':>11}")
    print(f"\n== {wl_name} ==\n{head}\n{'-' * len(head)}")
    for r in results:
        if "error" in r:
            print(f"{r['engine']:<24}  FAILED: {r['error']}")
            continue
        thr = r.get("threads")
        print(f"{r['engine']:<24}{r['wall_s']:>9.1f}{r['output_tokens']:>9}"
              f"{r['output_tokens_per_s']:>11.1f}{r['requests_per_s']:>8.3f}"
              f"{r['total_tokens_per_s']:>13.1f}{thr if thr is not None else '-':>9}"
              f"{r['load_s']:>8.0f}{_pct(r.get('other_cpu_share')):>11}")
    print("(other cpu: share of the machine's CPU that other processes used during the timed "
          "run; above a few % the numbers are skewed)")


def _compute_dtype(engine: str, extra: tuple[str, ...]) -> str:
    """The dtype a run's matrix multiplies run in: bfloat16 models, int8 for w8a8, else
    float32 (weight-only quantized modes widen their weights to float32 activations)."""
    args = dict(a.partition("=")[::2] for a in extra)
    if args.get("dtype") == "bfloat16":
        return "bfloat16"
    return "int8" if engine == "tandem" and args.get("quantization") == "w8a8" else "float32"


def roofline_table(runs: list[tuple], by: dict[str, dict], limits, facts) -> None:  # noqa: ANN001
    """Adds `roofline` (and Tandem's `host_share`) to each result and prints them."""
    print(f"\n{'engine':<24}{'out tok/s':>11}{'steps':>7}{'weight BW':>11}{'matrix':>9}"
          f"{'compute':>10}{'host':>7}")
    for label, eng, _pc, _src, extra in runs:
        r = by.get(label)
        if r is None or eng == "hf":
            continue
        compute = _compute_dtype(eng, extra)
        weight_bytes = r.get("weight_bytes")
        if weight_bytes is None and eng == "vllm":  # dense weights in the run's dtype
            weight_bytes = facts.total_params * (2 if compute == "bfloat16" else 4)
        r["roofline"] = fractions(r, limits, facts, weight_bytes, compute)
        if r.get("forward_s") is not None:
            r["host_share"] = round(1 - r["forward_s"] / r["wall_s"], 4)
        f = r["roofline"]
        print(f"{label:<24}{r['output_tokens_per_s']:>11.1f}{f['steps'] or '-':>7}"
              f"{_pct(f['weight_bw']):>11}{_pct(f['matrix']):>9}{compute:>10}"
              f"{_pct(r.get('host_share')):>7}")
    print("(weight BW: steps x weight bytes / wall against the measured read bandwidth; "
          "matrix: the linears' FLOPs / wall against the GEMM peak of the compute dtype; host: "
          "share of the wall outside the model's forward)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="24 requests, prompts 32-256, outputs 16-64 tokens")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per-runner seconds")
    ap.add_argument("--out", type=Path, default=None,
                    help="raw JSON (default bench/results/offline_throughput-<date>.json)")
    ap.add_argument("--tandem-baseline", type=Path, default=None, metavar="PATH",
                    help="also run Tandem from PATH/src as tandem-baseline (a checkout of "
                         "the revision to compare against)")
    ap.add_argument("--quantization", default="", metavar="MODE[,MODE...]",
                    help="also run Tandem with each of these quantizations (int8, w8a8, "
                         "int4, fp8, gguf) as tandem-MODE; MODE@DTYPE (w8a8@bfloat16) runs "
                         "it in that dtype as tandem-MODE-DTYPE")
    ap.add_argument("--dtypes", default="", metavar="DTYPE[,DTYPE...]",
                    help="also run Tandem in each of these dtypes (bfloat16) as tandem-DTYPE "
                         "(float32 is the plain `tandem` run)")
    ap.add_argument("--vllm-dtypes", default="float32", metavar="DTYPE[,DTYPE...]",
                    help="vLLM's dtypes (float32 is the plain `vllm` run, others vllm-DTYPE)")
    ap.add_argument("--no-roofline", action="store_true",
                    help="skip measuring the machine's bandwidth and GEMM peaks")
    args = ap.parse_args(argv)
    vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
    quants = [q.strip() for q in args.quantization.split(",") if q.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    # "w8a8@bfloat16": the quantization in that dtype (tandem-w8a8-bfloat16)
    variants = ([(q.replace("@", "-"), (f"quantization={q.partition('@')[0]}",)
                  + ((f"dtype={q.partition('@')[2]}",) if "@" in q else ())) for q in quants]
                + [(d, (f"dtype={d}",)) for d in dtypes])
    baseline_src = None
    if args.tandem_baseline is not None:
        baseline_src = args.tandem_baseline.resolve() / "src"
        if not (baseline_src / "tandem" / "__init__.py").exists():
            ap.error(f"{baseline_src} holds no tandem package")

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} (choose from {', '.join(ENGINES)})")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    notes = []
    if "vllm" in engines and vllm_python() is None:
        note = f"vLLM skipped: {VLLM_VENV.relative_to(REPO)} is missing (run bench/setup_vllm.sh)"
        print(note)
        notes.append(note)
        engines.remove("vllm")
    if "vllm" in engines:
        ensure_hf_export()

    now = dt.datetime.now().astimezone()
    out_path = args.out or (BENCH_DIR / "results" / f"offline_throughput-{now:%Y-%m-%d}.json")
    machine = machine_info()
    print(f"machine: {machine['cpu_model']}, {machine['cores']} cores, "
          f"{machine['mem_gib']} GiB, torch {machine['torch_version']} "
          f"({machine['torch_threads']} threads), load avg {machine['loadavg_at_start']}")
    limits = facts = None
    if not args.no_roofline:
        limits = measure_limits(machine["torch_threads"])
        if not (HF_EXPORT / "config.json").exists():
            ensure_hf_export()
        facts = safetensors_facts(HF_EXPORT)
        print(f"limits: read {limits.read_gbps:.1f} GB/s, GEMM TFLOP/s {limits.gemm_tflops} "
              f"({limits.threads} threads); model: {facts.linear_params / 1e6:.1f}M linear "
              f"parameters of {facts.total_params / 1e6:.1f}M", flush=True)
    report: dict = {"benchmark": "offline_throughput", "date": now.isoformat(timespec="seconds"),
                    "quick": args.quick, "seed": args.seed, "engines": engines,
                    "quantization": quants, "dtypes": dtypes, "vllm_dtypes": vllm_dtypes,
                    "limits": None if limits is None else asdict(limits),
                    "model_facts": None if facts is None else asdict(facts),
                    "machine": machine, "notes": notes, "workloads": {},
                    "tandem_src": str(REPO / "src"), "tandem_revision": _revision(REPO)}
    if baseline_src is not None:
        report["tandem_baseline_src"] = str(baseline_src)
        report["tandem_baseline_revision"] = _revision(baseline_src.parent)

    CACHE.mkdir(parents=True, exist_ok=True)
    for wl_name in workloads:
        params = workload_params(wl_name, quick=args.quick, seed=args.seed)
        requests = make_workload(**params)
        wl_path = CACHE / f"workload-{wl_name}{'-quick' if args.quick else ''}.json"
        save_workload(wl_path, wl_name, params, requests)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        out_tokens = sum(r.max_tokens for r in requests)
        print(f"\nworkload {wl_name}: {len(requests)} requests, {prompt_tokens} prompt tokens, "
              f"{out_tokens} output tokens, params {params}", flush=True)

        runs: list[tuple[str, str, bool, Path | None, tuple[str, ...]]] = []
        for e in engines:
            if e == "tandem" and params.get("shared_prefix_tokens"):
                runs += [("tandem", "tandem", True, None, ()),
                         ("tandem-no-prefix-cache", "tandem", False, None, ())]
            elif e == "vllm":
                runs += [("vllm" if d == "float32" else f"vllm-{d}", "vllm", True, None,
                          (f"dtype={d}",)) for d in vllm_dtypes]
            else:
                runs.append((e, e, True, None, ()))
            if e == "tandem":
                runs += [(f"tandem-{v}", "tandem", True, None, extra) for v, extra in variants]
            if e == "tandem" and baseline_src is not None:
                runs.append(("tandem-baseline", "tandem", True, baseline_src, ()))
        results = [run_engine(label, eng, wl_name, wl_path, args.timeout, pc, src, q)
                   for label, eng, pc, src, q in runs]
        by = {r["engine"]: r for r in results if "error" not in r}

        print_table(wl_name, results)
        ratios = {
            "tandem/vllm": ratio(by.get("tandem"), by.get("vllm")),
            "tandem/hf": ratio(by.get("tandem"), by.get("hf")),
            "vllm/hf": ratio(by.get("vllm"), by.get("hf")),
        }
        vllm_runs = [label for label, eng, *_ in runs if eng == "vllm" and label != "vllm"]
        for v, _ in variants:
            ratios[f"tandem-{v}/tandem"] = ratio(by.get(f"tandem-{v}"), by.get("tandem"))
            for w in ("vllm", *vllm_runs):
                ratios[f"tandem-{v}/{w}"] = ratio(by.get(f"tandem-{v}"), by.get(w))
        for w in vllm_runs:
            ratios[f"tandem/{w}"] = ratio(by.get("tandem"), by.get(w))
        if baseline_src is not None:
            ratios["tandem/tandem-baseline"] = ratio(by.get("tandem"), by.get("tandem-baseline"))
            ratios["tandem-baseline/vllm"] = ratio(by.get("tandem-baseline"), by.get("vllm"))
        if any(label == "tandem-no-prefix-cache" for label, *_ in runs):
            ratios["tandem prefix-cache on/off"] = ratio(by.get("tandem"),
                                                         by.get("tandem-no-prefix-cache"))
        print("ratios (output tokens/s): " + ", ".join(
            f"{k} = {v:.2f}x" if v is not None else f"{k} = n/a" for k, v in ratios.items()))

        if limits is not None and facts is not None:
            limits = limits.best(measure_limits(machine["torch_threads"]))
            report["limits"] = asdict(limits)
            print(f"limits (best of before and after): read {limits.read_gbps:.1f} GB/s, "
                  f"GEMM TFLOP/s {limits.gemm_tflops}")
            roofline_table(runs, by, limits, facts)
        ref_name = "hf" if "hf" in by else ("vllm" if "vllm" in by else None)
        agree = {}
        if ref_name:
            ref = by[ref_name]["check_token_ids"]
            for name, r in by.items():
                if name != ref_name:
                    agree[name] = agreement(ref, r["check_token_ids"])
            if agree:
                print(f"greedy agreement with {ref_name} (first {len(ref)} requests): " + "; ".join(
                    f"{n}: {a['exact']}/{a['requests']} identical, "
                    f"{a['prefix_match_fraction']:.0%} of tokens before first divergence"
                    for n, a in agree.items()))
        report["workloads"][wl_name] = {
            "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
            "num_requests": len(requests), "prompt_tokens": prompt_tokens,
            "output_tokens": out_tokens, "results": results, "ratios": ratios,
            "agreement_reference": ref_name, "agreement": agree,
        }

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
