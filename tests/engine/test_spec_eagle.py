"""EAGLE-style proposer: the model's hidden states and a random head, on a tiny random
Llama built in memory (no bundled model), against plain-torch references."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.attention.base import AttentionSpec, BatchLayout
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.errors import ConfigError
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.hf_loader import expected_weight_shapes
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode import ProposerContext, SpeculativeConfig, build_proposer
from tandem.engine.spec_decode.eagle import EagleHead, EagleProposer

CPU, BS = torch.device("cpu"), 16
CFG = ModelArchConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)


@pytest.fixture(scope="module")
def target() -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    weights = {n: torch.randn(s, generator=gen) * (0.5 if "norm" not in n else 0.1) + (
        1.0 if "norm" in n else 0.0) for n, s in expected_weight_shapes(CFG).items()}
    spec = AttentionSpec(CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.head_dim ** -0.5,
                         None)
    with torch.device("meta"):
        model = LlamaForCausalLM(CFG, TorchAttentionBackend(spec, BS, torch.float32, CPU))
    model.materialize(CPU, torch.float32)
    model.load_weights(weights)
    return model.eval(), weights


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * w


def _ref_hidden(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Dense causal float64 forward -> post-final-norm hidden states [T, H]."""
    w = {n: t.double() for n, t in w.items()}
    t, d, nh, nkv = len(ids), CFG.head_dim, CFG.num_heads, CFG.num_kv_heads
    inv = 1.0 / CFG.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]

    def rope(x: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(CFG.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, d))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, -math.inf).softmax(-1), v)
        x = x + a.reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
                 ) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"])


def _forward(model, ids: list[int], rows: list[int], **kw):
    n = len(ids)
    backend = model.layers[0].self_attn.backend
    caches = [backend.allocate_kv_cache(cdiv(n, BS)) for _ in model.layers]
    layout = BatchLayout([n], [n], [list(range(cdiv(n, BS)))], torch.arange(n), 0, BS)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(n), caches, backend.build_metadata(layout),
                     torch.tensor(rows), **kw)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


