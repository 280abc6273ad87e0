"""EAGLE-style proposer: a small head over the target's last-layer hidden states drafts
tokens through the target's own embedding and LM head.

Hidden states are the target's last-layer output *after* its final norm, i.e. exactly what
the LM head reads (`LlamaForCausalLM.forward(..., return_hidden=True)`); EAGLE's features
are these, and its head predicts features of the same kind, fed straight to the LM head.

Convention (token index p of `req.all_token_ids`, 0-based; f_p = the target's hidden at
position p, whose logits give the distribution of token p + 1):

- One head step: g_{p+1} = head(f_p, embed(x_{p+1})) ~ f_{p+1}; lm_head(g_{p+1}) drafts
  x_{p+2}. For a request of N tokens the first step takes f_{N-2} (the position whose
  logits produced the last token x_{N-1}) and x_{N-1}; later steps feed back g and the
  drafted token, k times.
- The runner delivers `hidden_states[rid]` = the request's rows of `hidden` (same order as
  its logits rows) for the positions whose sampled tokens were committed in the last step;
  the proposer reads the LAST row, which must be the row that produced the request's last
  token:
  - plain decode, or the prefill chunk that samples the first token: the one row, [1, H];
  - verification of k drafts with a accepted (0 <= a <= k): rows 0..a, [a + 1, H] (row a
    sampled the correction / bonus token; rows a+1..k scored rejected drafts: drop them).
  A request with no entry (a prefill chunk that sampled nothing) gets no proposal.
- With tensor parallelism the head runs on rank 0 alone: the hidden states (after the
  final norm, the same on every rank) are read there, and the embedding and LM head it
  chains through are unsharded copies read from the checkpoint (`target.load_heads`),
  never rank 0's vocabulary shards, whose collectives the other ranks would not join.
- The CUDA-graph decode path (`cuda_graphs.py`) returns logits only: steps whose hidden
  states are wanted run eagerly unless it is extended with a static hidden buffer.

What is built: `EagleHead` = fc(concat(embedding, hidden): 2H -> H, EAGLE's column order)
then one residual block x + SwiGLU(RMSNorm(x)), no final norm (as EAGLE-1), greedy or
sampled chains, batched over requests. Not built: the real EAGLE decoder layer's attention
over a KV cache of the head's own history (so only the last hidden row matters here), tree
drafts, EAGLE-3's multi-layer features and reduced draft vocabulary, MTP modules, training.

Weights: `speculative_config.model` = a .safetensors file with `fc.weight` [H, 2H]
(columns: embedding then hidden), optional `fc.bias` [H], `norm.weight` [H],
`mlp.gate_proj.weight` [I, H], `mlp.up_proj.weight` [I, H], `mlp.down_proj.weight` [H, I];
null = a random head (fixed seed, I = the target's intermediate size): the interface
demonstration and tests, not a useful draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.llama import RMSNorm
from tandem.engine.sampler import SamplingRow, processed_probs, sampling_params
from tandem.engine.spec_decode.base import Proposal, Proposer, ProposerContext, register_proposer

if TYPE_CHECKING:
    from tandem.engine.request import Request

_SEED_SALT = 0x5EED_EA61E  # a seeded request's draft generator: its seed ^ this


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleHead(nn.Module):
    """`forward(hidden [B, H], embeds [B, H]) -> predicted next hidden [B, H]`."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-6,
                 fc_bias: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=fc_bias)
        self.norm = RMSNorm(hidden_size, eps)
        self.mlp = _SwiGLU(hidden_size, intermediate_size)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        return x + self.mlp(self.norm(x))

    @classmethod
    def random(cls, hidden_size: int, intermediate_size: int, eps: float = 1e-6,
               seed: int = 0) -> EagleHead:
        """Weights ~ N(0, 1 / fan_in) from a generator seeded with `seed` (CPU, float32)."""
        head = cls(hidden_size, intermediate_size, eps)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name != "norm.weight":
                    p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        return head

    @classmethod
    def load(cls, path: str, hidden_size: int, eps: float = 1e-6) -> EagleHead:
        """From a .safetensors file of the tensors named in the module docstring."""
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
        except (OSError, ValueError) as exc:  # missing file, not safetensors
            raise ConfigError(f"speculative_config.model: cannot read EAGLE head weights "
                              f"{path!r}: {exc}") from exc
        gate = tensors.get("mlp.gate_proj.weight")
        inter = gate.shape[0] if gate is not None and gate.dim() == 2 else 1
        head = cls(hidden_size, inter, eps, fc_bias="fc.bias" in tensors)
        want = {n: tuple(p.shape) for n, p in head.state_dict().items()}
        if missing := sorted(set(want) - set(tensors)):
            raise ConfigError(f"EAGLE head {path!r} lacks tensors {missing}")
        if extra := sorted(set(tensors) - set(want)):
            raise ConfigError(f"EAGLE head {path!r} has unexpected tensors {extra[:5]}")
        for name, shape in want.items():
            if tuple(tensors[name].shape) != shape:
                raise ConfigError(f"EAGLE head tensor {name!r} has shape "
                                  f"{tuple(tensors[name].shape)}, expected {shape}")
        head.load_state_dict({n: t.float() for n, t in tensors.items()})
        return head


