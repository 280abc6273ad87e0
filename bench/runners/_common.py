"""Shared helpers for the per-engine benchmark runners.

Each runner is a standalone script executed in its own subprocess (and, for vLLM, its own
venv), so this module depends on the standard library only.  Protocol:

    python bench/runners/<engine>_runner.py WORKLOAD_JSON [options]

reads the workload written by ``bench/workload.py`` and prints exactly one JSON line on
stdout (everything else goes to stderr): ``{"engine", "wall_s", "output_tokens",
"num_requests", ...}``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# How many leading requests' generated token ids are echoed back for the agreement check.
NUM_CHECK = 4


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def load_requests(path: str | Path) -> tuple[dict, list[tuple[list[int], int]]]:
    """Return (workload metadata, [(prompt_token_ids, max_tokens), ...])."""
    data = json.loads(Path(path).read_text())
    reqs = [(list(map(int, r["prompt_token_ids"])), int(r["max_tokens"]))
            for r in data.pop("requests")]
    return data, reqs


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float | None:
    """CPU seconds all CPUs spent busy since boot (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user/nice
    return (sum(fields) - idle - guest) / _CLK_TCK


def tree_cpu_s(root: int | None = None) -> float | None:
    """CPU seconds used so far by this process and its live descendants (e.g. vLLM's
    engine-core and worker processes), from /proc/<pid>/stat."""
    root = os.getpid() if root is None else root
    try:
        stats = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            rest = raw[raw.rindex(")") + 2:].split()
            stats[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _CLK_TCK)
    except (OSError, ValueError):
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total


class Timer:
    """Wall time of a block, plus how much CPU *other* processes on the machine used
    meanwhile (``other_cpu_s``): the benchmark machine may be shared, and foreign load
    makes the numbers meaningless."""

    def __enter__(self) -> Timer:
        self.busy0, self.own0 = machine_busy_s(), tree_cpu_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.t0
        busy1, own1 = machine_busy_s(), tree_cpu_s()
        self.own_cpu_s = self.other_cpu_s = None
        if None not in (self.busy0, busy1, self.own0, own1):
            self.own_cpu_s = round(own1 - self.own0, 2)
            self.other_cpu_s = round(max(0.0, (busy1 - self.busy0) - self.own_cpu_s), 2)

    def contention(self) -> dict:
        """Fields for the result: own/other CPU seconds and the share of the machine's CPU
        capacity other processes took during the block."""
        cap = self.elapsed * (os.cpu_count() or 1)
        share = round(self.other_cpu_s / cap, 3) if self.other_cpu_s is not None and cap else None
        return {"own_cpu_s": self.own_cpu_s, "other_cpu_s": self.other_cpu_s,
                "other_cpu_share": share}


def make_result(
    engine: str,
    requests: Sequence[tuple[list[int], int]],
    output_token_ids: Sequence[Sequence[int]],
    wall_s: float,
    load_s: float,
    threads: int | None,
    *,
    useful_output_tokens: int | None = None,
    loadavg_before: list[float] | None = None,
    timer: Timer | None = None,
    **extra: object,
) -> dict:
    """Build the runner's result dict.

    ``output_tokens`` counts tokens actually produced, capped per request at its own
    ``max_tokens`` (what the request asked for; the HF baseline decodes padding steps past
    that, which are not useful output).
    """
    produced = [len(ids) for ids in output_token_ids]
    useful = [min(n, mt) for n, (_, mt) in zip(produced, requests, strict=True)]
    out_tokens = sum(useful) if useful_output_tokens is None else useful_output_tokens
    prompt_tokens = sum(len(p) for p, _ in requests)
    expected = sum(mt for _, mt in requests)
    short = sum(1 for n, (_, mt) in zip(produced, requests, strict=True) if n < mt)
    n = len(requests)
    return {
        "engine": engine,
        "wall_s": round(wall_s, 4),
        "output_tokens": int(out_tokens),
        "expected_output_tokens": int(expected),
        "requests_short_of_max_tokens": short,
        "num_requests": n,
        "prompt_tokens": int(prompt_tokens),
        "output_tokens_per_s": round(out_tokens / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(n / wall_s, 4) if wall_s > 0 else None,
        "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall_s, 3) if wall_s else None,
        "load_s": round(load_s, 3),
        "threads": threads,
        "python": platform.python_version(),
        "loadavg_before": loadavg_before,
        "loadavg_after": loadavg(),
        **(timer.contention() if timer is not None else {}),
        "check_token_ids": [list(map(int, ids)) for ids in output_token_ids[:NUM_CHECK]],
        **extra,
    }


def emit(result: dict) -> None:
    """Print the single JSON result line on stdout."""
    sys.stdout.flush()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
