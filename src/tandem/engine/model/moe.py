"""Mixture-of-experts MLP: a router, top-k routing with each family's normalisation, and
the experts run grouped by expert.

Routing (`route`, in float32 as transformers computes it): softmax over all experts, the
top k, renormalised to sum 1 when `MoESpec.renormalize` (Mixtral always; Qwen3-MoE when
`norm_topk_prob`). Mixtral multiplies each expert's output by its float32 weight;
Qwen3-MoE first casts the weights to the activation dtype (`weights_in_act_dtype`).

Execution (`FusedMoE.forward`): the T*k (token, expert) assignments are sorted by expert
once (`group_by_expert`); each expert's gate_up -> SiLU-and-mul -> down runs over its
contiguous segment of gathered rows; the outputs are weighted, put back in (token, slot)
order and summed over each token's k slots. Backends:
- torch (any device): float experts stacked as `w13 [E, 2I, H]` (gate rows then up rows)
  and `w2 [E, H, I]`, one matmul pair per expert that got tokens; quantized experts
  (`quantize`, or a pre-quantized checkpoint's codes) are one `QuantLinear` pair per
  expert, so every linear method (int8 / int4 / fp8 / w8a8, GPTQ / AWQ / FP8 layouts)
  serves them with its own kernels; on the CPU, float32 experts are packed the same way
  (`convert_all_experts`, the "packed" panels). This path reads each expert's token count
  back to the host, so a CUDA graph cannot capture it (`capturable`).
- triton (the Triton attention backend's engines, float experts):
  `kernels/triton_moe.fused_moe`: two grouped-GEMM launches over the stacked weights, no
  host synchronisation.
`loop_experts` is transformers' per-expert loop (mask, index, compute, index_add): the
reference the grouped paths are tested and benchmarked against.

`MoEDecoderForCausalLM` is the decoder of the MoE families (`mixtral.py`, `qwen3_moe.py`):
its sparse layers' MLP is a `FusedMoE` whose checkpoint tensors are `mlp.gate.weight` and
`mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`. LoRA adapts their attention only.

Tensor parallelism is expert parallelism: rank r of N holds experts
[r E/N, (r+1) E/N) whole (`experts` range) and computes the replicated router over all E;
assignments to other ranks' experts contribute nothing here, and the partial sum is
all-reduced like the dense MLP's `down_proj` (`parallel.tp`). Each rank keeps exactly the
unsharded experts' weights (quantized codes and scales included), every GEMM keeps the
expert's full size, and a rank reads 1/N of the expert weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.decoder import DecoderForCausalLM
from tandem.engine.model.layers import RowTarget, rows
from tandem.engine.model.ops import Ops
from tandem.engine.quant.base import LinearMethod, QuantLinear


@dataclass(frozen=True)
class MoESpec:
    """One MoE MLP: `num_experts` experts of `intermediate_size` (each a SwiGLU MLP of
    `hidden_size`), `top_k` per token."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    renormalize: bool = True  # top-k weights renormalised to sum 1
    weights_in_act_dtype: bool = False  # routing weights cast to the activations' dtype

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k {self.top_k} of {self.num_experts} experts")
        if self.hidden_size < 1 or self.intermediate_size < 1:
            raise ConfigError("MoE hidden and intermediate sizes must be positive")


# the router and each expert's linears, under a layer's "model.layers.{i}.mlp." (Qwen-MoE's
# names; a family whose checkpoint names differ renames them as they are read)
ROUTER = "gate.weight"
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")


