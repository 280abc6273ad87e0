"""Perplexity of a token sequence as the engine serves it (its own weights, quantized or not,
its own KV cache dtype), from the prompt logprobs of `SamplingParams(prompt_logprobs=0)`.

The sequence is cut into non-overlapping windows of `window` tokens, each run as one prompt;
position p of a window predicts token p + 1, so a window of n tokens scores n - 1 of them
(the first token of each window has no prediction). Perplexity = exp(-mean log p) over all
scored tokens. Windows are submitted together, so the engine batches them as it would any
prompts (chunked prefill, `max_num_batched_tokens`); prefix caching never serves a prompt
position whose logprob is wanted, so a second run over the same text is recomputed.
`score(..., top1=True)` also returns the argmax token at every scored position (greedy
agreement under teacher forcing, for comparing two engines on the same text).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm import LLM


@dataclass(frozen=True)
class PerplexityResult:
    """`nll_sum`: sum of -log p (nats) over `num_scored` tokens; `perplexity`: its exp-mean.
    `top1`: with `score(..., top1=True)`, the engine's most likely token at each scored
    position (teacher-forced greedy choices, `num_scored` of them, in corpus order)."""

    nll_sum: float
    num_scored: int
    top1: tuple[int, ...] | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_scored)


def windows(token_ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping slices of `window` tokens; the last one may be shorter and
    is dropped when it has a single token (nothing to score)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    ids = list(token_ids)
    out = [ids[i : i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


def score(llm: LLM, token_ids: Sequence[int], window: int = 512,
          top1: bool = False) -> PerplexityResult:
    """Total negative log-likelihood of `token_ids` under `llm`, window by window (and with
    `top1`, the argmax token at every scored position, from `prompt_logprobs=1`).

    Raises ValueError for fewer than 2 tokens or a window not below the engine's context.
    """
    parts = windows(token_ids, window)
    if not parts:
        raise ValueError("need at least 2 tokens to measure perplexity")
    max_len = llm.engine.state.max_model_len
    if max(len(p) for p in parts) >= max_len:  # the prompt plus its one sampled token
        raise ValueError(f"window {window} must be below the engine's max_model_len {max_len}")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=int(top1))
    outputs = llm.generate(parts, params)
    nll, count, best = 0.0, 0, []
    for part, out in zip(parts, outputs, strict=True):
        entries = out.prompt_logprobs
        if entries is None or len(entries) != len(part) or entries[0] is not None:
            raise RuntimeError(f"engine returned {None if entries is None else len(entries)} "
                               f"prompt logprobs for a {len(part)}-token window")
        for target, entry in zip(part[1:], entries[1:], strict=True):
            nll -= entry[target]
            count += 1
            if top1:  # {target: lp} plus the top token when it is another one
                best.append(max(entry, key=entry.__getitem__))
    return PerplexityResult(nll, count, tuple(best) if top1 else None)


def perplexity(llm: LLM, token_ids: Sequence[int], window: int = 512) -> float:
    """exp(mean NLL) of `token_ids` under `llm` over non-overlapping `window`-token prompts."""
    return score(llm, token_ids, window).perplexity
