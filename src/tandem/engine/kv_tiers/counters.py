"""A KV tier's counters, as `EngineStats.kv_tiers` carries them (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierCounters:
    """One tier's cumulative counts and its bytes (for `tandem_kv_tier_*{tier}`)."""

    tier: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    stores: int = 0  # blocks stored
    loads: int = 0  # blocks loaded into the device pool
    hits: int = 0  # lookups that found the block (before verification)
    evictions: int = 0  # blocks pushed out (to the next tier, or dropped)
    validation_failures: int = 0  # records that did not verify (dropped, recomputed)
