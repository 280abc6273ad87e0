"""Turns a `SchedulerOutput` into model inputs, runs the forward pass and samples.

Two layers, as vLLM's driver worker and its other workers: `rank_runner.RankRunner` (every
tensor-parallel rank runs a step's forward from its plan alone) and `ModelRunner` (rank 0,
or the only rank): `execute(sched)` builds the step's plan from the `SchedulerOutput`
(every decision that changes the forward made here, once), sends it to the other ranks,
runs its own `forward` and samples, verifies drafts and computes prompt logprobs.

Inputs are flattened: the new tokens of every scheduled request back to back (decodes
first), with their positions and KV slots. Logits are computed only for rows that sample
and for prompt positions whose logprobs were requested. Python work per step is
O(tokens scheduled): the block tables are one numpy copy out of the KV manager's persistent
`BlockTable` (no per-request lists), inputs are filled into numpy arrays and reach the
device as one int64 buffer (pinned, non-blocking on CUDA); results come back with one
device-to-host copy each (sampled tokens with their logprobs, prompt logprobs). Rows under
a structured-output grammar get their bitmask filled on another thread while the forward
runs (`structured_manager.BitmaskFiller`) and applied to the logits on their device before
sampling and verification; logprobs are then those of the masked logits, as in vLLM.
`ModelRunner.timings` accumulates the host seconds of each part of a step; `paths` counts
the steps replayed from the decode graphs and those run eagerly, by the first reason in
`EAGER_REASONS` that applies (`step_paths()`, exported as `tandem_engine_steps_total`).

A `LayerObserver` registered for a request (`observe`) hears, on the engine thread, about
the step that completes its prompt: its block table before the forward, then each layer
once that layer's K/V are written, so a KV transfer can send finished layers while later
ones compute. With one rank the observer reads the layer from the cache; with tensor
parallelism the step's plan says `save_layers` with the observed block tables, every rank
hands rank 0 its heads of those blocks right after writing each layer (one gloo gather per
layer, `kv_moves.LayerGather`) and the observer gets the assembled full-head pages.

The KV connector's worker side (`kv_connector`, `engine/kv_connector`) is called around every
step's forward: `start_load_kv` with the step's `ConnectorMetadata` before it,
`wait_for_layer_load(i)` before layer i attends in steps that load pages (every layer up
front when the step replays the decode graphs), `wait_for_save` after it. With tensor
parallelism the worker side writes full-head pages (`KVPageIO.write`): every layer is waited
for before the forward, then the pages go to every rank (`KVPageIO.flush`, a KV_SCATTER
plan) ahead of the step's own plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tandem.engine.attention.base import (
    AttentionBackend,
)
from tandem.engine.core import RunnerOutput, StepPathCount
from tandem.engine.kv_cache.groups import group_tables
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.parallel.kv_moves import LayerGather
from tandem.engine.parallel.plan import GroupTables, PlanKind, StepPlan
from tandem.engine.rank_runner import RankRunner
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.spec_decode.rejection import VerifyRequest, verify
from tandem.engine.staging import PendingOutput, download, start_download, upload
from tandem.engine.structured.bitmask import apply_bitmask
from tandem.engine.structured_manager import BitmaskFiller, mask_rows

if TYPE_CHECKING:
    from tandem.engine.kv_connector.base import KVConnectorWorker
    from tandem.engine.llm_engine import KVPageIO
    from tandem.engine.lora.manager import LoRAManager
    from tandem.engine.parallel.executor import Executor


@dataclass
class RunnerTimings:
    """Cumulative host wall seconds of rank 0's steps (`time.perf_counter`, no device
    sync added: on a GPU, `forward_s` is the launch time unless a copy waits):
    `prepare_s` building the step's plan (and sending it to the other ranks), `forward_s`
    uploading its inputs and running the forward pass, `sample_s` sampling, verification
    and prompt logprobs with their device-to-host copies; `steps` executed."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    steps: int = 0


