"""Which KV heads each tensor-parallel rank holds, and how pages move between two TP sizes
(a prefill pool at one size, a decode pool at another): plain values, no torch.

`kv_heads(num_kv_heads, world, rank)` is the global KV heads rank `rank` caches, as
`tp.TPPlan` splits them: a contiguous run when `world` divides the heads, else (fewer heads
than ranks) the one head its query heads read. `reshard(num_kv_heads, src, dst)` plans, for
every receiving rank, the pieces it copies: (source rank, first local head there, count,
first local head here). Each receiver gets each of its heads exactly once, from the
holder nearest its own position (`d * src / dst`): replicated heads are sent once, not by
every holder, the senders' load spreads, and equal sizes copy rank to rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.errors import ConfigError


@dataclass(frozen=True)
class HeadCopy:
    """KV heads [src_head, src_head + count) local to `src_rank` go to local heads
    [dst_head, dst_head + count) of the receiving rank."""

    src_rank: int
    src_head: int
    count: int
    dst_head: int


def kv_heads(num_kv_heads: int, world: int, rank: int) -> range:
    """The global KV heads rank `rank` of `world` caches (ConfigError if unsplittable)."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"tensor-parallel rank {rank} of {world}")
    if num_kv_heads % world == 0:
        n = num_kv_heads // world
        return range(rank * n, (rank + 1) * n)
    if world % num_kv_heads == 0:
        h = rank * num_kv_heads // world
        return range(h, h + 1)
    raise ConfigError(f"tensor_parallel_size {world} and {num_kv_heads} KV heads: one must "
                      "divide the other")


def reshard(num_kv_heads: int, src_world: int, dst_world: int) -> list[list[HeadCopy]]:
    """Per receiving rank (of `dst_world`), the copies that fill its KV heads from senders
    of `src_world`, runs of consecutive heads merged."""
    holders: dict[int, list[tuple[int, int]]] = {}  # global head -> [(source rank, local)]
    for r in range(src_world):
        for i, h in enumerate(kv_heads(num_kv_heads, src_world, r)):
            holders.setdefault(h, []).append((r, i))
    plans = []
    for d in range(dst_world):
        near = d * src_world // dst_world
        copies: list[HeadCopy] = []
        for j, h in enumerate(kv_heads(num_kv_heads, dst_world, d)):
            r, i = min(holders[h], key=lambda ri: (abs(ri[0] - near), ri[0]))
            last = copies[-1] if copies else None
            if (last is not None and last.src_rank == r and last.src_head + last.count == i
                    and last.dst_head + last.count == j):
                copies[-1] = HeadCopy(r, last.src_head, last.count + 1, last.dst_head)
            else:
                copies.append(HeadCopy(r, i, 1, j))
        plans.append(copies)
    return plans
