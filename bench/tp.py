"""Tensor parallelism on this machine: TP = 1 against TP = N (ranks 1..N-1 as local
processes, `mp`, collectives over gloo), in one run.

    .venv/bin/python bench/tp.py [--rounds 3] [--quick] [--out FILE]

Two models, each at TP = 1 and the TP size it splits into: the bundled SmolLM2-135M-Instruct
at TP = 3 (its 9 query heads and 3 KV heads do not split 2 ways, so TP = 2 is refused, as
vLLM refuses it), and a random-weight Llama of the same size but 8 query and 4 KV heads
(head_dim 72; 30 layers, hidden 576, MLP 1536, vocabulary 49152) at TP = 2. float32, CPU.
Both engines of a pair get the same cores: `num_threads = cores`, which TP = 1 runs in one
process and TP = N splits over its ranks (`max(1, cores // N)` threads each: on 2 cores,
TP = 3 runs 3 single-threaded ranks, 1.5 threads per core).
Workloads: `prefill` (8 prompts of 256 tokens, one output
token each), `decode-1` and `decode-16` (1 or 16 prompts of 32 tokens, 64 greedy output
tokens each). Each round runs every workload on both engines in turn; medians over rounds.

Reported per (workload, engine): wall seconds, output tokens/s and the TP engine's ratio to
TP = 1, steps and seconds per step, and for TP > 1 the communication share of the wall as
rank 0 sees it: seconds inside the model's all-reduces and its logits gather (`TPGroup.seconds`:
transfer plus waiting for the slowest rank) and inside the plan broadcasts
(`Executor.send_seconds`). Greedy tokens must equal TP = 1's (exit code 1 otherwise).
Writes the raw results with machine details to one JSON file under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH / "runners"))
sys.path.insert(0, str(BENCH))

from _common import log  # noqa: E402

WORKLOADS = {  # name: (prompts, prompt tokens, output tokens)
    "prefill": (8, 256, 1),
    "decode-1": (1, 32, 64),
    "decode-16": (16, 32, 64),
}
QUICK = {"prefill": (2, 64, 1), "decode-1": (1, 16, 8), "decode-16": (4, 16, 8)}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


class StepCounter:
    """Counts `runner.execute` calls (one per engine step that ran a batch)."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.steps, inner = 0, runner.execute

        def execute(sched):  # noqa: ANN001, ANN202
            self.steps += 1
            return inner(sched)
        runner.execute = execute


def run_once(llm, counter: StepCounter, work: tuple[int, int, int], seed: int) -> dict:  # noqa: ANN001
    from tandem.engine.sampling_params import SamplingParams

    n, length, out = work
    ps = prompts(n, length, seed)
    sp = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    ex = llm.engine.runner.executor
    comm = ex.groups.tp if ex is not None else None
    if comm is not None:
        comm.timed, comm.seconds, comm.calls, ex.send_seconds = True, 0.0, 0, 0.0
    steps0 = counter.steps
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp)
    wall = time.perf_counter() - t0
    steps = counter.steps - steps0
    res = {"wall_s": wall, "tokens_per_s": n * out / wall, "steps": steps,
           "step_ms": 1e3 * wall / max(steps, 1),
           "tokens": [o.outputs[0].token_ids for o in outs]}
    if comm is not None:
        res.update(comm_s=comm.seconds, collectives=comm.calls, send_s=ex.send_seconds,
                   comm_share=comm.seconds / wall, send_share=ex.send_seconds / wall)
    return res


def random_llama(out: Path) -> str:
    """The 8-head random model (SmolLM2-135M's sizes otherwise), with the bundled tokenizer."""
    import torch
    import transformers

    from tandem.engine.model.loader import bundled_model_path
    from tandem.protocol.tokenizer import Tokenizer

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-5, initializer_range=0.05, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    Tokenizer.load(bundled_model_path()).save_hf(out)
    return str(out)


def bench_pair(model: str | None, tp: int, workloads: dict, rounds: int, cores: int) -> dict:
    """TP = 1 and TP = `tp` engines of `model` (None: bundled), every workload each round."""
    from tandem.engine.llm import LLM

    common = dict(max_model_len=512, num_kv_blocks=512, max_num_batched_tokens=2048)
    name = f"tp{tp}"
    engines = {"tp1": LLM(model, num_threads=cores, **common),
               name: LLM(model, num_threads=cores, tensor_parallel_size=tp, **common)}
    counters = {k: StepCounter(v.engine.runner) for k, v in engines.items()}
    raw: dict[str, dict[str, list[dict]]] = {w: {e: [] for e in engines} for w in workloads}
    try:
        for r in range(rounds):
            for w, work in workloads.items():
                for e, llm in engines.items():
                    res = run_once(llm, counters[e], work, seed=r)
                    raw[w][e].append(res)
                    log(f"round {r} {w} {e}: {res['tokens_per_s']:.1f} tok/s, "
                        f"{res['step_ms']:.1f} ms/step"
                        + (f", comm {100 * res['comm_share']:.0f}%" if "comm_share" in res
                           else ""))
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
    summary = {}
    for w in workloads:
        row = {}
        for e in engines:
            runs = raw[w][e]
            row[e] = {k: statistics.median(x[k] for x in runs) for k in runs[0] if k != "tokens"}
        row["ratio"] = row[name]["tokens_per_s"] / row["tp1"]["tokens_per_s"]
        row["greedy_equal"] = all(a["tokens"] == b["tokens"] for a, b in
                                  zip(raw[w]["tp1"], raw[w][name], strict=True))
        summary[w] = row
        log(f"{w}: tp1 {row['tp1']['tokens_per_s']:.1f} tok/s, {name} "
            f"{row[name]['tokens_per_s']:.1f} tok/s ({row['ratio']:.2f}x), {name} comm share "
            f"{100 * row[name]['comm_share']:.0f}% (+ plans {100 * row[name]['send_share']:.1f}%)"
            f", greedy equal: {row['greedy_equal']}")
    for per in raw.values():
        for runs in per.values():
            for x in runs:
                x.pop("tokens")
    return {"tp": tp, "summary": summary, "raw": raw}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny workloads, one round")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import tempfile

    import torch

    from offline_throughput import _revision, machine_info

    cores = os.cpu_count() or 2
    workloads = QUICK if args.quick else WORKLOADS
    rounds = 1 if args.quick else args.rounds
    machine = {**machine_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    log(f"machine: {machine}")
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = [("bundled", None, 3), ("random-8-heads", random_llama(Path(tmp) / "r"), 2)]
        for label, path, tp in pairs:
            log(f"model {label}: TP 1 vs {tp}")
            models[label] = bench_pair(path, tp, workloads, rounds, cores)
    exact = all(row["greedy_equal"] for m in models.values() for row in m["summary"].values())
    out = {"bench": "tp", "date": dt.date.today().isoformat(), "revision": _revision(REPO),
           "machine": machine, "rounds": rounds, "workloads": workloads, "models": models}
    path = args.out or BENCH / "results" / f"tp-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {path}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
