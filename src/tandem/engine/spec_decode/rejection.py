"""Verification of proposed tokens: the emitted tokens follow exactly the target's distribution.

Request i brings k_i >= 1 drafts and k_i + 1 consecutive logits rows (row j: the target after
the context + drafts[:j]). Greedy rows accept draft j while it is the argmax of row j (after
bans); the final token is the argmax of the first mismatching row, or of row k. Random rows
use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): with p_j the processed
target distribution of row j (bans, temperature, top-k, top-p, min-p: the sampler's order)
and q_j the draft's (a point mass on the draft when the proposal has no probabilities),
draft j is accepted with probability min(1, p_j(d) / q_j(d)); the first rejection draws the
final token from normalize(max(0, p_j - q_j)) (from p_j if that is all zero), and when every
draft is accepted a bonus token is drawn from p_k.

The batch is verified at once on the logits' device: one index upload, one parameter upload,
one softmax over the random rows, the uniforms of all unseeded rows in one draw and their
final-token noise in another (a seeded request draws both from its own generator), accepted
runs by a cumulative product over a [requests, max k] grid, final tokens by the exponential
race, and one device-to-host copy of counts, tokens and logprobs. Allocations are bounded by
the logits' shape; client values only index into it (validated).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tandem.engine.sampler import (
    _GREEDY_BELOW,
    SamplingRow,
    processed_probs,
    raw_logprobs_of,
    sampling_params,
)
from tandem.engine.staging import download, upload


@dataclass
class VerifyRequest:
    """One request's drafts. `row`: its sampling row (`key` None: penalised requests never
    speculate); `draft_probs` [k, V]: the distribution each draft was drawn from, or None for
    a point mass (n-gram, greedy drafts); `banned`: k + 1 tuples of ids suppressed at each
    position (min_tokens), possibly empty."""

    row: SamplingRow
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    banned: list[tuple[int, ...]]


@dataclass
class VerifyResult:
    """`token_ids`: the accepted drafts then one final token (1 .. k + 1 tokens); `logprobs`:
    per emitted token the raw model logprobs of its row (chosen + top `num_logprobs`)."""

    token_ids: list[int]
    num_accepted: int  # len(token_ids) - 1
    logprobs: list[dict[int, float]] | None


def _ranges(first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges [first[i], first[i] + lengths[i])."""
    ends = np.cumsum(lengths)
    return np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - lengths - first, lengths)


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.cumsum(lengths) - lengths


