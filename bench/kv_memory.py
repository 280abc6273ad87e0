"""KV-cache memory efficiency of the paged cache on the benchmark's mixed workload.

Runs Tandem on the seeded `mixed` workload under a fixed KV budget and reports, after every
step: the slots allocated to running sequences but not holding a computed token (paging
keeps this below one block per sequence), and the peak number of sequences running at once.
It compares that with two contiguous allocators under the same budget: reserving the model's
whole context window per sequence, and reserving each request's own prompt + max_tokens.

    .venv/bin/python bench/kv_memory.py [--budget-mib 256] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workload import make_workload, workload_params  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tandem import LLM, SamplingParams

    params = workload_params("mixed", quick=args.quick)
    requests = make_workload(**params)
    llm = LLM(dtype="float32", kv_cache_memory=args.budget_mib << 20, max_num_seqs=256)
    eng = llm.engine
    st = eng.state
    budget_tokens = st.num_kv_blocks * st.block_size
    for i, r in enumerate(requests):
        eng.add_request(str(i), r.prompt_token_ids,
                        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    peak_running, worst_slack_per_seq, worst_slack = 0, 0.0, 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        s = eng.stats()
        peak_running = max(peak_running, s.num_running)
        worst_slack = max(worst_slack, s.kv_unused_slots)
        if s.num_running:
            worst_slack_per_seq = max(worst_slack_per_seq, s.kv_unused_slots / s.num_running)
    wall = time.perf_counter() - t0
    fit_own, used = 0, 0
    for r in requests:  # FCFS: reserve prompt + max_tokens contiguously per request
        need = len(r.prompt_token_ids) + r.max_tokens
        if used + need > budget_tokens:
            break
        used += need
        fit_own += 1
    result = {
        "benchmark": "kv_memory", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "workload": params, "budget_mib": args.budget_mib, "block_size": st.block_size,
        "budget_tokens": budget_tokens, "max_model_len": st.max_model_len,
        "paged_peak_running_seqs": peak_running,
        "reserve_max_len_seqs": budget_tokens // st.max_model_len,
        "reserve_own_length_seqs": fit_own,
        "max_unused_slots_total": worst_slack,
        "max_unused_slots_per_running_seq": round(worst_slack_per_seq, 2),
        "preemptions": eng.stats().num_preemptions, "wall_s": round(wall, 2),
    }
    print(json.dumps(result, indent=1))
    out = Path(args.out or HERE / "results" / f"kv_memory-{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
