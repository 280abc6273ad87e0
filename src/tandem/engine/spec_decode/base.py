"""Proposer interface and registry: a proposer guesses up to k tokens per request; the target
model verifies them (`rejection.py`), so a proposer only affects speed, never outputs.

A proposer is built once per engine from a `ProposerContext`. Each step, after the
target's tokens are committed, the engine calls `propose` for the requests that may
speculate, with the number of tokens each may get (`policy.py`). A proposer keeps whatever
per-request state it needs (a draft model's KV cache, say) and reconciles it itself with
`req.all_token_ids` at the next call: tokens it proposed that were rejected are simply no
longer there (the longest common prefix is what survived).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.spec_decode.config import SpeculativeConfig
    from tandem.engine.spec_decode.target import TargetHeads


@dataclass
class Proposal:
    """Up to k proposed tokens for one request; `draft_probs` [len(token_ids), V] float32 on
    the target's device is the distribution each token was drawn from (after the request's
    temperature / top-k / top-p), or None when the proposal is deterministic (n-gram, greedy
    drafts): verification then treats it as a point mass."""

    token_ids: list[int]
    draft_probs: Any | None = None  # torch.Tensor | None


@dataclass(frozen=True)
class DraftCost:
    """A proposer's measured costs, in seconds: a draft round (one batched forward for the
    requests of a `propose` call) takes `round_s + row_s * rows`; catching a request up over
    tokens the draft has not seen yet (a prompt, the output of steps it did not draft)
    takes `catchup_token_s` per token."""

    round_s: float
    row_s: float = 0.0
    catchup_token_s: float = 0.0


@dataclass
class ProposerContext:
    """What a proposer may use of the engine it serves (set by `LLMEngine`).

    A proposer runs on rank 0 only, unsharded, whatever the tensor-parallel size (vLLM's
    `draft_tensor_parallel_size=1`): its weights and KV cache live on rank 0's `device`.
    `target` is the whole target model with one rank (self-drafts and heads share its
    weights) and None with tensor parallelism, where rank 0 holds a shard whose embedding,
    LM head and row-parallel layers run collectives the other ranks would not join; a
    sharded model here is a ValueError. `heads()` is the target's full-vocabulary
    embedding and LM head either way."""

    config: SpeculativeConfig
    engine_config: Any  # tandem.engine.config.EngineConfig
    target: Any  # the whole target LlamaForCausalLM, or None (tensor parallelism, tests)
    model_path: str  # the target's resolved .gguf file or HF directory
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    vocab_size: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    _heads: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.target is not None:
            from tandem.engine.spec_decode.target import check_whole

            check_whole(self.target)

    def heads(self) -> TargetHeads:
        """The target's whole-vocabulary embedding and LM head: `target`'s own modules, or
        without it an unsharded copy read from `model_path` onto `device` (once)."""
        if self._heads is None:
            from tandem.engine.spec_decode.target import heads_of, load_heads

            self._heads = (heads_of(self.target) if self.target is not None
                           else load_heads(self.model_path, self.device, self.dtype))
        return self._heads


class Proposer(ABC):
    """Guesses the next tokens of requests; stateless ones ignore `release`."""

    #: True when `propose` wants the target's last-layer hidden states (EAGLE/MTP heads):
    #: the runner then fills `RunnerOutput.hidden_states`
    needs_hidden_states: bool = False

    @abstractmethod
    def propose(self, requests: list[Request], num_tokens: list[int],
                hidden_states: dict[str, Any] | None = None) -> list[Proposal | None]:
        """At most `num_tokens[i]` (>= 1) tokens to follow `requests[i].all_token_ids`; None or
        an empty proposal when there is no guess. `hidden_states`: request id -> [n, H]
        hidden states of the positions the last step sampled (only with
        `needs_hidden_states`)."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional for stateless ones
        """Forget the request (finished, aborted or preempted)."""

    def round_cost(self) -> DraftCost | None:
        """What drafting costs on this machine; None: drafting is free (n-gram lookup)."""
        return None

    def catchup_tokens(self, request: Request) -> int:
        """Tokens of `request` the proposer must run before it can propose, beyond what a
        draft round covers (0 for stateless proposers)."""
        return 0


PROPOSERS: dict[str, Callable[[ProposerContext], Proposer]] = {}


def register_proposer(name: str) -> Callable[[Any], Any]:
    """Class decorator: `@register_proposer("ngram")` on a `Proposer(ctx)` subclass."""

    def wrap(cls: Any) -> Any:
        PROPOSERS[name] = cls
        return cls

    return wrap


def build_proposer(ctx: ProposerContext) -> Proposer:
    from tandem.engine.spec_decode import load_builtin_proposers

    load_builtin_proposers()
    return PROPOSERS[ctx.config.method](ctx)
