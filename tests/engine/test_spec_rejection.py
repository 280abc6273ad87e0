"""Speculative verification (`spec_decode/rejection.py`) against independent references.

Greedy verification is compared token for token with a direct loop. For random rows the
emitted tokens must follow exactly the target's processed distribution: a toy target whose
row j logits depend on the previous draft, drafts drawn from a draft distribution, many
requests verified in one call, and Pearson's chi-square goodness of fit of the first token
and of the second one (given the first was an accepted draft) at significance 1e-3 with
fixed seeds; a negative control shows the same test rejects a biased sampler.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tandem.engine.sampler import SamplingRow
from tandem.engine.spec_decode.rejection import VerifyRequest, verify

V = 16
ALPHA = 1e-3  # significance of every goodness-of-fit test below


def _row(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=None, num_logprobs=None):
    return SamplingRow(temperature, top_k, top_p, min_p, 1.0, 0.0, 0.0, generator, (), [], [],
                       num_logprobs)


def _reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, banned=()):
    """The processed target distribution in float64, written directly (vLLM's order: bans,
    temperature, top-k, top-p over what top-k kept, min-p)."""
    x = [(-math.inf if t in banned else float(v)) / temperature for t, v in enumerate(logits)]
    order = sorted(range(len(x)), key=lambda t: -x[t])
    kept = order[:top_k] if top_k > 0 else order
    z = sum(math.exp(x[t] - x[kept[0]]) for t in kept)
    p = {t: math.exp(x[t] - x[kept[0]]) / z for t in kept}
    nucleus, before = [], 0.0
    for t in kept:
        assert abs(before - top_p) > 1e-4 or top_p >= 1.0  # no float32 boundary case
        if nucleus and before > top_p:
            break
        nucleus.append(t)
        before += p[t]
    z = sum(p[t] for t in nucleus)
    p = {t: p[t] / z for t in nucleus}
    top = max(p.values())
    p = {t: v for t, v in p.items() if v >= min_p * top}
    z = sum(p.values())
    return torch.tensor([p.get(t, 0.0) / z for t in range(len(x))], dtype=torch.float64)


def _chi2_pvalue(groups):
    """Pearson's chi-square over independent groups of (counts [C], probs [C]); a token of
    probability 0 must never occur; cells expecting < 5 are pooled (with the smallest
    other cell when the pool alone expects < 5). p-value from the regularised gamma."""
    stat, df = 0.0, 0
    for counts, probs in groups:
        counts, probs = counts.double(), probs.double()
        assert counts[probs == 0].sum() == 0, "a token outside the target's support"
        n = counts.sum()
        if n == 0:
            continue
        exp, obs = (probs * n)[probs > 0], counts[probs > 0]
        small = exp < 5
        e = torch.cat([exp[~small], exp[small].sum()[None]])
        o = torch.cat([obs[~small], obs[small].sum()[None]])
        if e[-1] < 5 and len(e) > 1:
            j = int(e[:-1].argmin())
            e[j], o[j] = e[j] + e[-1], o[j] + o[-1]
            e, o = e[:-1], o[:-1]
        e, o = e[e > 0], o[e > 0]
        stat += float(((o - e) ** 2 / e).sum())
        df += len(e) - 1
    assert df > 0
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


class Toy:
    """A target and a draft over V tokens: row 0's logits are `t0`, row j >= 1's are
    `tj[previous draft]`; drafts are drawn from `q0` and then `qj[previous draft]`."""

    def __init__(self, seed, k, draft="good", scale=2.0):
        g = torch.Generator().manual_seed(seed)
        self.k = k
        self.t = [scale * torch.randn(V, generator=g)] + [
            scale * torch.randn(V, V, generator=g) for _ in range(k)]
        if draft == "good":  # the target's logits, perturbed
            qs = [t + 0.5 * torch.randn(t.shape, generator=g) for t in self.t[:k]]
        elif draft in ("bad", "likely"):  # mass on the target's least / most likely token
            qs = []
            for t in self.t[:k]:
                at = t.argmin(dim=-1, keepdim=True) if draft == "bad" else t.argmax(-1, True)
                qs.append(torch.full_like(t, -2.0).scatter_(-1, at, 3.0))
        else:
            qs = [torch.zeros_like(t) for t in self.t[:k]]  # uniform
        self.q = [x.softmax(dim=-1) for x in qs]

    def sample(self, n, seed, ks=None):
        """n requests (k each, or `ks[i]`): drafts [n, k], draft probs [n, k, V], logits."""
        g = torch.Generator().manual_seed(seed)
        d = torch.empty(n, self.k, dtype=torch.int64)
        qp = torch.empty(n, self.k, V)
        for j in range(self.k):
            qj = self.q[j] if j == 0 else self.q[j][d[:, j - 1]]
            qp[:, j] = qj.expand(n, V)
            d[:, j] = torch.multinomial(qj.expand(n, V), 1, generator=g)[:, 0]
        rows = [self.t[0].expand(n, V)] + [self.t[j][d[:, j - 1]] for j in range(1, self.k + 1)]
        logits = torch.stack(rows, dim=1)  # [n, k + 1, V]
        ks = ks or [self.k] * n
        keep = torch.arange(self.k + 1)[None, :] <= torch.tensor(ks)[:, None]
        return d, qp, logits[keep], ks


def _run(toy, n, seed, row, use_q=True, banned=(), ks=None, draws=None):
    d, qp, logits, ks = toy.sample(n, seed, ks)
    drafts = d.tolist()
    reqs = [VerifyRequest(row() if callable(row) else row, drafts[i][: ks[i]],
                          qp[i, : ks[i]] if use_q else None,
                          [tuple(banned)] * (ks[i] + 1)) for i in range(n)]
    results = verify(logits, reqs, draws or torch.Generator().manual_seed(seed + 1))
    return d, results


def _first_and_second(toy, d, results, **proc):
    """Chi-square p-values of the first token vs p_0 and of the second (when the first is an
    accepted draft a) vs p_1(. | a)."""
    first = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=V)
    p0 = _reference(toy.t[0], **proc)
    pairs = [r.token_ids[:2] for r in results if r.num_accepted >= 1]
    assert [r.token_ids[0] for r in results if r.num_accepted >= 1] == [
        f for f, r in zip(d[:, 0].tolist(), results, strict=True) if r.num_accepted >= 1]
    second = torch.bincount(torch.tensor(pairs).view(-1, 2) @ torch.tensor([V, 1]),
                            minlength=V * V).view(V, V).float()
    groups = [(second[a], _reference(toy.t[1][a], **proc)) for a in range(V)]
    return _chi2_pvalue([(first, p0)]), _chi2_pvalue(groups), second.sum()


@pytest.mark.parametrize("draft, use_q", [("good", True), ("bad", True), ("bad", False),
                                          ("likely", False), ("uniform", False)])
def test_emitted_tokens_follow_the_target_distribution(draft, use_q):
    toy = Toy(seed=1, k=3, draft=draft)
    ks = [1 + i % 3 for i in range(16000)]  # k = 1, 2, 3 mixed in one batch
    d, results = _run(toy, 16000, seed=2, row=_row(), use_q=use_q, ks=ks)
    assert all(len(r.token_ids) == r.num_accepted + 1 <= k + 1
               for r, k in zip(results, ks, strict=True))
    p_first, p_second, n_second = _first_and_second(toy, d, results)
    assert p_first > ALPHA and p_second > ALPHA
    assert n_second > (5000 if draft == "good" else 100)  # second tokens tested
    rate = sum(r.num_accepted for r in results) / sum(ks)
    assert {"good": rate > 0.6, "bad": rate < 0.3}.get(draft, True)  # acceptance follows q


def test_top_k_top_p_temperature_min_p_and_bans_apply_before_verification():
    toy = Toy(seed=3, k=2, draft="good")
    proc = {"temperature": 0.7, "top_k": 10, "top_p": 0.9, "min_p": 0.1, "banned": (2, 5)}
    row = _row(**{k: v for k, v in proc.items() if k != "banned"})
    d, results = _run(toy, 16000, seed=4, row=row, banned=proc["banned"])
    p_first, p_second, _ = _first_and_second(toy, d, results, **proc)
    assert p_first > ALPHA and p_second > ALPHA
    # seeded requests (each with its own generator) follow the same distribution
    rng = random.Random(0)
    d, results = _run(toy, 3000, seed=5, banned=proc["banned"],
                      row=lambda: _row(**{k: v for k, v in proc.items() if k != "banned"},
                                       generator=torch.Generator().manual_seed(
                                           rng.randrange(1 << 30))))
    assert _first_and_second(toy, d, results, **proc)[0] > ALPHA


def test_bonus_token_when_every_draft_is_accepted():
    toy = Toy(seed=6, k=2, draft="uniform")
    n, drafts = 16000, [3, 7]
    toy.t[0] = torch.full((V,), -1e4).index_fill_(0, torch.tensor([3]), 0.0)  # p_0(3) = 1
    toy.t[1][3] = torch.full((V,), -1e4).index_fill_(0, torch.tensor([7]), 0.0)
    logits = torch.stack([toy.t[0], toy.t[1][3], toy.t[2][7]]).repeat(n, 1)
    for q in (None, torch.full((2, V), 1.0 / V)):
        reqs = [VerifyRequest(_row(), drafts, q, [(), (), ()]) for _ in range(n)]
        results = verify(logits, reqs, torch.Generator().manual_seed(7))
        assert all(r.num_accepted == 2 and r.token_ids[:2] == drafts for r in results)
        bonus = torch.bincount(torch.tensor([r.token_ids[2] for r in results]), minlength=V)
        assert _chi2_pvalue([(bonus, _reference(toy.t[2][7]))]) > ALPHA


def test_the_chi_square_test_rejects_biased_samplers():
    """Power: always accepting the draft (first token = the draft), or verifying against a
    draft distribution other than the one drafts were drawn from, fails the same test."""
    toy = Toy(seed=1, k=3, draft="good")
    d, _ = toy.sample(16000, seed=2)[:2]
    p0 = _reference(toy.t[0])
    assert _chi2_pvalue([(torch.bincount(d[:, 0], minlength=V), p0)]) < 1e-6
    bad = Toy(seed=1, k=3, draft="bad")
    d, qp, logits, ks = bad.sample(16000, seed=2)
    lie = torch.full((3, V), 1.0 / V)  # claims uniform drafts
    reqs = [VerifyRequest(_row(), d[i].tolist(), lie, [()] * 4) for i in range(16000)]
    results = verify(logits, reqs, torch.Generator().manual_seed(3))
    first = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=V)
    assert _chi2_pvalue([(first, p0)]) < 1e-6


def _greedy_reference(logits, draft, banned):
    out = []
    for j in range(len(draft) + 1):
        x = logits[j].clone()
        x[list(banned[j])] = -math.inf
        best = int(x.argmax())
        out.append(draft[j] if j < len(draft) and draft[j] == best else best)
        if j == len(draft) or draft[j] != best:
            return out


def test_greedy_accepts_while_the_draft_is_the_argmax_after_bans():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    reqs, refs, blocks = [], [], []
    for i in range(300):
        k = rng.randint(1, 6)
        logits = torch.randn(k + 1, V, generator=g)
        banned = [tuple(rng.sample(range(V), rng.randint(0, 2))) for _ in range(k + 1)]
        draft = []
        for j in range(k):  # mostly the (banned) argmax, so acceptance runs vary
            x = logits[j].clone()
            x[list(banned[j])] = -math.inf
            draft.append(int(x.argmax()) if rng.random() < 0.8 else rng.randrange(V))
        blocks.append(logits)
        if i % 3 == 2:  # random rows in the same batch change nothing for the greedy ones
            reqs.append(VerifyRequest(_row(), draft, None, banned))
            refs.append(None)
            continue
        q = torch.full((k, V), 1.0 / V) if i % 2 else None  # ignored by greedy rows
        reqs.append(VerifyRequest(_row(temperature=0.0), draft, q, banned))
        refs.append(_greedy_reference(logits, draft, banned))
    results = verify(torch.cat(blocks), reqs, torch.Generator().manual_seed(1))
    lengths = set()
    for r, ref in zip(results, refs, strict=True):
        if ref is not None:
            assert r.token_ids == ref and r.num_accepted == len(ref) - 1
            lengths.add(r.num_accepted)
    assert len(lengths) >= 5  # cut-offs at many positions were exercised


def test_logprobs_are_the_raw_rows_of_the_emitted_tokens():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3 + 2 + 4, V, generator=g)
    reqs = [VerifyRequest(_row(num_logprobs=3), [1, 2], None, [(0,), (), ()]),
            VerifyRequest(_row(temperature=0.0), [int(logits[3].argmax())], None, [(), ()]),
            VerifyRequest(_row(temperature=0.0, num_logprobs=0),
                          [int(logits[5 + j].argmax()) for j in range(3)], None, [()] * 4)]
    results = verify(logits, reqs, torch.Generator().manual_seed(3))
    assert results[1].logprobs is None and results[2].num_accepted == 3
    raw = logits.log_softmax(dim=-1)
    for r, start, want in ((results[0], 0, 3), (results[2], 5, 0)):
        assert len(r.logprobs) == len(r.token_ids)
        for j, (t, entry) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
            top = raw[start + j].topk(want).indices.tolist() if want else []
            assert set(entry) == {t, *top}
            for tid, v in entry.items():
                assert v == pytest.approx(float(raw[start + j, tid]), abs=1e-5)


def test_seeded_rows_reproduce_and_ignore_the_batch_around_them():
    toy = Toy(seed=8, k=4, draft="good")
    d, qp, logits, ks = toy.sample(40, seed=9)

    def run(order, others):
        reqs, blocks = [], []
        for i in order:
            gen = torch.Generator().manual_seed(100 + i)
            reqs.append(VerifyRequest(_row(generator=gen), d[i].tolist(), qp[i], [()] * 5))
            blocks.append(logits[5 * i : 5 * i + 5])
            for _ in range(others):  # unseeded neighbours
                reqs.append(VerifyRequest(_row(), d[i].tolist(), qp[i], [()] * 5))
                blocks.append(logits[5 * i : 5 * i + 5])
        res = verify(torch.cat(blocks), reqs, torch.Generator().manual_seed(others))
        return {i: res[n * (others + 1)].token_ids for n, i in enumerate(order)}

    base = run(range(40), 0)
    assert run(range(40), 0) == base
    assert run(list(reversed(range(40))), 2) == base
    assert len({tuple(v) for v in base.values()}) > 10


def test_inputs_are_validated():
    logits = torch.zeros(3, V)
    ok = VerifyRequest(_row(), [1, 2], None, [(), (), ()])
    assert verify(logits, [ok], torch.Generator())[0].num_accepted >= 0
    assert verify(torch.zeros(0, V), [], torch.Generator()) == []
    for bad in (VerifyRequest(_row(), [1], None, [(), ()]),  # rows do not add up
                VerifyRequest(_row(), [1, V], None, [(), (), ()]),
                VerifyRequest(_row(), [1, -1], None, [(), (), ()]),
                VerifyRequest(_row(), [1, 2], None, [(), ()]),
                VerifyRequest(_row(), [1, 2], torch.zeros(2, V + 1), [(), (), ()])):
        with pytest.raises(ValueError):
            verify(logits, [bad], torch.Generator())
