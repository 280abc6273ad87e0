"""Batched sampling: penalties, min-tokens, temperature, top-k / top-p / min-p, logprobs.

Rows are sequences that sample this step. Random rows draw with the exponential race
(`argmax(p / E)`, `E ~ Exp(1)`), which equals sampling from `p`; a seeded request draws its
noise from its own `torch.Generator`, so its tokens do not depend on the batch around it.
Logprobs are those of the raw model distribution (before any processing), as in vLLM; a
structured-output row's logits arrive with its grammar's mask applied (vLLM's order too),
so its disallowed tokens' logprobs are -inf, reported as `LOGPROB_FLOOR` (vLLM's -9999.0: an
API answer must stay finite JSON).

Every tensor lives on the logits' device. A step uploads its parameters as one float
buffer and its indices as one int buffer (pinned, non-blocking on CUDA), draws the noise of
all unseeded rows with one `exponential_` (one per seeded row, from its generator), applies
penalties and bans to the whole batch at once, and brings back tokens and logprobs with one
device-to-host copy. Penalty counts are kept per request across steps (`TokenCounts`), so
a step uploads only the tokens generated since the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from tandem.engine.penalties import TokenCounts, penalise
from tandem.engine.staging import IndexUploads, download, upload

_NEG_INF = float("-inf")
LOGPROB_FLOOR = -9999.0  # what a -inf logprob (a token a grammar forbids) is reported as
_GREEDY_BELOW = 1e-5  # temperature under which a row is greedy (SamplingParams.greedy)
# rows of the per-step float parameter buffer
_TEMP, _TOP_K, _TOP_P, _MIN_P, _REP, _PRES, _FREQ = range(7)


@dataclass
class SamplingRow:
    """What the sampler needs of one row (plain values; token lists by reference)."""

    temperature: float
    top_k: int  # <= 0 disables
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    generator: torch.Generator | None  # seeded: the request's, on the logits' device
    banned_token_ids: tuple[int, ...]  # suppressed this step (min_tokens not reached)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # appended to in place between steps
    num_logprobs: int | None  # top-k logprobs wanted, None = none
    key: str | None = None  # penalty state kept under it across steps (release it); None: none


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: list[dict[int, float] | None]  # per row: sampled + top-k tokens, or None


def raw_logprobs_of(logits: torch.Tensor) -> torch.Tensor:
    """Logprobs of float32 `logits` [N, V], at least `LOGPROB_FLOOR` (finite)."""
    return logits.log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR)


def _penalised(r: SamplingRow) -> bool:
    return r.repetition_penalty != 1.0 or bool(r.presence_penalty or r.frequency_penalty)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k, then outside the nucleus (top-p) of what
    top-k kept, renormalised (vLLM's and HF's order); logits [N, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, _NEG_INF).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before > top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_params(rows: Sequence[SamplingRow], vocab: int,
                    device: torch.device) -> torch.Tensor:
    """The rows' float parameters [7, N] on `device` in one upload (rows `_TEMP` ..
    `_FREQ`; top-k clamped to the vocabulary, <= 0 = the whole vocabulary)."""
    return upload(list(chain(
        (r.temperature for r in rows),
        (float(min(r.top_k, vocab) if r.top_k > 0 else vocab) for r in rows),
        (r.top_p for r in rows), (r.min_p for r in rows),
        (r.repetition_penalty for r in rows), (r.presence_penalty for r in rows),
        (r.frequency_penalty for r in rows),
    )), torch.float32, device).view(7, len(rows))


def processed_probs(logits: torch.Tensor, params: torch.Tensor,
                    rows: Sequence[SamplingRow]) -> torch.Tensor:
    """What random rows sample from: logits [R, V] float32 (bans and penalties applied),
    params [7, R] -> probs [R, V]: temperature, top-k, top-p, softmax, then min-p as a mask
    (not renormalised: the exponential race does not need it). `rows` only says which steps
    apply (the rows, or the distinct rows they repeat)."""
    vocab = logits.shape[-1]
    logits = logits / params[_TEMP][:, None]
    if any(0 < r.top_k < vocab or r.top_p < 1.0 for r in rows):
        logits = _filter(logits, params[_TOP_K], params[_TOP_P])
    probs = logits.softmax(dim=-1)
    if any(r.min_p > 0 for r in rows):
        keep = probs >= params[_MIN_P][:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs * keep
    return probs


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.counts = TokenCounts()
        self._generators: dict[torch.device, torch.Generator] = {}

    def release(self, key: str) -> None:
        """Forget the penalty state kept under `key` (its request finished)."""
        self.counts.release(key)

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on `device` (seeded with the engine's seed)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V] (any float dtype) -> one token per row."""
        tokens, raw_logprobs = self.sample(logits, rows)
        return self._finish(tokens, raw_logprobs, rows)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [N, V] -> the [N] int64 sampled ids, left on the device, and the raw
        logprobs [N, V] when a row wants logprobs (else None)."""
        n, vocab = logits.shape
        device = logits.device
        logits = logits.float()
        want_lp = any(r.num_logprobs is not None for r in rows)
        raw_logprobs = raw_logprobs_of(logits) if want_lp else None
        greedy = any(r.temperature < _GREEDY_BELOW for r in rows)
        unseeded = [i for i, r in enumerate(rows)
                    if r.temperature >= _GREEDY_BELOW and r.generator is None]
        seeded = [i for i, r in enumerate(rows)
                  if r.temperature >= _GREEDY_BELOW and r.generator is not None]
        penalised = [i for i, r in enumerate(rows) if _penalised(r)]
        bans = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if 0 <= t < vocab]

        ints = IndexUploads()
        order_part = ints.add(unseeded + seeded)
        ban_rows, ban_tokens = ints.add([i for i, _ in bans]), ints.add([t for _, t in bans])
        plan = self.counts.plan(rows, penalised, vocab, device, ints) if penalised else None
        idx = ints.upload(device) if any(ints.parts) else []
        params = None
        if penalised or unseeded or seeded:
            params = sampling_params(rows, vocab, device)

        if bans:
            logits = logits.index_put((idx[ban_rows], idx[ban_tokens]),
                                      torch.full((), _NEG_INF, dtype=logits.dtype, device=device))
        if plan is not None:
            counts, in_prompt = self.counts.apply(plan, idx)
            rep = any(r.repetition_penalty != 1.0 for r in rows)
            add = any(r.presence_penalty or r.frequency_penalty for r in rows)
            logits = penalise(logits, counts, in_prompt, params[_REP] if rep else None,
                              params[_PRES] if add else None, params[_FREQ] if add else None)

        tokens = (logits.argmax(dim=-1) if greedy
                  else torch.empty(n, dtype=torch.int64, device=device))
        if unseeded or seeded:
            order = idx[order_part]
            sampled = self._sample(logits.index_select(0, order), params.index_select(1, order),
                                   [rows[i] for i in unseeded + seeded], len(unseeded))
            tokens.index_copy_(0, order, sampled)
        return tokens, raw_logprobs

    def _sample(self, logits: torch.Tensor, params: torch.Tensor, rows: list[SamplingRow],
                num_unseeded: int) -> torch.Tensor:
        """Random rows, unseeded first: logits [R, V], params [7, R] -> tokens [R]."""
        probs = processed_probs(logits, params, rows)
        noise = torch.empty_like(probs)
        if num_unseeded:
            noise[:num_unseeded].exponential_(generator=self.generator(probs.device))
        for j in range(num_unseeded, len(rows)):
            noise[j].exponential_(generator=rows[j].generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _finish(tokens: torch.Tensor, raw: torch.Tensor | None,
                rows: list[SamplingRow]) -> SamplerOutput:
        """One device-to-host copy of tokens, chosen logprobs and top-k; then host slicing."""
        if raw is None:
            return SamplerOutput(download(tokens).tolist(), [None] * len(rows))
        kmax = min(max(r.num_logprobs or 0 for r in rows), raw.shape[-1])
        cols = [tokens[:, None].double(), raw.gather(1, tokens[:, None]).double()]
        if kmax:
            top_vals, top_ids = raw.topk(kmax, dim=-1)
            cols += [top_ids.double(), top_vals.double()]
        host = download(torch.cat(cols, dim=1)).tolist()
        token_ids = [int(h[0]) for h in host]
        out: list[dict[int, float] | None] = []
        for r, h in zip(rows, host, strict=True):
            if r.num_logprobs is None:
                out.append(None)
                continue
            entry = {int(h[0]): h[1]}
            k = min(r.num_logprobs, kmax)
            for tid, lp in zip(h[2 : 2 + k], h[2 + kmax : 2 + kmax + k], strict=True):
                entry.setdefault(int(tid), lp)
            out.append(entry)
        return SamplerOutput(token_ids, out)
