"""Token bitmasks: one int32 row of ceil(vocab_size / 32) words per sequence, bit j of word i
standing for token 32 * i + j (1 = allowed), filled on the CPU by the matchers and applied to
the logits on the logits' own device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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


def _unpack(bitmask: torch.Tensor, vocab_size: int, invert: bool,
            use_numpy: bool | None = None) -> torch.Tensor:
    """bool [rows, vocab_size]: bit set (or, `invert`, clear); ids past the bitmask's
    32 * words count as clear. On the CPU numpy unpacks (one C loop, ~30x faster than the
    broadcast shift); elsewhere torch does, on the bitmask's device (`use_numpy` forces
    either on the CPU)."""
    rows = bitmask.shape[0]
    if use_numpy if use_numpy is not None else bitmask.device.type == "cpu":
        words = bitmask.contiguous().numpy()
        if invert:
            words = np.invert(words)
        flags = torch.from_numpy(np.unpackbits(words.view(np.uint8), axis=1,
                                               bitorder="little").view(np.bool_))
    else:
        flags = ((bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1).reshape(rows, -1)
        flags = flags == 0 if invert else flags.bool()
    if flags.shape[1] >= vocab_size:
        return flags[:, :vocab_size]
    pad = torch.full((rows, vocab_size - flags.shape[1]), invert, dtype=torch.bool,
                     device=bitmask.device)
    return torch.cat([flags, pad], dim=1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed (ids past the bitmask's
    32 * words are not allowed)."""
    return _unpack(bitmask, vocab_size, invert=False)


def _penalty(banned: torch.Tensor) -> torch.Tensor:
    """float32 of `banned`'s shape: -inf where banned, 0 elsewhere, without branches (the
    int32 0xFF800000 is float32 -inf; a masked_fill over a scattered mask mispredicts: ~10x
    slower on a CPU)."""
    return banned.to(torch.int32).mul_(-8388608).view(torch.float32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Sequence[int] | torch.Tensor) -> None:
    """In place: for each i, the logits of row `rows[i]` whose bit in `bitmask[i]` is 0 become
    -inf (on the logits' device; the bitmask is copied there); the allowed ones keep their
    value (finite logits: -inf is added to the banned ones, 0 to the rest). Other rows are
    untouched. `bitmask` has len(rows) rows (or more: the first len(rows) are used)."""
    index = rows.tolist() if isinstance(rows, torch.Tensor) else [int(r) for r in rows]
    n = len(index)
    if n == 0:
        return
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        penalty = _penalty(_unpack(bitmask[:n], vocab, invert=True)).to(logits.dtype)
        if index == list(range(index[0], index[0] + n)):  # one contiguous block of rows
            logits[index[0]:index[0] + n].add_(penalty)
        else:
            for i, row in enumerate(index):
                logits[row].add_(penalty[i])
        return
    banned = _unpack(bitmask[:n].to(logits.device, non_blocking=True), vocab, invert=True)
    at = torch.tensor(index, dtype=torch.long).to(logits.device, non_blocking=True)
    logits.index_add_(0, at, _penalty(banned).to(logits.dtype))