class _Plan:
    """The host side of one verification: request groups and every index segment, built
    with numpy (O(requests) Python, O(tokens) numpy) and uploaded in one copy."""

    def __init__(self, logits: torch.Tensor, requests: list[VerifyRequest]) -> None:
        total, vocab = logits.shape
        self.ks = ks = np.array([len(r.draft_token_ids) for r in requests], dtype=np.int64)
        tokens = np.fromiter(chain.from_iterable(r.draft_token_ids for r in requests),
                             np.int64, int(ks.sum()))
        if int(ks.sum() + len(ks)) != total:
            raise ValueError(f"verify: {total} logits rows for drafts needing "
                             f"{int(ks.sum() + len(ks))}")
        if ks.min() < 1 or tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"verify: drafts must be 1 or more ids in [0, {vocab})")
        for r, k in zip(requests, ks.tolist(), strict=True):
            if len(r.banned) != k + 1:
                raise ValueError(f"verify: {len(r.banned)} ban lists for {k + 1} positions")
            if r.draft_probs is not None and tuple(r.draft_probs.shape) != (k, vocab):
                raise ValueError(f"verify: draft_probs of shape {tuple(r.draft_probs.shape)}"
                                 f", expected {(k, vocab)}")
        rows = [r.row for r in requests]
        is_rand = np.array([r.temperature >= _GREEDY_BELOW for r in rows])
        seeded = np.array([r.generator is not None for r in rows])
        has_q = np.array([r.draft_probs is not None for r in requests])
        self.kmax = int(ks.max())
        self.greedy = np.flatnonzero(~is_rand)
        # random requests, unseeded first (their draws come from one call each)
        self.rand = rand = np.concatenate([np.flatnonzero(is_rand & ~seeded),
                                           np.flatnonzero(is_rand & seeded)])
        self.num_unseeded = int((is_rand & ~seeded).sum())
        self.lp = np.flatnonzero(np.array([r.num_logprobs is not None for r in rows]))
        self.with_q = np.flatnonzero(has_q[rand])  # positions in `rand`
        self.bans = [(i, j, t) for i, r in enumerate(requests)
                     for j, banned in enumerate(r.banned) for t in banned if 0 <= t < vocab]
        starts, dstarts, rk = _starts(ks + 1), _starts(ks), ks[rand]
        rstarts = _starts(rk + 1)  # first row of each random request among the random rows
        point = np.flatnonzero(~has_q[rand])
        ban_at = np.array([starts[i] + j for i, j, _ in self.bans], dtype=np.int64)
        segments = {
            "d_rows": _ranges(starts, ks), "d_tok": tokens,  # every draft, its row
            "d_grid": _ranges(np.arange(len(ks)) * self.kmax, ks),  # its [request, j] cell
            "ban_rows": ban_at, "ban_tok": np.array([t for *_, t in self.bans], np.int64),
            "starts": starts, "greedy": self.greedy, "rand": rand, "rstarts": rstarts,
            "r_counts": rk + 1, "r_rows": _ranges(starts[rand], rk + 1),
            "r_drows": _ranges(rstarts, rk),  # random drafts' rows among the random rows
            "r_dflat": _ranges(dstarts[rand], rk),  # .. and their index among all drafts
            "q_rows": _ranges(rstarts[self.with_q], rk[self.with_q]),
            "pt_rows": _ranges(rstarts[point], rk[point]),
            "pt_tok": tokens[_ranges(dstarts[rand[point]], rk[point])],
            "lp_rows": _ranges(starts[self.lp], ks[self.lp] + 1),
        }
        flat = upload(np.concatenate([v.astype(np.int64) for v in segments.values()]),
                      torch.int64, logits.device)
        self.t = dict(zip(segments, flat.split([len(v) for v in segments.values()]),
                          strict=True))


def verify(logits: torch.Tensor, requests: list[VerifyRequest],
           generator: torch.Generator) -> list[VerifyResult]:
    """logits [sum(k_i + 1), V] (any float dtype; request i's k_i + 1 rows consecutive, in
    order) -> one result per request. `generator` (on the logits' device) draws for unseeded
    random rows; a seeded row draws from `row.generator` only, so its result does not
    depend on the batch around it. Raises ValueError on inconsistent inputs."""
    if not requests:
        return []
    plan = _Plan(logits, requests)
    t, device, (total, vocab), n_req = plan.t, logits.device, logits.shape, len(requests)
    logits = logits.float()
    raw = raw_logprobs_of(logits.index_select(0, t["lp_rows"])) if len(plan.lp) else None
    if plan.bans:  # after the raw logprobs, as in the sampler
        logits = logits.index_put((t["ban_rows"], t["ban_tok"]),
                                  torch.full((), float("-inf"), device=device))
    accept = torch.zeros(len(t["d_tok"]), dtype=torch.bool, device=device)
    final = torch.zeros(n_req, dtype=torch.int64, device=device)
    if len(plan.greedy):
        argmax = logits.argmax(dim=-1)
        accept = argmax.index_select(0, t["d_rows"]) == t["d_tok"]  # random ones overwritten
    if len(plan.rand):
        rand, ks, n_unseeded = plan.rand.tolist(), plan.ks.tolist(), plan.num_unseeded
        rows = [requests[i].row for i in rand]
        params = sampling_params(rows, vocab, device).repeat_interleave(
            t["r_counts"], dim=1, output_size=len(t["r_rows"]))
        probs = processed_probs(logits.index_select(0, t["r_rows"]), params, rows)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        q = torch.zeros_like(probs)  # the draft distributions; zero on bonus rows
        if len(plan.with_q):
            q.index_copy_(0, t["q_rows"], torch.cat([requests[rand[n]].draft_probs.to(
                device=device, dtype=torch.float32) for n in plan.with_q.tolist()]))
        if len(t["pt_rows"]):
            q.index_put_((t["pt_rows"], t["pt_tok"]), torch.ones((), device=device))
        tok = t["d_tok"].index_select(0, t["r_dflat"])[:, None]
        p_d = probs.index_select(0, t["r_drows"]).gather(1, tok)[:, 0]
        q_d = q.index_select(0, t["r_drows"]).gather(1, tok)[:, 0]
        draws = [torch.rand(sum(ks[i] for i in rand[:n_unseeded]), generator=generator,
                            device=device)]
        draws += [torch.rand(ks[i], generator=requests[i].row.generator, device=device)
                  for i in rand[n_unseeded:]]
        # accept with probability min(1, p/q); q(d) = 0 < p(d) accepts, 0/0 rejects
        accept = accept.index_put((t["r_dflat"],), torch.cat(draws) < p_d / q_d)
    grid = torch.zeros(n_req * plan.kmax, dtype=torch.int64, device=device)
    grid[t["d_grid"]] = accept.long()
    num_acc = grid.view(n_req, plan.kmax).cumprod(dim=1).sum(dim=1)  # the accepted run
    if len(plan.greedy):
        g = t["greedy"]
        at = t["starts"].index_select(0, g) + num_acc.index_select(0, g)
        final.index_copy_(0, g, argmax.index_select(0, at))
    if len(plan.rand):
        at = t["rstarts"] + num_acc.index_select(0, t["rand"])
        p_f = probs.index_select(0, at)
        resid = (p_f - q.index_select(0, at)).clamp_(min=0.0)
        resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p_f)
        noise = torch.empty_like(resid)  # the exponential race draws from resid
        if n_unseeded:
            noise[:n_unseeded].exponential_(generator=generator)
        for n in range(n_unseeded, len(rand)):
            noise[n].exponential_(generator=requests[rand[n]].row.generator)
        final.index_copy_(0, t["rand"], (resid / noise).argmax(dim=-1))
    return _finish(requests, plan, num_acc, final, raw, total)


