"""Tandem runner for the offline throughput benchmark.

    PYTHONPATH=src .venv/bin/python bench/runners/tandem_runner.py WORKLOAD_JSON \
        [--no-prefix-caching] [--threads N] [--engine-arg key=value ...]

Uses the offline API (``tandem.LLM`` with the bundled SmolLM2, float32): all requests in one
``generate`` call as token-id prompts, greedy, ``ignore_eos``, exactly ``max_tokens`` each.
Works whether tandem is pip-installed (editable) into the venv or only on ``PYTHONPATH``;
the repository's ``src`` is added to ``sys.path`` as a fallback.
"""

from __future__ import annotations

import argparse
import ast
import copy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Timer, emit, load_requests, loadavg, log, make_result  # noqa: E402


def _import_tandem():
    try:
        import tandem
    except ImportError:
        sys.path.insert(0, str(HERE.parent.parent / "src"))
        import tandem
    return tandem


def _parse_engine_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _timings(runner):  # noqa: ANN001, ANN202 - an engine's model runner, any revision
    """A copy of the runner's cumulative step timings, or None (an engine without them)."""
    t = getattr(runner, "timings", None)
    return None if t is None else copy.copy(t)


def _prefix_hits(engine) -> int | None:  # noqa: ANN001
    try:
        return engine.stats().prefix_cache_hits
    except AttributeError:
        return None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0 = all cores); also passed as num_threads")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra tandem engine argument (Python literal value)")
    args = ap.parse_args(argv[1:])

    import os

    import torch

    tandem = _import_tandem()
    from tandem import LLM, SamplingParams

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    meta, requests = load_requests(args.workload)
    engine_args = {"dtype": "float32",
                   "enable_prefix_caching": not args.no_prefix_caching,
                   **_parse_engine_args(args.engine_arg)}

    with Timer() as load:
        try:
            llm = LLM(model=None, num_threads=threads, **engine_args)
        except TypeError:  # an engine without num_threads: torch's setting above applies
            llm = LLM(model=None, **engine_args)
        # Tiny warm-up (excluded); too short to fill a KV block, so no prefix-cache effect.
        llm.generate([[100, 200, 300, 400]],
                     SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    log(f"[tandem] loaded in {load.elapsed:.1f}s, torch threads={torch.get_num_threads()}, "
        f"args={engine_args}")

    prompts = [p for p, _ in requests]
    params = [SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True)
              for _, mt in requests]
    engine = getattr(llm, "engine", None)
    runner = getattr(engine, "runner", None)
    t0 = _timings(runner)
    hits0 = _prefix_hits(engine)
    before = loadavg()
    with Timer() as gen:
        outs = llm.generate(prompts, params)
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    log(f"[tandem] generated {sum(map(len, token_ids))} tokens in {gen.elapsed:.1f}s")

    config = dict(engine_args)
    engine_cfg = getattr(getattr(llm, "engine", None), "config", None)
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                "attention_backend", "max_model_len"):
        if engine_cfg is not None and hasattr(engine_cfg, key):
            config[key] = getattr(engine_cfg, key)
    name = "tandem" if not args.no_prefix_caching else "tandem-no-prefix-cache"
    result = make_result(
        name, requests, token_ids, gen.elapsed, load.elapsed,
        threads=torch.get_num_threads(),
        loadavg_before=before,
        timer=gen,
        engine_version=getattr(tandem, "__version__", None),
        torch_version=torch.__version__,
        config=config,
        workload=meta.get("name"),
    )
    # what bench/roofline.py needs: steps, their forward seconds, weights read per step
    t1 = _timings(runner)
    if t0 is not None and t1 is not None:
        result.update(steps=t1.steps - t0.steps, forward_s=round(t1.forward_s - t0.forward_s, 4),
                      prepare_s=round(t1.prepare_s - t0.prepare_s, 4),
                      sample_s=round(t1.sample_s - t0.sample_s, 4))
    hits1 = _prefix_hits(engine)
    if hits0 is not None and hits1 is not None:
        result["prefix_cache_hits"] = hits1 - hits0
    if hasattr(llm, "model_memory_bytes"):
        result["weight_bytes"] = llm.model_memory_bytes()
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