def expert_range(num_experts: int, rank: int, world: int) -> range:
    """The experts rank `rank` of `world` holds (ConfigError unless `world` divides E)."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"tensor-parallel rank {rank} of {world}")
    if num_experts % world:
        raise ConfigError(f"tensor_parallel_size {world} must divide the model's "
                          f"{num_experts} experts (each rank holds whole experts)")
    n = num_experts // world
    return range(rank * n, (rank + 1) * n)


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): softmax
    over all experts in float32, the top k, renormalised to sum 1 if `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class ExpertGroups:
    """The T*k assignments sorted by expert: `order` [T*k] (indices into the flattened
    [T, k] ids), `tokens` [T*k] (each sorted assignment's token), `counts` (host ints, one
    per expert bucket, in order: contiguous segments of `order`)."""

    order: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]


def group_by_expert(ids: torch.Tensor, buckets: int) -> ExpertGroups:
    """ids [T, k] (values in [0, buckets)) -> their grouping: one stable sort (tokens keep
    their order inside an expert's segment) and one count per bucket."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=buckets).tolist()
    return ExpertGroups(order, order // ids.shape[1], counts)


def _weighted(y: torch.Tensor, w: torch.Tensor, in_act_dtype: bool) -> torch.Tensor:
    """Expert outputs y [n, H] times their routing weights w [n] (float32), as transformers:
    in float32 then cast (Mixtral), or with w first cast to y's dtype (Qwen3-MoE)."""
    if in_act_dtype:
        return y * w.to(y.dtype)[:, None]
    return (y.float() * w[:, None]).to(y.dtype)


def loop_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 weights: torch.Tensor, ids: torch.Tensor,
                 weights_in_act_dtype: bool = False) -> torch.Tensor:
    """transformers' per-expert loop: for each expert hit, mask its (token, slot) pairs,
    index their rows, run gate_up / SiLU-and-mul / down, weight, `index_add_` back.
    x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights / ids [T, k] -> [T, H]."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], w13[e]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, _weighted(y, weights[token, slot], weights_in_act_dtype))
    return out


class ExpertMLP(nn.Module):
    """One expert as two linears (`gate_up_proj` [2I, H]: gate rows then up rows;
    `down_proj` [H, I]): how quantized experts are stored."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down


@dataclass(frozen=True)
class SkipWeight:
    """A load target that takes nothing (`copy_` drops the tensor): a weight of an expert
    another tensor-parallel rank holds. The checkpoint must still have it."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def copy_(self, tensor: torch.Tensor) -> SkipWeight:
        return self


class FusedMoE(nn.Module):
    """Router + this rank's experts: `forward(x [T, H]) -> [T, H]`, the sum over each
    token's top-k experts held here of weight * expert(x) (all of them with one rank).

    `experts`: the global expert ids held (default: all). `backend`: "torch" or "triton"
    (float experts through the fused kernels; quantized experts always run grouped through
    their `QuantLinear`s); None: "triton" when `ops` uses the Triton kernels. The router
    (`gate`, [E, H], no bias) stays float."""

    def __init__(self, spec: MoESpec, ops: Ops | None = None, experts: range | None = None,
                 backend: str | None = None) -> None:
        super().__init__()
        ops = ops or Ops(native=False)
        if backend is None:
            backend = "triton" if ops.triton is not None else "torch"
        if backend not in ("torch", "triton"):
            raise ConfigError(f"unknown MoE backend {backend!r} (torch, triton)")
        self.spec, self.ops, self.backend = spec, ops, backend
        self.local = range(spec.num_experts) if experts is None else experts
        if not (self.local.start >= 0 and self.local.stop <= spec.num_experts
                and len(self.local) > 0 and self.local.step == 1):
            raise ConfigError(f"experts {self.local} of {spec.num_experts}")
        n, h, i = len(self.local), spec.hidden_size, spec.intermediate_size
        self.gate = nn.Linear(h, spec.num_experts, bias=False)
        self.w13: nn.Parameter | None = nn.Parameter(torch.empty(n, 2 * i, h))
        self.w2: nn.Parameter | None = nn.Parameter(torch.empty(n, h, i))
        self.experts: nn.ModuleList | None = None

    @property
    def quantized(self) -> bool:
        """Whether the experts are `QuantLinear` pairs (quantized, or packed for the CPU)
        rather than the float stacks."""
        return self.experts is not None

    @property
    def capturable(self) -> bool:
        """Whether a forward runs without reading anything back to the host (a CUDA graph
        can capture it): the Triton kernels over float experts; the grouped torch path
        reads each expert's token count."""
        return self.backend == "triton" and not self.quantized

    def quantize(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Store the experts as `QuantLinear` pairs of `method` (activations in `dtype`)
        instead of the stacked float weights. Call on the meta device, before the model is
        materialised (as `quant.apply.prepare_model`)."""
        h, i = self.spec.hidden_size, self.spec.intermediate_size
        self.w13 = self.w2 = None
        self.experts = nn.ModuleList(
            ExpertMLP(QuantLinear(method, h, 2 * i, False, dtype),
                      QuantLinear(method, i, h, False, dtype)) for _ in self.local)

    def convert_experts(self, method: LinearMethod) -> None:
        """Loaded float experts -> `QuantLinear` pairs of `method` (the CPU's "packed"
        panels, as `quant.apply.convert_linears` does for the dense linears), one expert at
        a time on the weights' device; the stacked weights are dropped."""
        w13, w2 = self.w13.detach(), self.w2.detach()
        self.w13 = self.w2 = None
        experts = []
        for e in range(len(self.local)):
            pair = []
            for w in (w13[e], w2[e]):
                with torch.device(w.device):
                    layer = QuantLinear(method, w.shape[1], w.shape[0], False, w.dtype)
                method.load(layer, 0, w)
                method.finish(layer)
                pair.append(layer)
            experts.append(ExpertMLP(*pair))
        self.experts = nn.ModuleList(experts)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | RowTarget | SkipWeight]:
        """HF weight name -> the tensor it fills (a view of the stacked weights), the rows
        of an expert's `QuantLinear`, or a `SkipWeight` for the experts other ranks hold.
        `prefix`: "model.layers.{i}.mlp."; names `gate.weight` (the router) and
        `experts.{e}.{gate_proj,up_proj,down_proj}.weight`."""
        spec, i, h = self.spec, self.spec.intermediate_size, self.spec.hidden_size
        out: dict[str, torch.Tensor | RowTarget | SkipWeight] = {
            prefix + ROUTER: self.gate.weight}
        gate, up, down = EXPERT_LINEARS
        for e in range(spec.num_experts):
            p = f"{prefix}experts.{e}."
            parts = {p + f"{gate}.weight": ("gate_up", 0, i),
                     p + f"{up}.weight": ("gate_up", i, i),
                     p + f"{down}.weight": ("down", 0, h)}
            if e not in self.local:
                out.update({name: SkipWeight((n, h if kind == "gate_up" else i))
                            for name, (kind, _, n) in parts.items()})
                continue
            le = e - self.local.start
            for name, (kind, start, n) in parts.items():
                if self.experts is not None:
                    mlp = self.experts[le]
                    layer = mlp.gate_up_proj if kind == "gate_up" else mlp.down_proj
                    out[name] = rows(layer, "weight", start, n)
                else:
                    stacked = self.w13 if kind == "gate_up" else self.w2
                    out[name] = stacked[le, start:start + n]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.spec.top_k, self.spec.renormalize)
        if self.spec.weights_in_act_dtype:  # Qwen3-MoE: weights rounded to the act dtype
            weights = weights.to(x.dtype).float()
        n_local = len(self.local)
        if n_local != self.spec.num_experts:  # other ranks' experts -> bucket n_local
            ids = ids - self.local.start
            ids = ids.masked_fill((ids < 0) | (ids >= n_local), n_local)
        if self.backend == "triton" and not self.quantized:
            from tandem.engine.kernels.triton_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, ids)
        return self.grouped(x, weights, ids)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """The torch path: x [T, H], routing weights [T, k] float32 and local expert ids
        [T, k] (== number of local experts: held elsewhere, skipped) -> [T, H]."""
        n_local = len(self.local)
        groups = group_by_expert(ids, n_local + 1)
        xs = x.index_select(0, groups.tokens)  # [T*k, H], sorted by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(groups.counts[:n_local]):
            if n:
                ys[start:start + n] = self._expert(e, xs[start:start + n])
            start += n
        kept = start  # the assignments to other ranks' experts sort last
        t, k = ids.shape
        w = weights.reshape(-1).index_select(0, groups.order[:kept])
        # back to [T, k] order (no duplicate indices: a plain copy, where an index_add_ of
        # repeated tokens is a slow scatter on the CPU), then each token's k rows summed
        slots = x.new_zeros(t * k, x.shape[1]) if kept < t * k else torch.empty_like(xs)
        slots.index_copy_(0, groups.order[:kept], _weighted(ys[:kept], w, False))
        return slots.view(t, k, x.shape[1]).sum(dim=1)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e over rows x [n, H] -> [n, H]."""
        if self.experts is not None:
            mlp = self.experts[e]
            return mlp.down_proj(self.ops.silu_mul(mlp.gate_up_proj(x)))
        return F.linear(self.ops.silu_mul(F.linear(x, self.w13[e])), self.w2[e])

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts as float32 stacks (w13 [n, 2I, H], w2 [n, H, I]): exactly the
        weights the layer computes with."""
        if self.experts is None:
            return self.w13.detach().float(), self.w2.detach().float()
        return (torch.stack([m.gate_up_proj.method.dequantize(m.gate_up_proj)
                             for m in self.experts]),
                torch.stack([m.down_proj.method.dequantize(m.down_proj)
                             for m in self.experts]))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"experts={s.num_experts} (held {self.local.start}..{self.local.stop - 1}), "
                f"top_k={s.top_k}, hidden={s.hidden_size}, inter={s.intermediate_size}, "
                f"backend={self.backend}, stored={'linears' if self.quantized else 'stacked'}")


