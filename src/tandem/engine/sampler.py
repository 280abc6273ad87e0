"""Batched sampling: penalties, min-tokens, temperature, top-k / top-p / min-p, logprobs.

Rows are sequences that sample this step. Random rows draw with the exponential race
(`argmax(p / E)`, `E ~ Exp(1)`), which equals sampling from `p`; a seeded request draws its
noise from its own `torch.Generator`, so its tokens do not depend on the batch around it.
Logprobs are those of the raw model distribution (before any processing), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """What the sampler needs of one row (plain values)."""

    temperature: float
    top_k: int  # <= 0 disables
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    generator: torch.Generator | None  # per-request generator for seeded sampling
    banned_token_ids: tuple[int, ...]  # suppressed this step (min_tokens not reached)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_logprobs: int | None  # top-k logprobs wanted, None = none


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: list[dict[int, float] | None]  # per row: sampled + top-k tokens, or None


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    n, vocab = logits.shape
    for i, r in enumerate(rows):
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                dtype=torch.int64)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / r.repetition_penalty,
                                          vals * r.repetition_penalty)
        if (r.presence_penalty or r.frequency_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.int64)
            counts = torch.zeros(vocab, dtype=logits.dtype).scatter_add_(
                0, out, torch.ones_like(out, dtype=logits.dtype))
            logits[i] -= counts * r.frequency_penalty + (counts > 0) * r.presence_penalty


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus (top-p); logits [N, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1])[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before > top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V] (any float dtype) -> one token per row."""
        logits = logits.float()
        want_lp = any(r.num_logprobs is not None for r in rows)
        raw_logprobs = logits.log_softmax(dim=-1) if want_lp else None
        penalize = any(r.repetition_penalty != 1.0 or r.presence_penalty or r.frequency_penalty
                       for r in rows)
        banned = any(r.banned_token_ids for r in rows)
        if penalize or banned:
            logits = logits.clone()
        if banned:
            for i, r in enumerate(rows):
                if r.banned_token_ids:
                    logits[i, list(r.banned_token_ids)] = _NEG_INF
        if penalize:
            _apply_penalties(logits, rows)

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if r.temperature >= 1e-5]
        if random_rows:
            tokens[random_rows] = self._sample(logits[random_rows],
                                               [rows[i] for i in random_rows])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        temp = torch.tensor([r.temperature for r in rows], dtype=logits.dtype)
        logits = logits / temp[:, None]
        top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows])
        top_p = torch.tensor([r.top_p for r in rows], dtype=logits.dtype)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            logits = _filter(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.min_p for r in rows], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            noise[i].exponential_(generator=r.generator or self.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int],
                  rows: list[SamplingRow]) -> list[dict[int, float] | None]:
        if raw is None:
            return [None] * len(rows)
        kmax = max(r.num_logprobs or 0 for r in rows)
        top_vals, top_ids = raw.topk(kmax, dim=-1) if kmax else (None, None)
        chosen = raw.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        out: list[dict[int, float] | None] = []
        for i, r in enumerate(rows):
            if r.num_logprobs is None:
                out.append(None)
                continue
            entry = {tokens[i]: chosen[i]}
            if r.num_logprobs:
                for tid, lp in zip(top_ids[i, : r.num_logprobs].tolist(),
                                   top_vals[i, : r.num_logprobs].tolist(), strict=True):
                    entry.setdefault(tid, lp)
            out.append(entry)
        return out