def test_return_hidden_gives_the_lm_head_inputs_of_the_logits_rows(target):
    model, weights = target
    ids, rows = _ids(1, 21), [3, 20, 7, 7]
    plain = _forward(model, ids, rows)
    logits, hidden = _forward(model, ids, rows, return_hidden=True)
    assert torch.equal(plain, logits)  # the default path is unchanged
    assert hidden.shape == (len(rows), CFG.hidden_size) and hidden.dtype == torch.float32
    ref = _ref_hidden(weights, ids)[rows]
    torch.testing.assert_close(hidden.double(), ref, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(logits, model.lm_head(hidden), rtol=0, atol=0)


def _ctx(model, method_model: str | None = None, seed: int = 0) -> ProposerContext:
    return ProposerContext(SpeculativeConfig(method="eagle", model=method_model),
                           SimpleNamespace(seed=seed), model, "", CPU, torch.float32,
                           CFG.vocab_size, BS, 64, 8)


def _req(rid: str, ids: list[int], **sp) -> Request:
    params = SamplingParams(max_tokens=32, **sp)
    return Request(rid, list(ids), params, 32)


def _hidden(model, ids: list[int]) -> torch.Tensor:
    """Rows 0 .. N-2 (garbage-free, real): the last is position N-2, as the runner gives."""
    return _forward(model, ids, list(range(len(ids) - 1)), return_hidden=True)[1]


def _ref_logits(model, sd, f: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """Hand-computed head chain, teacher-forced on `tokens` (the last committed one, then
    the drafts): the draft logits of each step."""
    out = []
    for x in tokens:
        z = torch.cat((model.embed_tokens.weight[x], f)) @ sd["fc.weight"].T
        n = _rms(z, sd["norm.weight"])
        z = z + sd["mlp.down_proj.weight"] @ (F.silu(sd["mlp.gate_proj.weight"] @ n)
                                              * (sd["mlp.up_proj.weight"] @ n))
        out.append(model.lm_head.weight @ z)
        f = z
    return out


def _ref_greedy(model, sd, f: torch.Tensor, last: int, k: int) -> list[int]:
    toks = [last]
    for _ in range(k):
        toks.append(int(_ref_logits(model, sd, f, toks)[-1].argmax()))
    return toks[1:]


def test_greedy_drafts_follow_the_hand_computed_chain_batched(target):
    model, _ = target
    prop = build_proposer(_ctx(model))
    assert isinstance(prop, EagleProposer) and prop.needs_hidden_states
    sd = {n: t.detach() for n, t in prop.head.state_dict().items()}
    prompts = [_ids(10 + i, n) for i, n in enumerate((5, 17, 9, 12))]
    reqs = [_req(f"g{i}", p, temperature=0.0) for i, p in enumerate(prompts)]
    ks = [4, 2, 3, 5]
    hs = {r.request_id: _hidden(model, r.all_token_ids) for r in reqs[:3]}  # g3: none
    with torch.inference_mode():
        props = prop.propose(reqs, ks, hs)
        refs = [_ref_greedy(model, sd, hs[r.request_id][-1], r.all_token_ids[-1], k)
                for r, k in zip(reqs[:3], ks, strict=False)]
    assert props[3] is None
    for p, ref, k in zip(props, refs, ks, strict=False):
        assert p.draft_probs is None and len(p.token_ids) == k
        assert p.token_ids == ref
    assert len(set(map(tuple, refs))) > 1  # the chains differ by request


def _top(logits: torch.Tensor, temp: float, top_k: int, top_p: float) -> torch.Tensor:
    probs = (logits.double() / temp).softmax(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True)
    if top_k:
        order = order[:top_k]
    sub = probs[order] / probs[order].sum()
    kept = order[(sub.cumsum(0) - sub) <= top_p]
    keep[kept] = True
    p = probs * keep
    return p / p.sum()


def test_random_drafts_return_their_processed_distributions(target):
    model, _ = target
    prop = EagleProposer(_ctx(model, seed=4))
    sd = {n: t.detach() for n, t in prop.head.state_dict().items()}
    settings = [dict(temperature=0.7, top_k=10), dict(temperature=1.3, top_p=0.8),
                dict(temperature=0.0), dict(temperature=1.0, seed=123)]
    reqs = [_req(f"s{i}", _ids(30 + i, 8 + i), **s) for i, s in enumerate(settings)]
    ks = [3, 4, 2, 3]
    hs = {r.request_id: _hidden(model, r.all_token_ids) for r in reqs}
    with torch.inference_mode():
        props = prop.propose(reqs, ks, hs)
    assert props[2].draft_probs is None
    for r, p, k, s in zip(reqs, props, ks, settings, strict=True):
        if s["temperature"] == 0.0:
            continue
        dp = p.draft_probs
        assert dp.shape == (k, CFG.vocab_size) and dp.dtype == torch.float32
        assert dp.device == CPU
        torch.testing.assert_close(dp.sum(-1), torch.ones(k), rtol=0, atol=1e-5)
        assert all(dp[j, t] > 0 for j, t in enumerate(p.token_ids))
        with torch.inference_mode():
            chain = _ref_logits(model, sd, hs[r.request_id][-1],
                                [r.all_token_ids[-1], *p.token_ids[:-1]])
        for j, lg in enumerate(chain):
            ref = _top(lg, s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0))
            torch.testing.assert_close(dp[j].double(), ref, rtol=1e-4, atol=1e-6)
    # a seeded request drafts the same alone as in a batch
    with torch.inference_mode():
        alone = EagleProposer(_ctx(model, seed=99)).propose([reqs[3]], [3], hs)[0]
    assert alone.token_ids == props[3].token_ids


def test_sampled_first_drafts_follow_draft_probs(target):
    """Chi-square at significance 0.001 (Wilson-Hilferty critical value), fixed seed."""
    model, _ = target
    prop = EagleProposer(_ctx(model, seed=7))
    ids = _ids(50, 11)
    reqs = [_req(f"c{i}", ids, temperature=1.5) for i in range(3000)]
    h = _hidden(model, ids)
    with torch.inference_mode():
        props = prop.propose(reqs, [1] * len(reqs), {r.request_id: h for r in reqs})
    p = props[0].draft_probs[0].double()
    counts = torch.bincount(torch.tensor([q.token_ids[0] for q in props]),
                            minlength=CFG.vocab_size).double()
    expected = p * len(reqs)
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    df = int(big.sum())  # bins - 1, the pooled tail bin included
    crit = df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3
    assert df > 10 and stat < crit


def test_head_weights_load_from_safetensors(target, tmp_path):
    from safetensors.torch import save_file

    model, _ = target
    head = EagleHead.random(CFG.hidden_size, 40, CFG.rms_norm_eps, seed=11)
    sd = {n: t.detach().clone() for n, t in head.state_dict().items()}
    path = str(tmp_path / "head.safetensors")
    save_file(sd, path)
    prop = EagleProposer(_ctx(model, path))
    assert all(torch.equal(prop.head.state_dict()[n], t) for n, t in sd.items())
    req = _req("w", _ids(60, 9), temperature=0.0)
    h = _hidden(model, req.all_token_ids)
    with torch.inference_mode():
        got = prop.propose([req], [4], {"w": h})[0].token_ids
        assert got == _ref_greedy(model, sd, h[-1], req.all_token_ids[-1], 4)
    for bad in ({**sd, "extra.weight": torch.zeros(2)},
                {n: t for n, t in sd.items() if n != "norm.weight"},
                {**sd, "fc.weight": torch.zeros(CFG.hidden_size, CFG.hidden_size)}):
        save_file(bad, path)
        with pytest.raises(ConfigError):
            EagleProposer(_ctx(model, path))
    with pytest.raises(ConfigError):
        EagleProposer(_ctx(model, str(tmp_path / "missing.safetensors")))


def test_min_tokens_bans_reach_the_drafts(target):
    model, _ = target
    prop = EagleProposer(_ctx(model))
    sd = {n: t.detach() for n, t in prop.head.state_dict().items()}
    ids = _ids(70, 10)
    h = _hidden(model, ids)
    with torch.inference_mode():
        free = _ref_greedy(model, sd, h[-1], ids[-1], 3)
        req = Request("m", ids, SamplingParams(max_tokens=32, temperature=0.0, min_tokens=2),
                      32, eos_token_ids=(free[0],))
        got = prop.propose([req], [3], {"m": h})[0].token_ids
    assert got[0] != free[0]  # banned while fewer than min_tokens outputs exist
    assert free[0] not in got[:2]


def test_eagle_config_takes_an_optional_head_path_only():
    assert SpeculativeConfig.from_dict({"method": "eagle"}).model is None
    assert SpeculativeConfig.from_dict({"method": "eagle", "model": "h.safetensors"}).model
    for bad in ({"model": ""}, {"draft_num_layers": 2}, {"draft_quantization": "int8"}):
        with pytest.raises(ConfigError):
            SpeculativeConfig.from_dict({"method": "eagle", **bad})
    with pytest.raises(ConfigError):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "h.safetensors"})