def convert_all_experts(model: nn.Module, make: Callable[[], LinearMethod]) -> int:
    """`FusedMoE.convert_experts(make())` for every MoE layer of a loaded model whose
    experts are still float stacks; returns how many linears were converted."""
    count = 0
    for module in model.modules():
        if isinstance(module, FusedMoE) and not module.quantized:
            module.convert_experts(make())
            count += 2 * len(module.local)
    return count


class MoEDecoderForCausalLM(DecoderForCausalLM):
    """The shared decoder whose sparse layers (`ModelArchConfig.is_moe_layer`) hold a
    `FusedMoE` (the rest the dense gated MLP): routing renormalised under `norm_topk_prob`,
    this model's experts `expert_shard`. Checkpoints store the experts one by one, as hub
    checkpoints and transformers' `save_pretrained` do."""

    weights_in_act_dtype: ClassVar[bool] = False  # the family's routing-weight dtype rule

    def make_mlp(self, cfg: ModelArchConfig, layer: int, ops: Ops) -> nn.Module | None:
        if not cfg.is_moe_layer(layer):
            return None
        if cfg.hidden_act != "silu":
            raise ConfigError(f"mixture-of-experts layers run SwiGLU experts; "
                              f"hidden_act {cfg.hidden_act!r} is not supported")
        spec = MoESpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                       cfg.moe_intermediate_size, renormalize=cfg.norm_topk_prob,
                       weights_in_act_dtype=self.weights_in_act_dtype)
        held = None if cfg.expert_shard is None else range(*cfg.expert_shard)
        return FusedMoE(spec, ops, experts=held)

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether every MoE layer can be captured in a CUDA graph (`FusedMoE.capturable`)."""
        return all(m.capturable for m in self.modules() if isinstance(m, FusedMoE))
