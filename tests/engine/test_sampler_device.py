"""The sampler and the runner's host work, device-clean and exact, without a model.

Everything runs under `torch.device("meta")` with CPU logits: a tensor created without an
explicit device lands on meta and the op fails, so a passing test means every tensor and
generator follows the logits' device. Results are checked against a straightforward
per-row float64 reference (tokens; logprobs exactly against a per-row float32
`log_softmax`), seeded rows against noise drawn from a fresh generator of the same seed.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tandem.engine.kv_cache.block_table import BlockTable
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput

V = 64
META = torch.device("meta")


def _row(seed: int | None = None, **kw) -> SamplingRow:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0, banned_token_ids=(),
                prompt_token_ids=[], output_token_ids=[], num_logprobs=None, key=None)
    base.update(kw)
    gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
    return SamplingRow(generator=gen, **base)


def _random_row(rng: random.Random, key: str | None) -> tuple[SamplingRow, int | None]:
    """A row mixing modes at random; (row, its seed or None)."""
    mode = rng.choice(["greedy", "temp", "top_k", "top_p", "min_p", "all"])
    kw: dict = {"temperature": 0.0 if mode == "greedy" else rng.choice([0.5, 1.0, 1.7])}
    if mode in ("top_k", "all"):
        kw["top_k"] = rng.choice([1, 3, 10, V + 5])
    if mode in ("top_p", "all"):
        kw["top_p"] = rng.choice([0.3, 0.8, 0.95])
    if mode in ("min_p", "all"):
        kw["min_p"] = rng.choice([0.05, 0.3])
    if rng.random() < 0.6:
        kw["repetition_penalty"] = rng.choice([1.0, 0.7, 1.5])
        kw["presence_penalty"] = rng.choice([0.0, -0.5, 1.2])
        kw["frequency_penalty"] = rng.choice([0.0, 0.4, -1.0])
    if rng.random() < 0.4:  # min_tokens not reached: EOS and stop ids banned, one off-vocab
        kw["banned_token_ids"] = (rng.randrange(V), rng.randrange(V), V + 3)
    kw["num_logprobs"] = rng.choice([None, 0, 1, 2, 3, 4, 5])
    kw["prompt_token_ids"] = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
    kw["output_token_ids"] = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
    seed = rng.randrange(2**40) if mode != "greedy" and rng.random() < 0.5 else None
    return _row(seed, key=key, **kw), seed


def _processed(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """Row after bans and penalties, float64, token by token."""
    x = logits.double().clone()
    for t in r.banned_token_ids:
        if t < V:
            x[t] = -math.inf
    if r.repetition_penalty != 1.0:
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            x[t] = x[t] / r.repetition_penalty if x[t] > 0 else x[t] * r.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        x[t] -= c * r.frequency_penalty + r.presence_penalty
    return x


def _allowed(logits: torch.Tensor, r: SamplingRow) -> tuple[list[int], torch.Tensor]:
    """Tokens a random row may draw and their probabilities (float64): top-k on the
    tempered distribution, top-p on what top-k kept (renormalised, as vLLM and HF), then
    min-p relative to the most likely survivor."""
    x = _processed(logits, r) / r.temperature
    p = x.softmax(-1).tolist()
    order = sorted(range(V), key=lambda t: -x[t].item())
    if 0 < r.top_k < V:
        order = order[: r.top_k]
    top_mass = sum(p[t] for t in order)
    keep, mass = [], 0.0
    for rank, t in enumerate(order):
        if rank == 0 or mass <= r.top_p:
            keep.append(t)
        mass += p[t] / top_mass
    q = torch.zeros(V, dtype=torch.float64)
    q[keep] = torch.tensor([p[t] for t in keep], dtype=torch.float64)
    q /= q.sum()
    if r.min_p > 0:
        keep = [t for t in keep if q[t] >= r.min_p * q.max()]
    return keep, q


def _reference_token(logits: torch.Tensor, r: SamplingRow, seed: int | None) -> int | None:
    """The token a greedy or seeded row must give (None: unseeded, any allowed token)."""
    if r.temperature < 1e-5:
        return int(_processed(logits, r).argmax())
    if seed is None:
        return None
    noise = torch.empty(V, device="cpu").exponential_(
        generator=torch.Generator(device="cpu").manual_seed(seed)).double()
    keep, q = _allowed(logits, r)
    return max(keep, key=lambda t: q[t].item() / noise[t].item())


def _reference_logprobs(logits: torch.Tensor, r: SamplingRow, token: int) -> dict | None:
    if r.num_logprobs is None:
        return None
    lp = torch.log_softmax(logits[None].float(), -1)[0]  # float32, exact
    top = sorted(range(V), key=lambda t: -logits[t].item())[: r.num_logprobs]
    entry = {token: lp[token].item()}
    for t in top:
        entry.setdefault(t, lp[t].item())
    return entry


def _check(logits: torch.Tensor, rows: list[SamplingRow], seeds: list[int | None],
           out) -> None:
    for i, (r, seed) in enumerate(zip(rows, seeds, strict=True)):
        tok = out.token_ids[i]
        want = _reference_token(logits[i], r, seed)
        if want is not None:
            assert tok == want, (i, r)
        if r.temperature >= 1e-5:
            assert tok in _allowed(logits[i], r)[0], (i, r)
        else:
            assert tok not in r.banned_token_ids
        ref = _reference_logprobs(logits[i], r, tok)
        assert out.logprobs[i] == ref and (ref is None or list(out.logprobs[i]) == list(ref))


@pytest.mark.parametrize("case", range(4))
def test_every_mode_over_steps_matches_the_reference(case):
    """Random mixes of modes over 12 steps: requests join and leave (penalty slots are
    released and reused, and outgrow their first capacity), outputs grow by the sampled
    tokens, so the incremental penalty counts are checked against full recounts."""
    rng = random.Random(case)
    sampler = Sampler(seed=case)
    live: dict[str, tuple[SamplingRow, int | None]] = {}
    next_id = 0
    for _step in range(12):
        for key in [k for k in live if rng.random() < 0.2]:
            del live[key]
            sampler.release(key)
        while len(live) < 14:
            live[f"r{next_id}"] = _random_row(rng, f"r{next_id}")
            next_id += 1
        keys = list(live)
        rng.shuffle(keys)
        rows = [live[k][0] for k in keys]
        # seeded rows' generators advance once per step: the reference takes a fresh one
        # of a per-step seed, so give every seeded row that generator now
        for k, r in zip(keys, rows, strict=True):
            if live[k][1] is not None:
                live[k] = (r, live[k][1] + 1)
                r.generator = torch.Generator(device="cpu").manual_seed(live[k][1])
        seeds = [live[k][1] for k in keys]
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(next_id)) * 3
        with META:
            out = sampler(logits, rows)
        _check(logits, rows, seeds, out)
        for r, tok in zip(rows, out.token_ids, strict=True):
            r.output_token_ids.append(tok)
    assert sampler.counts.output.device.type == "cpu"
    for key in list(live):
        sampler.release(key)
    assert not sampler.counts.slots


def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch():
    target = dict(temperature=0.9, top_p=0.9, min_p=0.02, frequency_penalty=0.3,
                  num_logprobs=2)
    steps = 20
    own = [torch.randn(V, generator=torch.Generator().manual_seed(100 + s)) * 2
           for s in range(steps)]

    def run(batch_mates: int, position: int) -> list[int]:
        rng = random.Random(batch_mates)
        sampler = Sampler(seed=batch_mates)
        row = _row(1234, key="target", **target)
        mates = [_random_row(rng, f"m{j}")[0] for j in range(batch_mates)]
        tokens = []
        for s in range(steps):
            rows = mates[:position] + [row] + mates[position:]
            logits = torch.randn(len(rows), V) * 3
            logits[position] = own[s]
            with META:
                out = sampler(logits, rows)
            tokens.append(out.token_ids[position])
            row.output_token_ids.append(out.token_ids[position])
            for i, m in enumerate(rows):
                if m is not row:
                    m.output_token_ids.append(out.token_ids[i])
        return tokens

    alone = run(0, 0)
    assert len(set(alone)) > 3  # it really samples
    assert run(5, 2) == alone
    assert run(9, 9) == alone


@pytest.mark.parametrize("degenerate", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_degenerate_filters_are_greedy(degenerate):
    logits = torch.randn(256, V, generator=torch.Generator().manual_seed(7)) * 2
    rows = [_row(seed=i if i % 2 else None, temperature=1.3, **degenerate) for i in range(256)]
    with META:
        out = Sampler(seed=1)(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_thousands_of_draws_stay_in_the_allowed_set_and_follow_its_distribution():
    """One unseeded row shape repeated over a 512-row batch for 8 steps (4096 draws): every
    token allowed, and each allowed token's share within 5 sigma of its probability."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    r = _row(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
             prompt_token_ids=[int(logits.argmax())], output_token_ids=[5, 5])
    keep, q = _allowed(logits, r)
    assert 2 <= len(keep) <= 6
    sampler = Sampler(seed=11)
    counts: Counter[int] = Counter()
    for _ in range(8):
        with META:
            out = sampler(logits.repeat(512, 1), [r] * 512)
        counts.update(out.token_ids)
    draws = 8 * 512
    assert set(counts) <= set(keep)
    total = sum(q[t].item() for t in keep)
    for t in keep:
        p = q[t].item() / total
        assert abs(counts[t] / draws - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, t


def test_bans_win_over_the_argmax_and_off_vocabulary_ids_are_ignored():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    top = logits.argmax(-1).tolist()
    rows = [_row(temperature=0.0, banned_token_ids=(top[0], V, 10**9)),
            _row(seed=9, top_k=1, banned_token_ids=(top[1],)),
            _row(temperature=0.0, num_logprobs=3)]
    with META:
        out = Sampler()(logits, rows)
    second = logits.topk(2, -1).indices[:, 1].tolist()
    assert out.token_ids == [second[0], second[1], top[2]]


class _FakeModel:
    """Logits from (token, position) of the selected rows; records its inputs."""

    def __init__(self) -> None:
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
        self.calls: list[tuple[list[int], list[int], list[int]]] = []

    def __call__(self, input_ids, positions, kv_caches, meta, logits_indices, on_layer=None):
        self.calls.append((input_ids.tolist(), positions.tolist(), logits_indices.tolist()))
        rows = input_ids[logits_indices]
        return self.table[rows] + positions[logits_indices, None].float() * 0.01


class _FakeBackend:
    def __init__(self) -> None:
        self.layouts = []

    def build_metadata(self, layout):
        self.layouts.append(layout)
        return None


def test_runner_inputs_sampling_and_prompt_logprobs_match_a_plain_rebuild():
    bs = 4
    rng = random.Random(2)

    def request(rid, n_prompt, n_out, **params):
        sp = SamplingParams(temperature=0.0, max_tokens=64, **params)
        req = Request(rid, [rng.randrange(V) for _ in range(n_prompt)], sp, 64)
        for _ in range(n_out):
            req.append_output_token(rng.randrange(V))
        return req

    reqs = {
        "d1": request("d1", 9, 3, repetition_penalty=1.4, logprobs=2),  # decode at 11
        "d2": request("d2", 5, 1),  # decode at 5
        "p1": request("p1", 23, 0, prompt_logprobs=3),  # chunk [8, 17): no sample
        "p2": request("p2", 10, 0, prompt_logprobs=0, logprobs=1),  # last chunk [6, 10)
    }
    tables = {rid: rng.sample(range(100), 8) for rid in reqs}
    reqs["p1"].prompt_logprobs_pos = 8
    reqs["p2"].prompt_logprobs_pos = 6
    sched = SchedulerOutput([ScheduledRequest(reqs["d1"], 11, 1),
                             ScheduledRequest(reqs["d2"], 5, 1),
                             ScheduledRequest(reqs["p1"], 8, 9),
                             ScheduledRequest(reqs["p2"], 6, 4)])
    model, backend = _FakeModel(), _FakeBackend()
    block_table = BlockTable(rows=1, width=1)
    for rid, ids in tables.items():
        block_table.append(rid, ids)
    kv = SimpleNamespace(block_size=bs, block_table=block_table)
    runner = ModelRunner(model, backend, [], kv, Sampler(), torch.device("cpu"))
    with META:
        out = runner.execute(sched)

    order = [("d2", 5, 1), ("d1", 11, 1), ("p1", 8, 9), ("p2", 6, 4)]  # decodes by length
    tokens = [t for rid, s, n in order for t in reqs[rid].all_token_ids[s : s + n]]
    positions = [p for _, s, n in order for p in range(s, s + n)]
    slots = [tables[rid][p // bs] * bs + p % bs for rid, s, n in order for p in range(s, s + n)]
    # sampling rows (d2, d1, p2's last), then prompt-logprob rows: p1 8..16, p2 6..8
    idx = [0, 1, 14] + list(range(2, 11)) + list(range(11, 14))
    assert model.calls == [(tokens, positions, idx)]
    layout = backend.layouts[0]
    assert layout.slot_mapping.tolist() == slots
    assert (layout.query_lens, layout.seq_lens, layout.num_decodes) == (
        [1, 1, 9, 4], [6, 12, 17, 10], 2)
    assert layout.block_tables == [tables[rid] for rid, _, _ in order]

    logits = model.table[torch.tensor(tokens)[idx]] + torch.tensor(positions)[idx, None] * 0.01
    lp = logits.log_softmax(-1)
    for j, rid in enumerate(["d2", "d1", "p2"]):
        r = runner._row(reqs[rid])
        assert out.sampled[rid] == int(_processed(logits[j], r).argmax())
    assert list(out.logprobs) == ["d1", "p2"]
    assert out.logprobs["d1"] == _reference_logprobs(logits[1], runner._row(reqs["d1"]),
                                                     out.sampled["d1"])
    for rid, rows, first, k in [("p1", range(3, 12), 8, 3), ("p2", range(12, 15), 6, 0)]:
        entries = out.prompt_logprobs[rid]
        assert len(entries) == len(rows)
        for e, row, pos in zip(entries, rows, range(first, first + len(rows)), strict=True):
            target = reqs[rid].prompt_token_ids[pos + 1]
            want = {target: lp[row, target].item()}
            for t in sorted(range(V), key=lambda t: -lp[row, t].item())[:k]:
                want.setdefault(t, lp[row, t].item())
            assert e == want and list(e) == list(want)
    runner.release("d1")
    assert "d1" not in runner.sampler.counts.slots
