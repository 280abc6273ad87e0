"""Measured step costs, for the router's cost-based pick (`GetLoad`'s `prefill_s_per_token`,
`decode_step_s`).

EWMAs over recent engine steps (plain values, no torch): a step that ran only decodes
updates the decode step time with its seconds; a step that ran prefill tokens updates two
EWMAs, of the seconds it took beyond one decode step and of its prefill tokens, whose ratio
is the seconds per prefill token (token-weighted: a short chunk's fixed overheads do not
pass for a slow prefill). Both read 0.0 until a step of their kind was seen. A step's time is the
engine loop's wall time from one busy step's start to the next's (so an overlapped step,
whose forward ends in the next step, is still counted once, in steady state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.engine.request import Request
from tandem.protocol.block_hash import BlockHash

ALPHA = 0.2  # weight of the newest step
MAX_STEP_S = 60.0  # a step longer than this (a stall, a debugger) is not a cost sample
MAX_WAITING_PROBED = 128  # waiting requests whose cached prefix is looked up per report


@dataclass
class StepCosts:
    """The EWMAs (seconds per prefill token, seconds per decode-only step; 0.0: unmeasured)."""

    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    _prefill_s: float = 0.0  # EWMA of a prefill step's seconds beyond its decodes
    _prefill_tokens: float = 0.0  # EWMA of a prefill step's prefill tokens

    def observe(self, seconds: float, prefill_tokens: int, decodes: int) -> None:
        """One busy step: `seconds` of wall time, `prefill_tokens` prompt tokens computed and
        `decodes` requests that decoded one token (plus drafts) in it."""
        if not 0.0 < seconds <= MAX_STEP_S:
            return
        if prefill_tokens <= 0:
            if decodes > 0:
                self.decode_step_s = _ewma(self.decode_step_s, seconds)
            return
        beyond = max(seconds - self.decode_step_s, seconds / 2)
        self._prefill_s = _ewma(self._prefill_s, beyond)
        self._prefill_tokens = _ewma(self._prefill_tokens, float(prefill_tokens))
        self.prefill_s_per_token = self._prefill_s / self._prefill_tokens


def _ewma(old: float, sample: float) -> float:
    return sample if old <= 0.0 else old + ALPHA * (sample - old)


def split_tokens(scheduled: Iterable[object]) -> tuple[int, int]:
    """(prefill tokens, decoding requests) of a step's `ScheduledRequest`s: a prompt chunk
    (or a recomputation after preemption) is prefill, one new token plus drafts a decode.
    A prompt's only computed token (the rest cached, or imported from a prefill worker)
    costs what a decode does, so it counts as one: as a 1-token prefill it would make a P/D
    decode worker's prefill rate read one step per token."""
    prefill = decodes = 0
    for s in scheduled:
        fresh = s.num_new_tokens - len(s.spec_token_ids)  # type: ignore[attr-defined]
        if fresh > 1:
            prefill += fresh
        else:
            decodes += 1
    return prefill, decodes


def pending_prefill_tokens(running: Iterable[Request], waiting: Iterable[Request],
                           block_size: int = 0,
                           is_cached: Callable[[BlockHash], bool] | None = None) -> int:
    """Prompt tokens still to compute: a running request's prompt tokens not yet computed,
    and a waiting request's tokens less its leading full blocks that are cached, or that a
    waiting request ahead of it will compute (requests of one prefix group share them).
    Without `is_cached`, and past the first MAX_WAITING_PROBED waiting requests, all of a
    waiting request's tokens count."""
    total = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in running)
    seen: set[BlockHash] = set()
    for i, r in enumerate(waiting):
        todo = max(r.num_tokens - r.num_computed_tokens, 0)
        if is_cached is None or block_size <= 0 or i >= MAX_WAITING_PROBED:
            total += todo
            continue
        hashes = r.update_block_hashes(block_size)[:max(r.num_tokens - 1, 0) // block_size]
        shared = 0
        for h in hashes:
            if h not in seen and not is_cached(h):
                break
            shared += block_size
        seen.update(hashes)
        total += max(todo - shared, 0)
    return total
