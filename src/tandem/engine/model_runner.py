"""Turns a `SchedulerOutput` into model inputs, runs the forward pass and samples.

Inputs are flattened: the new tokens of every scheduled request back to back (decodes
first), with their positions and KV slots. Logits are computed only for rows that sample
and for prompt positions whose logprobs were requested.

A `LayerObserver` registered for a request (`observe`) hears, on the engine thread, about
the step that completes its prompt: its block table before the forward, then each layer
once that layer's K/V are written, so a KV transfer can send finished layers while later
ones compute.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tandem.engine.attention.base import AttentionBackend, BatchLayout
from tandem.engine.core import RunnerOutput
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.scheduler import SchedulerOutput


class LayerObserver(Protocol):
    """Called on the engine thread during the step that computes a prompt's last tokens."""

    def begin(self, block_ids: list[int]) -> None:
        """Before the forward: the request's whole block table (a copy)."""

    def layer_done(self, layer: int, event: Any | None) -> None:
        """`layer`'s K/V for the step are written (in order, every layer once); `event` is
        a CUDA event to wait on before reading them on another stream, None on the CPU."""


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv: KVCacheManager,
                 sampler: Sampler, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.kv = kv
        self.sampler = sampler
        self.device = device
        self.block_size = kv.block_size
        self.generators: dict[str, torch.Generator] = {}
        # request id -> observer; set from other threads (one dict operation each)
        self.observers: dict[str, LayerObserver] = {}

    def observe(self, request_id: str, observer: LayerObserver) -> None:
        """Register before the request is added; `unobserve` when done with it."""
        self.observers[request_id] = observer

    def unobserve(self, request_id: str) -> None:
        self.observers.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def _row(self, req: Request) -> SamplingRow:
        sp = req.sampling_params
        banned: tuple[int, ...] = ()
        if req.num_output_tokens < sp.min_tokens:
            banned = tuple(req.eos_token_ids) + tuple(sp.stop_token_ids or ())
        return SamplingRow(
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, generator=self._generator(req),
            banned_token_ids=banned, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids, num_logprobs=sp.logprobs,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []  # decodes as ints, then prefill chunks as tensors
        slots: list[int] = []
        chunk_pos: list[torch.Tensor] = []
        chunk_slots: list[torch.Tensor] = []
        query_lens, seq_lens, tables = [], [], []
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        plp: list[tuple[Request, int, int, int]] = []  # (request, first position, flat, count)
        watching: list[LayerObserver] = []
        # decodes first (the scheduler's order), sorted by context length so the attention
        # backend can group similar lengths and pad little
        scheduled = sched.scheduled
        nd = sum(1 for s in scheduled if s.num_new_tokens == 1)
        scheduled = sorted(scheduled[:nd], key=lambda s: s.start) + scheduled[nd:]
        for s in scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            table = self.kv.block_ids(req.request_id)
            offset = len(tokens)
            tokens.extend(req.all_token_ids[start : start + n])
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = torch.arange(start, start + n)
                chunk_pos.append(pos)
                chunk_slots.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            if s.samples:
                sample_idx.append(offset + n - 1)
                sample_reqs.append(req)
                observer = self.observers.get(req.request_id) if self.observers else None
                if observer is not None and req.num_output_tokens == 0:  # the prompt's end
                    observer.begin(list(table))
                    watching.append(observer)
            if req.prompt_logprobs_pos is not None:
                # position p predicts prompt token p + 1; positions whose logprobs were
                # emitted before a preemption are recomputed but not emitted again
                first = max(start, req.prompt_logprobs_pos)
                count = min(start + n, req.num_prompt_tokens - 1) - first
                if count > 0:
                    plp.append((req, first, offset + first - start, count))

        flat_plp = [flat + j for _, _, flat, count in plp for j in range(count)]
        slot_t = torch.cat([torch.tensor(slots, dtype=torch.int64), *chunk_slots])
        pos_t = torch.cat([torch.tensor(positions, dtype=torch.int64), *chunk_pos])
        layout = BatchLayout(query_lens, seq_lens, tables, slot_t, nd, bs)
        meta = self.backend.build_metadata(layout)
        logits = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            pos_t.to(self.device), self.kv_caches, meta,
            torch.tensor(sample_idx + flat_plp, dtype=torch.int64, device=self.device),
            on_layer=self._layer_signal(watching) if watching else None,
        )
        out = RunnerOutput()
        if sample_reqs:
            result = self.sampler(logits[: len(sample_reqs)],
                                  [self._row(r) for r in sample_reqs])
            for req, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs, strict=True):
                out.sampled[req.request_id] = tok
                if lp is not None:
                    out.logprobs[req.request_id] = lp
        if plp:
            self._prompt_logprobs(logits[len(sample_reqs):].float(), plp, out)
        return out

    def _layer_signal(self, observers: list[LayerObserver]):  # noqa: ANN202 - Callable
        cuda = self.device.type == "cuda"

        def signal(layer: int) -> None:
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            for observer in observers:
                observer.layer_done(layer, event)
        return signal

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, plp: list[tuple[Request, int, int, int]],
                         out: RunnerOutput) -> None:
        logprobs = logits.log_softmax(dim=-1)
        row = 0
        for req, first, _, count in plp:
            k = req.sampling_params.prompt_logprobs or 0
            targets = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + count])
            chunk = logprobs[row : row + count]
            chosen = chunk.gather(1, targets[:, None])[:, 0].tolist()
            top_v, top_i = chunk.topk(k, dim=-1) if k else (None, None)
            entries = []
            for j, tid in enumerate(targets.tolist()):
                entry = {tid: chosen[j]}
                if k:
                    for t, v in zip(top_i[j].tolist(), top_v[j].tolist(), strict=True):
                        entry.setdefault(t, v)
                entries.append(entry)
            out.prompt_logprobs[req.request_id] = entries
            row += count
