"""KV cache groups of a hybrid model: layers of different attention windows (Gemma 3's
sliding layers around full-attention ones) keep separate block tables over one pool.

Layout (vLLM's hybrid allocator, `kv_cache_utils` uniform page size): the layers of each
attention kind (full, or sliding with window W) are cut into groups of `group_size` layers
(the last one of a kind padded where the count does not divide). The engine allocates
`group_size` physical K/V tensors of `num_blocks` blocks each; layer `j` of every group
reads and writes tensor `j`. A block id then costs `group_size` layers' worth of memory and
belongs to at most one group at a time (the pool is shared), so a sliding group that frees
its blocks behind the window hands that memory to any group.

`group_size` is the smallest layer count of a kind, or the largest one where that is under
1.25 times the smallest (fewer tables, little padding), as vLLM chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.engine.kv_cache.block_table import BlockTable
from tandem.engine.parallel.plan import GroupTables


@dataclass(frozen=True)
class KVGroupLayout:
    """Which group and physical tensor each layer uses.

    `windows[g]`: group g's window (None: full attention); `layer_group[i]` /
    `layer_slot[i]`: layer i's group and tensor (slot < `group_size`); groups of one kind
    are consecutive, kinds in order of their first layer."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def tensors_of(self, caches: Sequence[object]) -> list[object]:
        """Each layer's entry of the `group_size` physical `caches` (aliased per slot)."""
        if len(caches) != self.group_size:
            raise ValueError(f"{len(caches)} cache tensors for a group size of "
                             f"{self.group_size}")
        return [caches[s] for s in self.layer_slot]


def kv_group_layout(layer_windows: Sequence[int | None]) -> KVGroupLayout | None:
    """The grouping of a model whose layers' windows (`ModelArchConfig.layer_windows`)
    differ; None where every layer has the same window (one block table serves them)."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    if len(kinds) < 2:
        return None
    counts = [len(v) for v in kinds.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for w, layers in kinds.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer] = len(windows)
                layer_slot[layer] = slot
            windows.append(w)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), size)


def group_tables(tables: list[BlockTable], request_ids: list[str], rows: np.ndarray,
                 positions: np.ndarray, tok_rows: np.ndarray, block_size: int
                 ) -> tuple[GroupTables, ...]:
    """Each KV group's slots and tables for a batch: `request_ids` in gather order, `rows`
    the plan's rows as indexes into them, token i of `positions` in request
    `tok_rows[i]` (an index into `request_ids`)."""
    out = []
    for t in tables:
        table, lens = t.gather(request_ids)
        slots = table[tok_rows, positions // block_size].astype(np.int64) * block_size + (
            positions % block_size)
        out.append(GroupTables(slots, table[rows], lens[rows]))
    return tuple(out)
