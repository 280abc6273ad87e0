"""Cost scorer (as Dynamo's KV router): the work a request would cost on each candidate,
in seconds (about its time to first token there), lowest best.

`cost = rate x (P + uncached) + step x (1 + P / CHUNK_TOKENS) + lora_miss`, with `P =
uncached + queued`, where

* `rate` is the worker's measured prefill seconds per token (`WorkerLoad.
  prefill_s_per_token`, an EWMA over its engine steps) and `step` its measured decode-only
  step seconds (`decode_step_s`, with its current batch): its running decode load, paid
  once per engine step the prefill takes (CHUNK_TOKENS prefill tokens a step, the engine's
  default `max_num_batched_tokens`);
* `uncached` is the request's prompt tokens the worker lacks (`prompt_tokens -
  matched_tokens`); `queued` the prompt tokens its waiting and partly prefilled running
  requests still need (`pending_prefill_tokens`: the work ahead of it), plus `uncached`
  again for each request this router sent it since its last load report
  (`local_in_flight` above its reported running + waiting);
* the second `uncached` is the cost of the cached blocks the new ones displace (a warm
  worker's cache is full: each token computed there evicts one some later request would
  have hit), so a prefix group stays where it is cached until the queue ahead costs more
  than recomputing it elsewhere twice;
* a block held in the worker's host or disk tier, or one it would pull from a peer, counts
  as cached for the prefill it saves net of its measured load time
  (`RoutingContext.credit_tokens`, `kvcredit`: uncached drops by that many tokens);
* `lora_miss` is `(1 - lora_affinity) x saturation_queue x step`: an adapter that must be
  loaded (no slot free) weighs as much as `saturation_queue` decode steps, as in the
  cache-aware policy.

So a short shared prefix never outweighs a long queue, and a long cached prefix wins over
a short idle queue. A worker that has not reported a rate yet is costed at the median of
the candidates that have, else at DEFAULT_PREFILL_S_PER_TOKEN / DEFAULT_DECODE_STEP_S. In
approximate mode (no tokenizer) lengths are characters, so prefill counts ~4x heavier.

The `cost` scorer maps costs to [0, 1] as `min cost / cost` (cache-aware can weigh it);
the `cost` policy (`policy.CostPolicy`) picks the lowest cost directly.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tandem.router.scorers.base import LoadLimits, RoutingContext, Scorer, register_scorer
from tandem.router.scorers.lora import LoRAAffinityScorer
from tandem.router.workers import Worker

DEFAULT_PREFILL_S_PER_TOKEN = 2e-4  # 5,000 tokens/s: a small GPU or a fast CPU's slower side
DEFAULT_DECODE_STEP_S = 0.03
CHUNK_TOKENS = 1024  # prefill tokens per engine step (the engine's max_num_batched_tokens)


def fleet_rate(values: Sequence[float], default: float) -> float:
    """The median of the measured (positive) `values`, else `default`."""
    measured = [v for v in values if v > 0.0]
    return statistics.median(measured) if measured else default


def costs(ctx: RoutingContext, workers: Sequence[Worker],
          limits: LoadLimits = LoadLimits()) -> list[float]:  # noqa: B008 - frozen
    """Each worker's cost in seconds for this request (module doc), in order."""
    loads = [w.load for w in workers]
    rates, steps = [x.prefill_s_per_token for x in loads], [x.decode_step_s for x in loads]
    # the fallbacks (a median: only when some worker has not reported)
    rate0 = 0.0 if all(rates) else fleet_rate(rates, DEFAULT_PREFILL_S_PER_TOKEN)
    step0 = 0.0 if all(steps) else fleet_rate(steps, DEFAULT_DECODE_STEP_S)
    lora = (LoRAAffinityScorer.score_one(ctx.lora, workers) if ctx.lora is not None
            else None)
    out = []
    prompt, matched, chunk = ctx.prompt_tokens, ctx.matched_tokens.get, CHUNK_TOKENS
    credit = ctx.credit_tokens.get if ctx.credit_tokens else None
    for w, load, rate, step in zip(workers, loads, rates, steps, strict=True):
        # the same arithmetic, in the same order, as one expression per term (no call to
        # `max` per worker: a fleet of 64 costs ~40 % less)
        rate = rate or rate0
        step = step or step0
        uncached = prompt - matched(w.id, 0)
        if credit is not None:
            uncached -= credit(w.id, 0.0)
        if uncached < 0:
            uncached = 0
        unseen = w.local_in_flight - load.num_running - load.num_waiting
        work = uncached * (1 + (unseen if unseen > 0 else 0)) + load.pending_prefill_tokens
        out.append(rate * (work + uncached) + step * (1.0 + work / chunk))
    if lora is not None:
        queue = limits.saturation_queue
        for i, step in enumerate(steps):
            out[i] += (1.0 - lora[i]) * queue * (step or step0)
    return out


@register_scorer
class CostScorer(Scorer):
    name = "cost"

    def score(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[float]:
        values = costs(ctx, workers, self.limits)
        lo = min(values, default=0.0)
        return [1.0 if v <= lo else lo / v for v in values]