GRAPH_REASON = "decode"  # the reason label of graph-replayed steps
# why a step ran eagerly, in the order checked (a step counts under the first that applies):
# the engine has no decode graphs; hidden states for a proposer (every step of an EAGLE
# engine); a LoRA adapter's token; speculative verification; prompt logprobs; a layer
# observer (KV streamed layer by layer); a prefill chunk in the batch (what capturing mixed
# batches would turn into graph steps); more decode rows than the largest captured size
EAGER_REASONS = ("disabled", "hidden_states", "lora", "spec_verify", "prompt_logprobs",
                 "layer_stream", "mixed", "too_large")


class StepPathCounter:
    """Cumulative steps and runner wall seconds per (path, reason); written by the engine
    thread, read by `snapshot` (a copy)."""

    def __init__(self) -> None:
        keys = [("graph", GRAPH_REASON)] + [("eager", r) for r in EAGER_REASONS]
        self.steps: dict[tuple[str, str], int] = dict.fromkeys(keys, 0)
        self.seconds: dict[tuple[str, str], float] = dict.fromkeys(keys, 0.0)

    def add(self, path: str, reason: str, seconds: float) -> None:
        self.steps[(path, reason)] += 1
        self.seconds[(path, reason)] += seconds

    def snapshot(self) -> tuple[StepPathCount, ...]:
        return tuple(StepPathCount(p, r, n, self.seconds[(p, r)])
                     for (p, r), n in list(self.steps.items()))


class LayerObserver(Protocol):
    """Called on the engine thread during the step that computes a prompt's last tokens."""

    def begin(self, block_ids: list[int]) -> None:
        """Before the forward: the request's whole block table (a copy)."""

    def layer_done(self, layer: int, event: Any | None,
                   pages: torch.Tensor | None = None) -> None:
        """`layer`'s K/V for the step are written (in order, every layer once); `event` is
        a CUDA event to wait on before reading them on another stream, None on the CPU.
        With tensor parallelism `pages` (passed by keyword, `event` None) holds the layer's
        `[2, n, KVH, bs, row]` pages of the `begin` blocks with every KV head, gathered from
        the ranks onto the host (the cache here holds only rank 0's heads)."""


