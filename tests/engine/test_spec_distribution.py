"""Distribution exactness of speculative sampling in the real engine: with a tiny random
model and fixed seeds, the tokens sampled with speculation follow the target's distribution
(temperature, top-k, top-p applied), whatever the proposer: a separate draft model and the
int8 self-draft (sampled drafts with their probabilities; rarely and mostly accepted), a
deliberately bad draft (uniform over the whole vocabulary) and a point-mass proposer (always
the target's likeliest second token, as n-gram drafts are point masses). Checked by
Pearson's chi-square on the marginals of the second and third sampled tokens (both verified
positions), against the exact marginals computed from transformers' forward of the same
checkpoint and the engine's own processing of the logits.

Significance: each test fails when p < 0.001 (10 checks: a family-wise 1 % rate for a
correct verifier; the seeds are fixed, so a run is reproducible). The negative control
shows the test has power: a verifier that skips the request's temperature / top-k / top-p
(compares drafts with the raw softmax) is rejected with p < 1e-9 at the same sample size.
(Treating a sampled draft as a point mass is not such a bug: rejection sampling is exact for
any proposal, the realised draft included; it only accepts less.)
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.sampler import SamplingRow, processed_probs, sampling_params
from tandem.engine.spec_decode import Proposal, Proposer, register_proposer

from .utils import make_tiny_model_dir

pytestmark = pytest.mark.slow

VOCAB = 1024
N = 2000  # requests per case
PROMPT = [1, 17, 230, 5, 801, 64, 12]
SP = dict(temperature=0.8, top_k=12, top_p=0.95)
ALPHA = 1e-3
POINT = {"token": 0}  # set by `exact`: the likeliest second token


@register_proposer("test-uniform-draft")
class UniformDraft(Proposer):
    """Drafts uniform over the whole vocabulary, with honest probabilities: q is as far from
    the target's top-k as a draft gets (about 1 % of drafts land in the target's support)."""

    def __init__(self, ctx) -> None:  # noqa: ANN001 - ProposerContext
        self.rng = random.Random(99)
        self.vocab = ctx.vocab_size

    def propose(self, requests, num_tokens, hidden_states=None):  # noqa: ANN001, ANN201
        return [Proposal([self.rng.randrange(self.vocab) for _ in range(k)],
                         torch.full((k, self.vocab), 1.0 / self.vocab)) for k in num_tokens]


@register_proposer("test-point-draft")
class PointDraft(Proposer):
    """Always proposes `POINT["token"]`, as a point mass (draft_probs None)."""

    def __init__(self, ctx) -> None:  # noqa: ANN001 - ProposerContext
        pass

    def propose(self, requests, num_tokens, hidden_states=None):  # noqa: ANN001, ANN201
        return [Proposal([POINT["token"]] * k) for k in num_tokens]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("dist-target")
    make_tiny_model_dir(target, "llama", seed=21, num_hidden_layers=3, vocab_size=VOCAB)
    draft = tmp_path_factory.mktemp("dist-draft")
    make_tiny_model_dir(draft, "llama", seed=22, vocab_size=VOCAB)
    return target, draft


def _probs(logits: torch.Tensor) -> torch.Tensor:
    """The engine's processed distribution of `SP` over logits [R, V]."""
    rows = [SamplingRow(temperature=SP["temperature"], top_k=SP["top_k"], top_p=SP["top_p"],
                        min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, generator=None, banned_token_ids=(),
                        prompt_token_ids=(), output_token_ids=(), num_logprobs=None)
            for _ in range(logits.shape[0])]
    p = processed_probs(logits.float(), sampling_params(rows, logits.shape[-1], logits.device),
                        rows)
    p = p.double()
    return p / p.sum(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def exact(models) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact marginals [V] of the 2nd and 3rd sampled tokens, from transformers' logits."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    hf.eval()

    @torch.inference_mode()
    def nxt(ctxs: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(ctxs)
        return _probs(hf(ids).logits[:, -1])

    p1 = nxt([PROMPT])[0]
    t1s = torch.nonzero(p1).flatten().tolist()
    p2_given = nxt([PROMPT + [a] for a in t1s])  # [len(t1s), V]
    m2 = (p1[t1s][:, None] * p2_given).sum(0)
    m3 = torch.zeros(VOCAB, dtype=torch.float64)
    for i, a in enumerate(t1s):
        t2s = torch.nonzero(p2_given[i]).flatten().tolist()
        p3 = nxt([PROMPT + [a, b] for b in t2s])
        m3 += (p1[a] * p2_given[i][t2s][:, None] * p3).sum(0)
    assert abs(float(m2.sum()) - 1) < 1e-9 and abs(float(m3.sum()) - 1) < 1e-9
    POINT["token"] = int(m2.argmax())
    return m2, m3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of `counts` [V] against `probs` [V]; categories with an
    expected count under 5 are pooled into one (and a sampled token of probability 0 fails
    outright)."""
    n = float(counts.sum())
    expected = probs * n
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _sample(target, spec: dict | None) -> tuple[torch.Tensor, torch.Tensor, LLM]:
    llm = LLM(model=str(target), seed=1234, max_num_seqs=256, block_size=4,
              **({"speculative_config": spec} if spec else {}))
    sp = SamplingParams(max_tokens=3, ignore_eos=True, **SP)
    outs = llm.generate([PROMPT] * N, sp)
    toks = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
    c2 = torch.bincount(toks[:, 1], minlength=VOCAB)
    c3 = torch.bincount(toks[:, 2], minlength=VOCAB)
    return c2, c3, llm


CASES = {
    "none": None,
    "draft-model": {"method": "draft", "model": "", "num_speculative_tokens": 2,
                    "adaptive": False},  # "": the separate tiny draft
    "self-draft-int8": {"method": "draft", "model": "self", "draft_quantization": "int8",
                        "num_speculative_tokens": 2, "adaptive": False},
    "uniform-bad-draft": {"method": "test-uniform-draft", "num_speculative_tokens": 2,
                          "adaptive": False},
    "point-mass": {"method": "test-point-draft", "num_speculative_tokens": 2,
                   "adaptive": False},
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_follow_the_target_distribution(models, exact, case):
    spec = CASES[case]
    if spec is not None and spec.get("model") == "":
        spec = {**spec, "model": str(models[1])}
    c2, c3, llm = _sample(models[0], spec)
    if spec is not None:  # speculation really ran, with rejections and acceptances
        st = llm.engine.stats()
        assert st.spec_num_draft_tokens >= N
        assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
        spc = llm.engine.speculator  # the engine hands step timings to the policy
        measured = spc.proposer.round_cost() is not None
        assert measured == (spec["method"] == "draft")
        assert (spc.policy.draft_cost > 0) == measured and spc.policy._unit_s > 0
    m2, m3 = exact
    p2, p3 = chi_square_p(c2, m2), chi_square_p(c3, m3)
    assert p2 >= ALPHA and p3 >= ALPHA, (case, p2, p3)


def test_negative_control_a_verifier_on_unprocessed_target_probabilities_is_caught(
        models, exact, monkeypatch):
    """The verifier compares drafts with the raw softmax instead of the processed target
    distribution (temperature / top-k / top-p skipped): caught at the same sample size."""
    from tandem.engine.spec_decode import rejection

    monkeypatch.setattr(rejection, "processed_probs",
                        lambda logits, params, rows: logits.float().softmax(dim=-1))
    c2, c3, _ = _sample(models[0], CASES["self-draft-int8"])
    m2, m3 = exact
    assert min(chi_square_p(c2, m2), chi_square_p(c3, m3)) < 1e-9


def test_chi_square_helper():
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    assert chi_square_p(torch.tensor([500, 250, 250, 0]), probs) == pytest.approx(1.0)
    assert chi_square_p(torch.tensor([600, 200, 200, 0]), probs) < 1e-8
    assert chi_square_p(torch.tensor([500, 250, 249, 1]), probs) == 0.0
    # under the null, p-values are roughly uniform: about 10 % fall under 0.1
    gen = torch.Generator().manual_seed(0)
    ps = [chi_square_p(torch.bincount(torch.multinomial(probs.float(), 400, True,
                                                        generator=gen), minlength=4), probs)
          for _ in range(400)]
    assert 0.05 < sum(p < 0.1 for p in ps) / len(ps) < 0.16