def _finish(requests: list[VerifyRequest], plan: _Plan, num_acc: torch.Tensor,
            final: torch.Tensor, raw: torch.Tensor | None, total: int) -> list[VerifyResult]:
    """One device-to-host copy of the counts, final tokens and logprobs; then host slicing."""
    cols, t, ks = [num_acc.double(), final.double()], plan.t, plan.ks.tolist()
    klp = 0
    if raw is not None:
        emitted = torch.zeros(total, dtype=torch.int64, device=final.device)
        emitted[t["d_rows"]] = t["d_tok"]
        emitted[t["starts"] + num_acc] = final  # rows past the final one are never read
        chosen = raw.gather(1, emitted.index_select(0, t["lp_rows"])[:, None])
        cols.append(chosen.double().flatten())
        klp = min(max(requests[i].row.num_logprobs or 0 for i in plan.lp.tolist()),
                  raw.shape[-1])
        if klp:
            top_vals, top_ids = raw.topk(klp, dim=-1)
            cols += [top_ids.double().flatten(), top_vals.double().flatten()]
    host = download(torch.cat(cols)).tolist()
    n_req, n_lp = len(requests), 0 if raw is None else raw.shape[0]
    accepted, finals = host[:n_req], host[n_req:2 * n_req]
    chosen_h = host[2 * n_req:2 * n_req + n_lp]
    ids_h = host[2 * n_req + n_lp:2 * n_req + n_lp + n_lp * klp]
    vals_h = host[2 * n_req + n_lp + n_lp * klp:]
    out, lp_at = [], 0  # lp_at: first logprob row of the next request wanting them
    for i, r in enumerate(requests):
        a = int(accepted[i])
        tokens = [*r.draft_token_ids[:a], int(finals[i])]
        logprobs = None
        if r.row.num_logprobs is not None:
            logprobs, want = [], min(r.row.num_logprobs, klp)
            for j, tid in enumerate(tokens):
                row = lp_at + j
                entry = {tid: chosen_h[row]}
                for c in range(row * klp, row * klp + want):
                    entry.setdefault(int(ids_h[c]), vals_h[c])
                logprobs.append(entry)
            lp_at += ks[i] + 1
        out.append(VerifyResult(tokens, a, logprobs))
    return out
