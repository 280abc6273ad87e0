"""A request's mutable state inside the engine (one per sample when n > 1)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.sampling_params import SamplingParams
from tandem.protocol.block_hash import BlockHash, HashKeys, hash_block, root_hash

if TYPE_CHECKING:
    from tandem.engine.structured_manager import RequestGrammar


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt already tokenized or checked (`EngineCore.process_prompt`): token ids within
    the vocabulary, and the text they came from, if any."""

    token_ids: list[int]
    text: str | None = None


@dataclass(frozen=True)
class ResumeState:
    """Output a request already produced on another worker (request migration by token
    replay): `token_ids` are its first output tokens, taken as generated (penalties,
    `max_tokens`/`min_tokens`, stop checks, a seeded generator, a grammar and the
    detokenizer all continue after them); `sent_chars` of their text (characters) the client
    already has (None: all of it). Delta outputs (`use_deltas`, as servers stream) carry
    only what comes after; cumulative ones include the replayed part."""

    token_ids: list[int]
    sent_chars: int | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    """Tokens, progress and KV bookkeeping of one sequence.

    `num_computed_tokens` counts tokens whose KV is in the cache (advanced by the
    scheduler after each step); `all_token_ids` = prompt + generated tokens.
    `num_placeholders` (0 or 1, `async_scheduling`): a sampled token still on the device;
    it counts in `num_tokens` (the next step computes it) but is in no token list until
    the engine commits it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, bounded by the context window
    eos_token_ids: tuple[int, ...] = ()
    hash_keys: HashKeys = field(default_factory=HashKeys)
    lora_name: str | None = None  # the LoRA adapter it runs with; None = the base model
    priority: int = 0  # lower is served first; ties by arrival
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None  # the user's request id when n > 1
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    arrival_seq: int = 0  # set by the scheduler: FCFS tie-breaker
    first_scheduled_time: float | None = None  # monotonic; end of its first wait
    first_token_time: float | None = None
    keep_kv: bool = False  # on a normal finish its blocks stay pinned (KV transfer source)
    block_hashes: list[BlockHash] = field(default_factory=list)
    # speculative decoding: tokens proposed to follow all_token_ids, verified by the next step
    # (not part of all_token_ids); `spec_draft_probs` [len, V] the distribution they were
    # drawn from (None: a point mass, e.g. n-gram)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: object | None = field(default=None, repr=False)
    # the next prompt position whose logits give a prompt logprob (that of the token after
    # it); None when none are wanted: not asked for, sample > 0 of n, or all emitted. A
    # preempted request that recomputes its prompt emits none twice.
    prompt_logprobs_pos: int | None = None
    num_placeholders: int = 0
    # structured outputs: this sample's grammar (compile future, then its matcher); None:
    # unconstrained. Not scheduled while its grammar compiles (structured_manager.py)
    grammar: RequestGrammar | None = field(default=None, repr=False)
    # leading output tokens replayed from another worker (`ResumeState`), not sampled here:
    # a seeded generator skips their draws, a grammar accepts them once compiled
    num_replayed: int = 0
    _root: BlockHash | None = field(default=None, repr=False)
    _max_hit: int = field(default=-1, repr=False)  # largest prompt prefix hit; -1: none yet
    _own: list[list[int]] = field(default_factory=list, repr=False)  # computed [start, end)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if (self.sampling_params.prompt_logprobs is not None and self.sample_index == 0
                and len(self.prompt_token_ids) > 1):
            self.prompt_logprobs_pos = 0

    def advance_prompt_logprobs(self, count: int) -> None:
        """`count` more prompt logprobs were emitted."""
        if self.prompt_logprobs_pos is not None:
            pos = self.prompt_logprobs_pos + count
            self.prompt_logprobs_pos = pos if pos < self.num_prompt_tokens - 1 else None

    # -- prompt accounting (usage's cached tokens) ------------------------------------------
    def note_admitted(self, num_hit: int) -> None:
        """An admission that starts with `num_hit` tokens served by the prefix cache."""
        if not self.output_token_ids:  # later admissions recompute prompt + output
            self._max_hit = max(self._max_hit, min(num_hit, self.num_prompt_tokens))

    def note_computed(self, start: int, end: int) -> None:
        """This request's own forward computed positions [start, end)."""
        end = min(end, self.num_prompt_tokens)
        if start >= end or self.output_token_ids:
            return
        own = self._own
        if own and own[-1][1] >= start and own[-1][0] <= start:  # the usual: it continues
            own[-1][1] = max(own[-1][1], end)
            return
        own.append([start, end])
        own.sort()
        merged = [own[0]]
        for lo, hi in own[1:]:
            if lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._own = merged

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens this request took from the prefix cache (or a KV import) and never
        computed itself, over all its admissions before its first token; -1 before its first
        admission. A preempted request's hits on blocks it computed itself do not count."""
        if self._max_hit < 0:
            return -1
        own = sum(max(0, min(hi, self._max_hit) - lo) for lo, hi in self._own
                  if lo < self._max_hit)
        return self._max_hit - own

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend `block_hashes` to cover every full block of `all_token_ids`."""
        if self._root is None:
            self._root = root_hash(self.hash_keys)
        tokens = self.all_token_ids
        while (len(self.block_hashes) + 1) * block_size <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else self._root
            self.block_hashes.append(
                hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
            )
        return self.block_hashes

    def parent_hash(self, block_index: int) -> BlockHash:
        """Hash before block `block_index` (the root for block 0)."""
        if self._root is None:
            self._root = root_hash(self.hash_keys)
        return self.block_hashes[block_index - 1] if block_index else self._root
