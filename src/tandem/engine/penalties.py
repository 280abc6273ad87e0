"""Repetition, presence and frequency penalties over a batch, with per-request token counts
kept on the device across steps (vLLM semantics: repetition over prompt + output tokens,
presence and frequency over output tokens).

`TokenCounts` keeps, per key (a request id), a row of output-token counts and a row of
prompt-token marks on the logits' device, so a step uploads only the tokens generated since
the previous one instead of whole token lists. `penalise` applies all three penalties to
the whole batch at once; rows without a penalty read an empty row and neutral factors, and
come out bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.engine.staging import IndexUploads

if TYPE_CHECKING:
    from tandem.engine.sampler import SamplingRow


@dataclass
class _Slot:
    index: int  # row in TokenCounts' tensors
    output: Sequence[int]  # the list whose first `counted` tokens row `index` counts
    counted: int = 0
    prompt: Sequence[int] | None = None  # the prompt marked in the row (None: not marked)


@dataclass
class _CountsPlan:
    fresh: int  # IndexUploads segments: slots to clear, prompt (slot, token), new (slot, token)
    prompt_slots: int
    prompt_tokens: int
    new_slots: int
    new_tokens: int
    rows: int  # slot of each batch row (0 = the empty row)
    temporary: list[object]  # keys released after the step (rows without a key)
    vocab: int


class TokenCounts:
    """Penalty statistics per key (request id) on the logits' device, kept across steps:
    row `slot` of `output` [S, V + 1] int32 counts the key's output tokens, of `prompt`
    [S, V + 1] bool marks its prompt tokens (column V absorbs ids outside the vocabulary).
    Row 0 stays empty: batch rows without penalties read it. 5·V bytes per live key."""

    def __init__(self) -> None:
        self.slots: dict[object, _Slot] = {}
        self.output: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self._free: list[int] = []
        self._used = 1

    def release(self, key: object) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self._free.append(slot.index)

    def _reset(self, vocab: int, device: torch.device, capacity: int = 8) -> None:
        self.slots.clear()
        self._free.clear()
        self._used = 1
        self.output = torch.zeros((capacity, vocab + 1), dtype=torch.int32, device=device)
        self.prompt = torch.zeros((capacity, vocab + 1), dtype=torch.bool, device=device)

    def _take(self, key: object, output: Sequence[int]) -> _Slot:
        slot = self.slots.get(key)
        if slot is not None:  # a list that is not the one counted: count afresh
            slot.output, slot.counted, slot.prompt = output, 0, None
            return slot
        if self._free:
            index = self._free.pop()
        else:
            index, self._used = self._used, self._used + 1
            if index == self.output.shape[0]:  # double the capacity
                self.output = torch.cat([self.output, torch.zeros_like(self.output)])
                self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        slot = self.slots[key] = _Slot(index, output)
        return slot

    def plan(self, rows: list[SamplingRow], wanted: list[int], vocab: int,
             device: torch.device, ints: IndexUploads) -> _CountsPlan:
        """Host side: assign slots to rows `wanted`, queue their new tokens in `ints`."""
        if self.output is None or self.output.shape[1] != vocab + 1 \
                or self.output.device != device:
            self._reset(vocab, device)
        fresh: list[int] = []
        p_slots: list[int] = []
        p_tokens: list[int] = []
        n_slots: list[int] = []
        n_tokens: list[int] = []
        index = [0] * len(rows)
        temporary: list[object] = []
        for i in wanted:
            r = rows[i]
            key: object = r.key
            if key is None:
                key = object()
                temporary.append(key)
            slot = self.slots.get(key)
            out = r.output_token_ids
            if (slot is None or slot.output is not out or len(out) < slot.counted
                    or (slot.prompt is not None and slot.prompt is not r.prompt_token_ids)):
                slot = self._take(key, out)
                fresh.append(slot.index)
            if r.repetition_penalty != 1.0 and slot.prompt is None:
                slot.prompt = r.prompt_token_ids
                p_tokens.extend(slot.prompt)
                p_slots.extend([slot.index] * len(slot.prompt))
            new = out[slot.counted:]
            n_tokens.extend(new)
            n_slots.extend([slot.index] * len(new))
            slot.counted += len(new)
            index[i] = slot.index
        return _CountsPlan(ints.add(fresh), ints.add(p_slots), ints.add(p_tokens),
                           ints.add(n_slots), ints.add(n_tokens), ints.add(index),
                           temporary, vocab)

    def apply(self, plan: _CountsPlan, idx: list[torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device side: update the slots; (output counts [N, V], prompt mask [N, V])."""
        out, prompt, v = self.output, self.prompt, plan.vocab
        fresh = idx[plan.fresh]
        if fresh.numel():
            out.index_fill_(0, fresh, 0)
            prompt.index_fill_(0, fresh, False)
        if idx[plan.prompt_tokens].numel():
            prompt.index_put_((idx[plan.prompt_slots], idx[plan.prompt_tokens].clamp(max=v)),
                              torch.ones((), dtype=torch.bool, device=prompt.device))
        new = idx[plan.new_tokens]
        if new.numel():
            out.index_put_((idx[plan.new_slots], new.clamp(max=v)),
                           torch.ones_like(new, dtype=torch.int32), accumulate=True)
        rows = idx[plan.rows]
        counts, mask = out.index_select(0, rows)[:, :v], prompt.index_select(0, rows)[:, :v]
        for key in plan.temporary:
            self.release(key)
        return counts, mask


def penalise(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
             repetition: torch.Tensor | None, presence: torch.Tensor | None,
             frequency: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] float32, counts [N, V] output-token counts, in_prompt [N, V] bool;
    per-row factors [N] (None: no row has that kind). Repetition divides positive logits of
    seen tokens by the factor and multiplies the others; then presence and frequency
    subtract `count * frequency + (count > 0) * presence`. Out of place."""
    if repetition is not None:
        rep = repetition[:, None]
        seen = in_prompt | (counts > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if presence is not None and frequency is not None:
        c = counts.float()
        logits = logits - (c * frequency[:, None] + (c > 0) * presence[:, None])
    return logits
