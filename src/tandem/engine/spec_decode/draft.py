"""`draft`: a smaller model sharing the target's tokenizer proposes the next k tokens.

`speculative_config.model` is a .gguf file or an HF directory, or "self": the target's own
file again, quantized by `draft_quantization` and/or truncated to its first
`draft_num_layers` layers. "self" without a quantization of its own (none, or the target's)
is a view of the target's first layers, final norm and LM head: no weight is loaded twice.
With tensor parallelism the draft runs on rank 0 alone, unsharded (vLLM's
`draft_tensor_parallel_size=1`): "self" then loads the target's file again, whole, in the
target's quantization unless `draft_quantization` names another (rank 0's shard runs
collectives the draft must not enter).

The draft keeps its own paged KV cache (`draft_runner.DraftKV`, the engine's block size,
sized for `max_num_seqs` sequences of `max_model_len` tokens up to `DRAFT_KV_BYTES`). The
engine builds the proposer before it sizes its own KV pool, so on CUDA the draft's weights
and KV cache count within `gpu_memory_utilization`. At each
`propose` a request's draft KV is cut to its longest common prefix with `all_token_ids`
(rejected drafts are gone), the tokens after it are run through the draft (in chunks of at
most `max_num_batched_tokens`), then k - 1 single-token steps follow; every step is one
forward for all the call's requests. A request the pool cannot serve takes the blocks of
least-recently proposed requests outside the call (their draft KV is recomputed when they
come back); if that is not enough it gets no proposal this time. Nothing else is evicted.

A request with a structured-output grammar drafts under it: each draft position's logits
are masked with its matcher's state after the drafts before it (accepted into the matcher
as they are chosen, rolled back at the end of `propose`), so its drafts are ones the grammar
allows. Greedy requests get the draft's argmax and `draft_probs` None; random ones a sample of the
draft's distribution after the request's temperature / top-k / top-p / min-p, with that
distribution as `draft_probs` [k, V] float32 (what rejection sampling needs for exactness).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.sampler import SamplingRow, processed_probs, sampling_params
from tandem.engine.spec_decode.base import (
    DraftCost,
    Proposal,
    Proposer,
    ProposerContext,
    register_proposer,
)
from tandem.engine.spec_decode.draft_runner import DraftKV, DraftSeq, load_model, truncated_view
from tandem.engine.spec_decode.policy import StepCostFit
from tandem.engine.staging import download
from tandem.engine.structured_manager import constrained, mask_logits

if TYPE_CHECKING:
    from tandem.engine.request import Request

DRAFT_KV_BYTES = 1 << 30  # at most this much draft KV cache (one max_model_len sequence fits)
_GREEDY_BELOW = 1e-5  # as the sampler's
_ROUND_ROWS = 8  # a catch-up of at most this many tokens per request times as a round
_CALIBRATION_TOKENS = 64  # a catch-up of this many tokens is timed at start
_CALIBRATION_WEIGHT = 8  # each calibration size counts as this many rounds in the fit,
# for good: it keeps the per-row slope known while live rounds all have one size
_CALIBRATION_REPEATS = 3  # rounds timed per size at start (the median counts)


@dataclass
class _Row:
    """One request of a `propose` call."""

    req: Request
    seq: DraftSeq
    k: int
    pending: list[int]  # tokens still to run before the first proposal
    row: SamplingRow | None  # None = greedy
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    grammar_steps: int = 0  # drafts its grammar's matcher accepted (rolled back after)


@register_proposer("draft")
class DraftProposer(Proposer):
    """`shared`: the draft is a view of the target's weights; `kv_bytes`: the draft KV
    cache's size (allocated here, before the target's pool is sized; `kv_bytes` bounds it)."""

    def __init__(self, ctx: ProposerContext, kv_bytes: int = DRAFT_KV_BYTES) -> None:
        spec, cfg = ctx.config, ctx.engine_config
        self.device, self.vocab_size = ctx.device, ctx.vocab_size
        if spec.model is None:
            raise ConfigError("speculative_config.model is required for method 'draft'")
        target_q = getattr(cfg, "quantization", None)
        self.shared = (ctx.target is not None and spec.model == "self"
                       and spec.draft_quantization in (None, target_q))
        if self.shared:
            target = ctx.target
            self.model = truncated_view(target, spec.draft_num_layers or len(target.layers))
            backend = target.layers[0].self_attn.backend
        else:  # with tensor parallelism "self" is the target's file again, whole, on rank 0
            path, quant = spec.model, spec.draft_quantization
            if spec.model == "self":
                path, quant = ctx.model_path, quant if quant is not None else target_q
            self.model, backend = load_model(path, cfg, ctx.device, ctx.dtype, ctx.max_model_len,
                                             ctx.block_size, spec.draft_num_layers, quant)
        arch = self.model.config
        if arch.vocab_size != ctx.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({arch.vocab_size} tokens) differs "
                              f"from the target's ({ctx.vocab_size}): they must share a "
                              "tokenizer")
        self.max_len = min(ctx.max_model_len, self.model.rope.max_positions)
        bs = ctx.block_size
        per_block = backend.bytes_per_block() * arch.num_layers
        one = cdiv(self.max_len, bs)
        num_blocks = min(ctx.max_num_seqs * one, max(one, kv_bytes // per_block))
        self.kv = DraftKV(backend, arch.num_layers, num_blocks, bs)
        self.kv_bytes = num_blocks * per_block
        self.chunk = max(1, getattr(cfg, "max_num_batched_tokens", 1024))
        self.generator = torch.Generator(device=ctx.device).manual_seed(
            getattr(cfg, "seed", 0) + 0x5EED)
        self.generators: dict[str, torch.Generator] = {}
        self._round_s: float | None = None  # seconds per draft round (EMA)
        self._rounds = StepCostFit(max_tokens=1 << 30)  # seconds against rows
        self._token_s = 0.0  # seconds per caught-up token (EMA)
        self._calibrate(min(_ROUND_ROWS, max(1, ctx.max_num_seqs)))

    def round_cost(self) -> DraftCost | None:
        """A draft round's seconds as round_s + row_s * rows: a least-squares line once
        rounds of several batch sizes were timed (the start's calibration seeds it), else
        (EMA, 0); a catch-up token's seconds (EMA). Timed: the single-token rounds, the
        catch-up forward when it runs only a few accepted tokens per request (a round), and
        longer catch-ups (per token)."""
        line = self._rounds.line()
        if line is not None:
            return DraftCost(line[0], line[1], self._token_s)
        return None if self._round_s is None else DraftCost(self._round_s, 0.0, self._token_s)

    def catchup_tokens(self, request: Request) -> int:
        """Tokens to run before drafting, when more than a round's few accepted ones."""
        ids = request.all_token_ids
        pending = len(ids) - self.kv.known(request.request_id, ids)
        return pending if pending > _ROUND_ROWS else 0

    def _calibrate(self, rows: int) -> None:
        """Time a catch-up of `_CALIBRATION_TOKENS` tokens and single-token rounds of 1 and
        `rows` requests on throwaway sequences (the second of two runs of each, the first
        warms up; a round size's time is the median of `_CALIBRATION_REPEATS`), so the policy
        knows what drafting costs before the first real round. The rounds stay in the cost
        fit as a prior (`StepCostFit.add_prior`)."""
        n = min(_CALIBRATION_TOKENS, self.max_len - 1 - 2 * _CALIBRATION_REPEATS)
        if n < 2:
            return
        span = n + 1 + 2 * _CALIBRATION_REPEATS  # tokens a sequence reaches (first: 1 + n + 2R)
        seqs = [f"\x00calibrate-{i}" for i in range(rows)]
        need = cdiv(span, self.kv.block_size) * rows
        if self.kv.num_free_blocks() < need:
            return
        try:
            for repeats in (1, _CALIBRATION_REPEATS):  # a warm-up pass, then the timed one
                states = [self.kv.reconcile(rid, [1]) for rid in seqs]
                for st in states:
                    self.kv.reserve(st, span, set(seqs))
                t0 = time.perf_counter()
                self.kv.forward(self.model, self.device, [(states[0], [1] * n)])[0].tolist()
                token_s = (time.perf_counter() - t0) / n
                for st in states[1:]:
                    self.kv.forward(self.model, self.device, [(st, [1] * n)])
                times = []
                for size in (1, rows):
                    took = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        self.kv.forward(self.model, self.device,
                                        [(st, [1]) for st in states[:size]])[0].tolist()
                        took.append(time.perf_counter() - t0)
                    times.append((size, statistics.median(took)))
                for rid in seqs:
                    self.kv.release(rid)
        finally:
            for rid in seqs:
                self.kv.release(rid)
        self._token_s = token_s
        for size, took in times if rows > 1 else ():
            self._rounds.add_prior(size, took, _CALIBRATION_WEIGHT)
        self._round_s = times[0][1]

    def _timed(self, t0: float, rows: int) -> None:
        """A round of `rows` requests since `t0` ended (`_choose` ends in a device-to-host
        copy: synchronised)."""
        took = time.perf_counter() - t0
        self._rounds.add(rows, took)
        self._round_s = took if self._round_s is None else (
            self._round_s + 0.1 * (took - self._round_s))

    def release(self, request_id: str) -> None:
        self.kv.release(request_id)
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        """Seeded requests draw their drafts from a generator of their own (derived from the
        seed, never the target's), so their outputs do not depend on the batch."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed * 1000003 + 0x5EED)
            self.generators[req.request_id] = gen
        return gen

    def propose(self, requests: list[Request], num_tokens: list[int],
                hidden_states: dict[str, Any] | None = None) -> list[Proposal | None]:
        rows: list[_Row | None] = []
        try:
            return self._propose(requests, num_tokens, rows)
        finally:  # a grammar's matcher is back where the request's own tokens left it
            for r in rows:
                if r is not None and r.grammar_steps:
                    r.req.grammar.matcher.rollback(r.grammar_steps)  # type: ignore[union-attr]

    def _propose(self, requests: list[Request], num_tokens: list[int],
                 rows: list[_Row | None]) -> list[Proposal | None]:
        protected = {r.request_id for r in requests}
        for req, want in zip(requests, num_tokens, strict=True):
            ids = req.all_token_ids
            k = min(want, self.max_len - len(ids))
            if k < 1 or not ids:
                rows.append(None)
                continue
            seq = self.kv.reconcile(req.request_id, ids)
            if not self.kv.reserve(seq, len(ids) + k - 1, protected):
                rows.append(None)
                continue
            sp = req.sampling_params
            row = None if sp.temperature < _GREEDY_BELOW else SamplingRow(
                temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                generator=None, banned_token_ids=(), prompt_token_ids=(),
                output_token_ids=(), num_logprobs=None)
            rows.append(_Row(req, seq, k, ids[len(seq.tokens):], row,
                             self._generator(req) if row else None))
        live = [r for r in rows if r is not None]
        while waiting := [r for r in live if r.pending]:  # catch up, chunk by chunk
            budget, batch = self.chunk, []
            for r in sorted(waiting, key=lambda r: len(r.pending) != 1):
                if budget == 0:
                    break
                take = min(len(r.pending), budget)
                batch.append((r, r.pending[:take]))
                del r.pending[:take]
                budget -= take
            t0 = time.perf_counter()
            logits = self.kv.forward(self.model, self.device, [(r.seq, t) for r, t in batch])
            done = [i for i, (r, _) in enumerate(batch) if not r.pending]
            ran = sum(len(t) for _, t in batch)
            if done:
                self._choose(logits[done] if len(done) < len(batch) else logits,
                             [batch[i][0] for i in done], 0)
            else:
                download(logits[:1, :1])  # synchronise before timing
            if len(done) == len(batch) and ran <= _ROUND_ROWS * len(batch):
                self._timed(t0, len(batch))  # a few accepted tokens each: a round
            elif ran > _ROUND_ROWS * len(batch):
                per = (time.perf_counter() - t0) / ran
                self._token_s = per if not self._token_s else (
                    self._token_s + 0.1 * (per - self._token_s))
        for step in range(1, max((r.k for r in live), default=0)):
            t0 = time.perf_counter()
            batch = [r for r in live if r.k > step]
            logits = self.kv.forward(self.model, self.device,
                                     [(r.seq, [r.tokens[-1]]) for r in batch])
            self._choose(logits, batch, step)
            self._timed(t0, len(batch))
        return [None if r is None else Proposal(
            r.tokens, None if r.row is None else torch.stack(r.probs)) for r in rows]

    def _choose(self, logits: torch.Tensor, rows: list[_Row], step: int) -> None:
        """Each row's draft token at draft position `step` from its logits [R, V]."""
        logits = logits.float()
        device = logits.device
        bans = [(i, t) for i, r in enumerate(rows)
                if r.req.num_output_tokens + step < r.req.sampling_params.min_tokens
                for t in (*r.req.eos_token_ids, *(r.req.sampling_params.stop_token_ids or ()))
                if 0 <= t < logits.shape[-1]]
        if bans:
            at = torch.tensor(bans, dtype=torch.int64, device=device)
            logits = logits.index_put((at[:, 0], at[:, 1]),
                                      torch.tensor(float("-inf"), device=device))
        grammars = [(i, r.req.grammar.matcher) for i, r in enumerate(rows)
                    if constrained(r.req)]
        if grammars:  # drafts the request's grammar allows (the target's mask rejects others)
            logits = logits.clone()
            mask_logits(logits, grammars)
        rand = [i for i, r in enumerate(rows) if r.row is not None]
        tokens = logits.argmax(dim=-1)
        if rand:
            at = torch.tensor(rand, dtype=torch.int64, device=device)
            srows = [rows[i].row for i in rand]
            probs = processed_probs(logits.index_select(0, at),
                                    sampling_params(srows, logits.shape[-1], device), srows)
            probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p masks unnormalised
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for j, i in enumerate(rand):
                if rows[i].generator is not None:
                    noise[j].exponential_(generator=rows[i].generator)
            tokens = tokens.index_copy(0, at, (probs / noise).argmax(dim=-1))
            for j, i in enumerate(rand):
                rows[i].probs.append(probs[j])
        for r, t in zip(rows, download(tokens).tolist(), strict=True):
            r.tokens.append(int(t))
            if constrained(r.req) and r.grammar_steps == step and (
                    r.req.grammar.matcher.accept_tokens([int(t)])):  # type: ignore[union-attr]
                r.grammar_steps += 1