class ModelRunner(RankRunner):
    """Rank 0's runner: plans each step, hands the plan to the other ranks, runs its own
    forward and samples."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv: KVCacheManager,
                 sampler: Sampler, device: torch.device,
                 executor: Executor | None = None) -> None:
        super().__init__(model, backend, kv_caches, device, kv.block_size)
        # the other tensor-parallel ranks: each step's plan is sent to them first
        self.executor = executor if executor is not None and executor.world > 1 else None
        # the whole model's architecture (LLMEngine sets it): which KV heads each rank holds
        self.arch: ModelArchConfig | None = None
        # full-head page reads and writes for the connector's worker side (LLMEngine sets it)
        self.kv_pages: KVPageIO | None = None
        self.kv = kv
        self.sampler = sampler
        self.generators: dict[str, torch.Generator] = {}
        # request id -> observer; set from other threads (one dict operation each)
        self.observers: dict[str, LayerObserver] = {}
        # the KV connector's worker side (`KVConnector.attach`): loads before each layer
        # attends, saves after the forward; None: no connector
        self.kv_connector: KVConnectorWorker | None = None
        # deliver last-layer hidden states (`RunnerOutput.hidden_states`) for a proposer that
        # reads them (EAGLE-style heads); set by LLMEngine
        self.return_hidden = False
        self._lora: LoRAManager | None = None
        self.timings = RunnerTimings()
        self._last: PendingOutput | None = None  # the latest step whose ids stay on the device
        self.paths = StepPathCounter()  # graph-replayed vs eager steps, by reason
        # structured outputs: the step's grammar bitmask, filled while the forward runs
        # (its width, the model's logits', is set by LLMEngine)
        self.bitmask = BitmaskFiller()

    @property
    def lora(self) -> LoRAManager | None:
        """Multi-LoRA adapters (engine/lora), set by LLMEngine with enable_lora."""
        return self._lora

    @lora.setter
    def lora(self, manager: LoRAManager | None) -> None:
        self._lora = manager
        self.adapters = None if manager is None else manager.slots

    def observe(self, request_id: str, observer: LayerObserver) -> None:
        """Register before the request is added; `unobserve` when done with it."""
        self.observers[request_id] = observer

    def unobserve(self, request_id: str) -> None:
        self.observers.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.sampler.release(request_id)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            # a resumed request (`ResumeState`): the draws its replayed tokens took, as the
            # sampler makes them (one [vocab] exponential_ per sampled token)
            if req.num_replayed and self.bitmask.vocab_size:
                noise = torch.empty(self.bitmask.vocab_size, device=self.device)
                for _ in range(req.num_replayed):
                    noise.exponential_(generator=gen)
            self.generators[req.request_id] = gen
        return gen

    def _row(self, req: Request) -> SamplingRow:
        sp = req.sampling_params
        banned: tuple[int, ...] = ()
        # a grammar decides where a structured output may end (min_tokens bans nothing)
        if req.grammar is None and req.num_output_tokens + req.num_placeholders < sp.min_tokens:
            banned = tuple(req.eos_token_ids) + tuple(sp.stop_token_ids or ())
        return SamplingRow(
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, generator=self._generator(req),
            banned_token_ids=banned, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids, num_logprobs=sp.logprobs,
            key=req.request_id,
        )

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Plan, forward (every rank), then sample, verify and compute prompt logprobs."""
        return self._execute(sched, defer=False).resolve()

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """As `execute`, but the sampled ids may stay on the device (their copy to the host
        started, not waited for): only when every sampling row is plain (no logprobs, no
        penalties that read output ids, no verification, no hidden states) and there is one
        rank; otherwise the output is complete at once. The next step's input for a request
        whose last token is such a pending id (`Request.num_placeholders`) is gathered on
        the device from this step's ids."""
        pending = self._execute(sched, defer=True)
        self._last = pending if pending.deferred else None
        return pending

    def _device_inputs(self, on_device: list[tuple[int, int]]) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """(flat input rows, their ids gathered from the last step's sampled ids on the
        device) for `on_device`'s (flat row, row in the last step's ids)."""
        last = self._last
        if last is None or last.sampled is None:
            raise RuntimeError("a decode input is pending but no step's ids are on the device")
        idx = upload([f for f, _ in on_device] + [r for _, r in on_device], torch.int64,
                     self.device)
        n = len(on_device)
        return idx[:n], last.sampled.index_select(0, idx[n:])

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput, defer: bool) -> PendingOutput:
        t_start = time.perf_counter()
        bs = self.block_size
        # one-token rows first, sorted by context length so the attention backend can group
        # similar lengths and pad little: plain decodes, and each verified request's k + 1
        # positions (causal rows of one sequence, each attending over its own context length
        # through the same block table); then prefill chunks
        single = sorted((s for s in sched.scheduled if s.num_new_tokens == 1 or s.spec_token_ids),
                        key=lambda s: s.start)
        chunks = [s for s in sched.scheduled if s.num_new_tokens > 1 and not s.spec_token_ids]
        scheduled = single + chunks
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        tokens = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        # the batch's block tables, gathered from the persistent one: [B, W] zero-padded
        table, table_lens = self.kv.block_table.gather(s.request.request_id for s in scheduled)
        units: list[tuple[int, int, int]] = []  # (position, scheduled index, token)
        pending_in: list[tuple[int, int]] = []  # (scheduled index, row in the last step's ids)
        for i, s in enumerate(single):
            known = s.request.all_token_ids[s.start : s.start + 1]
            if not known:  # its last token is still on the device (async scheduling)
                assert self._last is not None
                pending_in.append((i, self._last.rows[s.request.request_id]))
                known = [0]  # written on the device after the upload
            toks = known + s.spec_token_ids
            units.extend((s.start + j, i, t) for j, t in enumerate(toks))
        units.sort()
        nd = len(units)
        flat_of: dict[tuple[int, int], int] = {(i, p): f for f, (p, i, _) in enumerate(units)}
        self.device_tokens = None if not pending_in else self._device_inputs(
            [(flat_of[(i, single[i].start)], r) for i, r in pending_in])
        rows = [i for _, i, _ in units] + list(range(len(single), len(scheduled)))
        query_lens = [1] * nd + [s.num_new_tokens for s in chunks]
        seq_lens = [p + 1 for p, _, _ in units] + [s.start + s.num_new_tokens for s in chunks]
        if nd:
            tokens[:nd] = [t for _, _, t in units]
            positions[:nd] = [p for p, _, _ in units]
            dec_pos = positions[:nd]
            slots[:nd] = table[np.array(rows[:nd]), dec_pos // bs].astype(np.int64) * bs + (
                dec_pos % bs)
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        spec: list[tuple[ScheduledRequest, int]] = []  # (verified request, its first row)
        spec_idx: list[int] = []
        plp: list[tuple[Request, int, int, int]] = []  # (request, first position, flat, count)
        watching: list[LayerObserver] = []
        watched_tables: list[list[int]] = []  # each watched request's block table
        offset = nd
        for i, s in enumerate(scheduled):
            req, start, n = s.request, s.start, s.num_new_tokens
            if i < len(single):
                last = flat_of[(i, start)]
            else:  # only this chunk's tokens and the blocks it writes
                end = offset + n
                tokens[offset:end] = req.all_token_ids[start : start + n]
                pos = np.arange(start, start + n, dtype=np.int64)
                positions[offset:end] = pos
                b0 = start // bs
                blocks = table[i, b0 : (start + n - 1) // bs + 1].astype(np.int64)
                slots[offset:end] = blocks[pos // bs - b0] * bs + pos % bs
                last = end - 1
            if s.spec_token_ids:  # k + 1 rows: the last known token's and each draft's
                spec.append((s, len(spec_idx)))
                spec_idx.extend(flat_of[(i, start + j)]
                                for j in range(len(s.spec_token_ids) + 1))
            elif s.samples:
                sample_idx.append(last)
                sample_reqs.append(req)
                observer = self.observers.get(req.request_id) if self.observers else None
                if observer is not None and req.num_output_tokens == 0:  # the prompt's end
                    ids = table[i, : table_lens[i]].tolist()
                    observer.begin(list(ids))
                    watching.append(observer)
                    watched_tables.append(ids)
            if req.prompt_logprobs_pos is not None:
                # position p predicts prompt token p + 1; positions whose logprobs were
                # emitted before a preemption are recomputed but not emitted again
                first = max(start, req.prompt_logprobs_pos)
                count = min(start + n, req.num_prompt_tokens - 1) - first
                if count > 0:
                    flat = flat_of[(i, first)] if i < len(single) else offset + first - start
                    plp.append((req, first, flat, count))
            if i >= len(single):
                offset += n
        row_idx = np.array(rows, dtype=np.int64)
        table, table_lens = table[row_idx], table_lens[row_idx]
        tables = getattr(self.kv, "tables", None)
        # a hybrid model: group 0's are the tables and slots above (`block_table` is its)
        groups = () if tables is None else (GroupTables(slots, table, table_lens), *group_tables(
            tables[1:], [s.request.request_id for s in scheduled], row_idx, positions,
            np.repeat(row_idx, np.asarray(query_lens, dtype=np.int64)), bs))

        logits_idx = np.concatenate([np.array(sample_idx + spec_idx, dtype=np.int64)] + [
            np.arange(flat, flat + count, dtype=np.int64) for _, _, flat, count in plp])
        targets = [t for req, first, _, count in plp
                   for t in req.prompt_token_ids[first + 1 : first + 1 + count]]
        lora_slots = self._lora_slots(scheduled, rows, nd, len(single))
        # every decision that changes the forward is made here and travels in the plan
        eager = self._eager_reason(
            mixed=len(sample_reqs) + len(spec) < len(scheduled) or bool(chunks),
            lora=lora_slots is not None, spec=bool(spec), plp=bool(plp),
            watching=bool(watching), nd=nd)
        graphs = eager is None
        # with tensor parallelism the observed blocks' layers are gathered from the ranks
        saved = [b for ids in watched_tables for b in ids] if self.executor is not None else []
        plan = StepPlan(PlanKind.FORWARD, tokens, positions, slots, logits_idx,
                        np.asarray(query_lens, dtype=np.int64),
                        np.asarray(seq_lens, dtype=np.int64), table, table_lens, nd,
                        self.return_hidden,
                        lora_slots=np.empty(0, np.int64) if lora_slots is None else lora_slots,
                        graphs=graphs, block_ids=np.asarray(saved, dtype=np.int64),
                        save_layers=bool(saved), groups=groups)
        on_layer = self._layer_signal(watching, watched_tables) if watching else None
        mask = mask_rows(sample_reqs, spec)
        connector, meta = self.kv_connector, sched.kv_connector_meta
        if connector is not None and meta is not None:
            connector.start_load_kv(meta)
            if meta.loads and self.executor is not None:
                self._load_all(connector)  # every rank's heads are in before the plan goes
            elif meta.loads:
                on_layer = self._load_waits(connector, on_layer, plan.graphs)
        if self.executor is not None:  # the other ranks run the same forward
            self.executor.send(plan)
        t_forward = time.perf_counter()
        # the grammar bitmask is filled on its own thread while the forward runs
        fill = None if mask is None else self.bitmask.start(mask)
        try:  # one upload: tokens | positions | logits rows | prompt-logprob targets
            res = self.forward(plan, np.array(targets, dtype=np.int64), on_layer)
        except Exception as exc:  # a peer died, or this rank left its peers mid-step
            if self.executor is None:
                raise
            raise self.executor.failure(exc) from exc
        finally:
            self.device_tokens = None
            if fill is not None:
                fill.exception()  # the matchers are this thread's again
        if connector is not None and meta is not None:
            connector.wait_for_save()
        t_sample = time.perf_counter()
        logits, hidden, targets_t = res.logits, res.hidden, res.extra
        if fill is not None:  # before sampling and verification, on the logits' device
            apply_bitmask(logits, fill.result(), mask.rows)
        out = RunnerOutput()
        pending = PendingOutput(out)
        ns, nv = len(sample_reqs), len(spec_idx)
        if sample_reqs:
            sampling_rows = [self._row(r) for r in sample_reqs]
            if defer and mask is None and self._deferrable(sampling_rows, spec, hidden):
                ids, _ = self.sampler.sample(logits[:ns], sampling_rows)
                pending = PendingOutput(out, ids, {r.request_id: i for i, r in enumerate(
                    sample_reqs)}, start_download(ids))
            else:
                result = self.sampler(logits[:ns], sampling_rows)
                for req, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs,
                                        strict=True):
                    out.sampled[req.request_id] = tok
                    if lp is not None:
                        out.logprobs[req.request_id] = lp
        if spec:
            self._verify(logits[ns : ns + nv], spec, out)
        if hidden is not None:
            self._hidden(hidden, sample_reqs, spec, ns, out)
        if plp:
            self._prompt_logprobs(logits[ns + nv :].float(), plp, targets, targets_t, out)
        t = self.timings
        t_end = time.perf_counter()
        t.prepare_s += t_forward - t_start
        t.forward_s += t_sample - t_forward
        t.sample_s += t_end - t_sample
        t.steps += 1
        self.paths.add("graph" if eager is None else "eager", eager or GRAPH_REASON,
                       t_end - t_start)
        return pending

    def _deferrable(self, rows: list[SamplingRow], spec: list, hidden: object) -> bool:
        """Whether this step's sampled ids may stay on the device: nothing read on the host
        before the next step needs them (one rank, no verification, no hidden states, no
        logprobs, no penalty that counts output ids)."""
        return (self.executor is None and not spec and hidden is None
                and all(r.num_logprobs is None and r.repetition_penalty == 1.0
                        and not r.presence_penalty and not r.frequency_penalty for r in rows))

    def _eager_reason(self, *, mixed: bool, lora: bool, spec: bool, plp: bool,
                      watching: bool, nd: int) -> str | None:
        """None when the step replays the decode graphs, else the first reason (in
        `EAGER_REASONS` order) it runs eagerly."""
        if self.graphs is None:
            return "disabled"
        for reason, applies in (("hidden_states", self.return_hidden), ("lora", lora),
                                ("spec_verify", spec), ("prompt_logprobs", plp),
                                ("layer_stream", watching), ("mixed", mixed)):
            if applies:
                return reason
        return "too_large" if self.graphs.padded_size(nd) is None else None

    def step_paths(self) -> tuple[StepPathCount, ...]:
        """Rank 0's steps so far by path and reason (every path and reason, 0 included)."""
        return self.paths.snapshot()

    def _lora_slots(self, scheduled: list[ScheduledRequest], rows: list[int], nd: int,
                    num_single: int) -> np.ndarray | None:
        """Each token's adapter slot (-1: none; the step's adapters made resident, on every
        rank), in the flat order: the `nd` one-token rows (`rows[:nd]` their scheduled
        index), then each chunk's tokens. None without adapters in the step."""
        if self.lora is None:
            return None
        names = {s.request.lora_name for s in scheduled if s.request.lora_name is not None}
        if not names:
            return None
        slot_of = self.lora.prepare(names)
        per = np.array([-1 if s.request.lora_name is None else slot_of[s.request.lora_name]
                        for s in scheduled], dtype=np.int64)
        chunk_lens = [s.num_new_tokens for s in scheduled[num_single:]]
        return np.concatenate([per[np.asarray(rows[:nd], dtype=np.int64)],
                               np.repeat(per[num_single:], chunk_lens)])

    def _verify(self, logits: torch.Tensor, spec: list[tuple[ScheduledRequest, int]],
                out: RunnerOutput) -> None:
        """Speculative requests: logits [sum(k + 1), V] -> accepted drafts + a final token."""
        reqs = []
        for s, _ in spec:
            req, k = s.request, len(s.spec_token_ids)
            sp = req.sampling_params
            banned = tuple(req.eos_token_ids) + tuple(sp.stop_token_ids or ())
            row = self._row(req)
            row.key = None  # penalised requests never speculate: no penalty state here
            reqs.append(VerifyRequest(row, s.spec_token_ids, s.draft_probs, [
                banned if req.grammar is None and req.num_output_tokens + j < sp.min_tokens
                else () for j in range(k + 1)]))
        results = verify(logits, reqs, self.sampler.generator(logits.device))
        for (s, _), res in zip(spec, results, strict=True):
            rid = s.request.request_id
            out.sampled[rid] = res.token_ids[-1]
            out.accepted[rid] = res.token_ids[:-1]
            if res.logprobs is not None:
                out.logprobs[rid] = res.logprobs[-1]
                out.accepted_logprobs[rid] = res.logprobs[:-1]

    @staticmethod
    def _hidden(hidden: torch.Tensor, sample_reqs: list[Request],
                spec: list[tuple[ScheduledRequest, int]], ns: int, out: RunnerOutput) -> None:
        """`out.hidden_states[rid]`: [n, H] last-layer hidden states of the positions whose
        logits gave the request's committed tokens this step (1 row, or accepted + 1)."""
        for i, req in enumerate(sample_reqs):
            out.hidden_states[req.request_id] = hidden[i : i + 1]
        for s, first in spec:
            rid = s.request.request_id
            n = len(out.accepted[rid]) + 1
            out.hidden_states[rid] = hidden[ns + first : ns + first + n]

    def _load_all(self, connector: KVConnectorWorker) -> None:
        """Tensor parallelism: wait for every layer's loads now, then hand the pages the
        worker side wrote (`KVPageIO.write`, full-head) to every rank (`KVPageIO.flush`: a
        KV_SCATTER plan), before the step's forward plan is sent."""
        for layer in range(len(self.kv_caches)):
            connector.wait_for_layer_load(layer)
        if self.kv_pages is not None:
            self.kv_pages.flush()

    def _load_waits(self, connector: KVConnectorWorker,
                    signal: Callable[[int], None] | None,
                    graphs: bool) -> Callable[[int], None] | None:
        """A step with connector loads: layer 0's pages are waited for now, layer i + 1's
        after layer i (so before it attends), chained after `signal`; a step replaying
        the decode graphs (no layer hook) waits for every layer now."""
        num_layers = len(self.kv_caches)
        if graphs and self.graphs is not None:
            for layer in range(num_layers):
                connector.wait_for_layer_load(layer)
            return signal
        connector.wait_for_layer_load(0)

        def on_layer(layer: int) -> None:
            if signal is not None:
                signal(layer)
            if layer + 1 < num_layers:
                connector.wait_for_layer_load(layer + 1)
        return on_layer

    def _layer_signal(self, observers: list[LayerObserver],  # noqa: ANN202 - Callable
                      tables: list[list[int]]):
        """The step's layer hook for `observers` (their block `tables`): with one rank, each
        hears of each layer (and a CUDA event); with tensor parallelism, each layer's pages of
        every table are first gathered from the ranks (the plan's `save_layers`) and each
        observer gets its own."""
        if self.executor is not None:
            groups = self.executor.groups
            assert groups is not None and self.arch is not None
            gather = LayerGather(groups.ctrl, self.kv_caches, [b for t in tables for b in t],
                                 self.arch, self.executor.world)
            sizes = [len(t) for t in tables]

            def gathered(layer: int) -> None:
                full = gather.gather(layer)
                at = 0
                for observer, n in zip(observers, sizes, strict=True):
                    observer.layer_done(layer, None, pages=full[:, at:at + n])
                    at += n
            return gathered
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
                         targets: list[int], targets_t: torch.Tensor,
                         out: RunnerOutput) -> None:
        """Rows of `logits` in `plp` order; `targets` the prompt token each row predicts
        (host list and its device copy). One topk and one device-to-host copy for all."""
        logprobs = logits.log_softmax(dim=-1)
        kmax = min(max(req.sampling_params.prompt_logprobs or 0 for req, *_ in plp),
                   logprobs.shape[-1])
        cols = [logprobs.gather(1, targets_t[:, None]).double()]
        if kmax:
            top_v, top_i = logprobs.topk(kmax, dim=-1)
            cols += [top_i.double(), top_v.double()]
        host = download(torch.cat(cols, dim=1)).tolist()
        row = 0
        for req, _, _, count in plp:
            k = min(req.sampling_params.prompt_logprobs or 0, kmax)
            entries = []
            for h, tid in zip(host[row : row + count], targets[row : row + count], strict=True):
                entry = {tid: h[0]}
                for t, v in zip(h[1 : 1 + k], h[1 + kmax : 1 + kmax + k], strict=True):
                    entry.setdefault(int(t), v)
                entries.append(entry)
            out.prompt_logprobs[req.request_id] = entries
            row += count

