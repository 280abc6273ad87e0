"""The engine's side of speculative decoding (torch-free): which requests speculate, how many
tokens each proposes (`SpecPolicy`), the proposer call, and vLLM's spec-decode counters.

A request speculates when a proposer is configured, its `SamplingParams.speculative` is
true, it uses no repetition/presence/frequency penalty (their counts would have to follow
every draft position), no prompt logprobs are pending, and it is decode-ready (its prompt is
computed). Drafts never exceed what the request may still emit: k <= max_tokens − outputs − 1
and its last draft's position stays inside the context window.

A request with a structured-output grammar speculates too: the model runner masks each
verified position with the grammar state after the drafts before it, so a draft the
grammar forbids is always rejected (its target probability is 0) and the token drawn there
is one the grammar allows; greedy outputs equal those without speculation. Point-mass
drafts (n-gram, greedy draft models) are also cut here to the longest prefix the grammar
allows (`GrammarMatcher.validate_tokens`), which changes nothing but the wasted positions
(a point mass's rejection draws from the target's own distribution). Drafts with
probabilities are never cut: that would bias rejection sampling. A request still reasoning
before its grammar applies (`SamplingParams.reasoning_end_token_ids`) does not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.request import Request, RequestStatus
from tandem.engine.spec_decode.base import Proposer
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.engine.spec_decode.policy import SpecPolicy
from tandem.engine.structured_manager import valid_drafts


@dataclass(frozen=True)
class SpecStats:
    """Cumulative counters (vLLM's `vllm:spec_decode_*`)."""

    num_drafts: int  # verification runs (requests x steps that carried drafts)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # accepted drafts at position 0 .. k-1


def may_speculate(req: Request) -> bool:
    sp = req.sampling_params
    return (sp.speculative and req.prompt_logprobs_pos is None
            and sp.repetition_penalty == 1.0 and not sp.presence_penalty
            and not sp.frequency_penalty
            and (req.grammar is None or req.grammar.active))  # not while it still reasons


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = SpecPolicy(config)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos = [0] * config.num_speculative_tokens

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts kept the first `accepted`."""
        self._drafts += 1
        self._draft_tokens += proposed
        self._accepted += accepted
        for j in range(accepted):
            self._per_pos[j] += 1
        self.policy.observe(request_id, proposed, accepted)

    def observe_step(self, seconds: float, tokens: int) -> None:
        """The target's step of `tokens` tokens took `seconds` (wall, device synchronised):
        the policy's cost of a draft round against a target step."""
        self.policy.observe_timing(seconds, tokens, self.proposer.round_cost())

    def propose(self, running: list[Request], hidden_states: dict[str, Any]) -> None:
        """Set `spec_token_ids` (and `spec_draft_probs`) of the running requests that may
        speculate next step; the others get none."""
        batch = min(sum(r.num_tokens - r.num_computed_tokens for r in running),
                    self.max_num_batched_tokens)
        ready = []
        for r in running:
            r.spec_token_ids, r.spec_draft_probs = [], None
            if (r.status is RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1
                    and may_speculate(r)):
                cap = min(r.max_tokens - r.num_output_tokens - 1,
                          self.max_model_len - r.num_tokens)
                if cap > 0:
                    ready.append((r, cap))
        if not ready:
            return
        ks = self.policy.choose([r.request_id for r, _ in ready], batch,
                                [self.proposer.catchup_tokens(r) for r, _ in ready],
                                [r.max_tokens - r.num_output_tokens for r, _ in ready])
        asks = [(r, min(k, cap)) for (r, cap), k in zip(ready, ks, strict=True)
                if min(k, cap) > 0]
        if not asks:
            return
        hidden = None
        if self.proposer.needs_hidden_states:
            hidden = {r.request_id: hidden_states[r.request_id] for r, _ in asks
                      if r.request_id in hidden_states}
        proposals = self.proposer.propose([r for r, _ in asks], [k for _, k in asks], hidden)
        for (r, k), p in zip(asks, proposals, strict=True):
            if p is not None and p.token_ids:
                drafts = list(p.token_ids[:k])
                probs = p.draft_probs
                if probs is None:  # point masses: a draft the grammar refuses is cut here
                    drafts = drafts[:valid_drafts(r, drafts)]  # (all without a grammar)
                r.spec_token_ids = drafts
                r.spec_draft_probs = (None if probs is None
                                      else probs[: len(r.spec_token_ids)])

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
        self.policy.release(request_id)

    def stats(self) -> SpecStats:
        return SpecStats(self._drafts, self._draft_tokens, self._accepted,
                         tuple(self._per_pos))