@register_proposer("eagle")
class EagleProposer(Proposer):
    """Drafts k tokens per request by chaining `EagleHead` through the target's
    full-vocabulary embedding and LM head (`ctx.heads()`: the target's own with one rank, an
    unsharded copy on rank 0 with tensor parallelism); greedy requests get argmax drafts
    (`draft_probs` None), random ones sample their processed draft distribution
    (temperature / top-k / top-p / min-p, renormalised) and get `draft_probs` [k, V]."""

    needs_hidden_states = True

    def __init__(self, ctx: ProposerContext) -> None:
        self.ctx = ctx
        heads = ctx.heads()
        self.embed_tokens, self.lm_head, self.vocab_size = (heads.embed_tokens, heads.lm_head,
                                                            heads.config.vocab_size)
        cfg = heads.config  # the whole target's (a rank's shard has fewer MLP columns)
        path = ctx.config.model
        head = (EagleHead.load(path, cfg.hidden_size, cfg.rms_norm_eps) if path else
                EagleHead.random(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps))
        self.head = head.to(device=ctx.device, dtype=ctx.dtype).eval()
        seed = int(getattr(ctx.engine_config, "seed", 0) or 0)
        self.generator = torch.Generator(device=ctx.device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' draft noise

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.ctx.device).manual_seed(seed ^ _SEED_SALT)
            self.generators[req.request_id] = gen
        return gen

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int],
                hidden_states: dict[str, Any] | None = None) -> list[Proposal | None]:
        out: list[Proposal | None] = [None] * len(requests)
        hs = hidden_states or {}
        ks = [min(k, self.ctx.max_model_len - r.num_tokens) for r, k in zip(
            requests, num_tokens, strict=True)]
        live = [i for i, r in enumerate(requests)
                if ks[i] > 0 and r.request_id in hs and hs[r.request_id].shape[0] > 0]
        if not live:
            return out
        dev, reqs = self.ctx.device, [requests[i] for i in live]
        h = torch.stack([hs[r.request_id][-1] for r in reqs]).to(dev, self.ctx.dtype)
        tok = torch.tensor([r.all_token_ids[-1] for r in reqs], dtype=torch.int64, device=dev)
        rand = [j for j, r in enumerate(reqs) if not r.sampling_params.greedy]
        rows = [_row(reqs[j]) for j in rand]
        params = sampling_params(rows, self.vocab_size, dev) if rand else None
        rand_t = torch.tensor(rand, dtype=torch.int64, device=dev)
        gens = [self._generator(reqs[j]) for j in rand]
        steps, step_probs = [], []
        for step in range(max(ks[i] for i in live)):
            h = self.head(h, self.embed_tokens(tok))
            logits = self.lm_head(h).float()
            for j, r in enumerate(reqs):  # min_tokens: the target bans these too
                sp = r.sampling_params
                if r.num_output_tokens + step < sp.min_tokens:
                    ban = [t for t in (*r.eos_token_ids, *(sp.stop_token_ids or ()))
                           if 0 <= t < logits.shape[1]]
                    if ban:
                        logits[j, ban] = float("-inf")
            tok = logits.argmax(dim=-1)
            if rand:
                probs = processed_probs(logits.index_select(0, rand_t), params, rows)
                probs = probs / probs.sum(dim=-1, keepdim=True)
                noise = torch.empty_like(probs)
                for n, gen in enumerate(gens):
                    noise[n].exponential_(generator=gen)
                tok = tok.index_copy(0, rand_t, (probs / noise).argmax(dim=-1))
                step_probs.append(probs)
            steps.append(tok)
        drafted = torch.stack(steps, dim=1).tolist()  # [B, kmax], one device-to-host copy
        all_probs = torch.stack(step_probs, dim=1) if rand else None  # [R, kmax, V]
        slot = {j: n for n, j in enumerate(rand)}
        for j, i in enumerate(live):
            k = ks[i]
            dp = all_probs[slot[j], :k] if j in slot and all_probs is not None else None
            out[i] = Proposal(drafted[j][:k], dp)
        return out


def _row(req: Request) -> SamplingRow:
    """The request's temperature / top-k / top-p / min-p (penalised requests do not
    speculate; bans are applied per draft position by the caller)."""
    sp = req.sampling_params
    return SamplingRow(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                       min_p=sp.min_p, repetition_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0, generator=None, banned_token_ids=(),
                       prompt_token_ids=req.prompt_token_ids,
                       output_token_ids=req.output_token_ids, num_logprobs=None)
