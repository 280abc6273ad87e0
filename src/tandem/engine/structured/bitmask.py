"""Token bitmasks: one int32 row of ceil(vocab_size / 32) words per sequence, bit j of word i
standing for token 32 * i + j (1 = allowed), filled on the CPU by the matchers and applied to
the logits on the logits' own device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row for a logits width of `vocab_size`."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab_size / 32)] on the CPU, every bit set (all allowed)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed (ids past the bitmask's
    32 * words are not allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool,
                      device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Sequence[int] | torch.Tensor) -> None:
    """In place: for each i, the logits of row `rows[i]` whose bit in `bitmask[i]` is 0 become
    -inf (on the logits' device; the bitmask is copied there). Other rows are untouched.
    `bitmask` has len(rows) rows (or more: the first len(rows) are used)."""
    index = torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    n = int(index.numel())
    if n == 0:
        return
    mask = bitmask[:n].to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(mask, logits.shape[-1])
    picked = logits.index_select(0, index)
    picked.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, picked)
