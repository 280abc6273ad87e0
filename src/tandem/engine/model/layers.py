"""Shared building blocks of the decoder families: RMSNorm (incl. Gemma's `(1 + w)`),
attention over the paged KV cache (optional per-head q/k RMSNorm, partial rotary dims), the
gated MLP (activation from the config) and the pre-norm decoder layer (optional "sandwich"
norms).

Each block names its checkpoint tensors (`weight_targets(prefix)`: HF name -> the parameter,
the slice of a fused one, or the rows of a `QuantLinear` it fills), so a family module only
composes blocks. q/k/v and gate/up are one fused linear each (`qkv_proj`, `gate_up_proj`):
tensor parallelism, quantization and LoRA address these module names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend, AttentionSpec
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.ops import Ops, rms_norm
from tandem.engine.quant.base import QuantLinear

# (positions [T], cos [max_pos, R], sin [max_pos, R]) of the layer's RoPE
Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RowTarget:
    """Where a checkpoint tensor goes in a `QuantLinear`: its rows [start, start + rows)."""

    layer: QuantLinear
    start: int
    rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.layer.in_features)


def rows(linear: nn.Module, kind: str, start: int, size: int) -> torch.Tensor | RowTarget:
    """Rows [start, start + size) of a linear's weight or bias, as a load target."""
    if isinstance(linear, QuantLinear) and kind == "weight":
        return RowTarget(linear, start, size)
    return getattr(linear, kind)[start:start + size]


def scale_embedding(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """Embeddings times `multiplier`, rounded to their dtype first (as HF: Gemma's
    sqrt(hidden)); the decoder and a proposer's copy of the target's embedding both use it."""
    return x * torch.tensor(multiplier, dtype=x.dtype)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(logits / cap)`: a final logit soft cap."""
    return torch.tanh(logits / cap) * cap


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in float32, scale in the model dtype (Llama); with
    `unit_offset`, Gemma's: scale by (1 + w) in float32, then cast. The decoder calls the
    fused `Ops.add_rms_norm` with a plain norm's weight; `forward` is the reference."""

    def __init__(self, hidden: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.unit_offset:
            return rms_norm(x, self.weight, self.eps)
        r = x.float()
        r = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps)
        return (r * (1.0 + self.weight.float())).to(x.dtype)


def layer_attention_spec(cfg: ModelArchConfig, layer: int) -> AttentionSpec:
    """Layer `layer`'s attention: heads, head size, softmax scale, sliding window, score
    soft cap (a backend serves layers that differ in the last three through `for_layer`)."""
    return AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.softmax_scale,
                         cfg.layer_window(layer), cfg.attn_logit_softcap)


class Attention(nn.Module):
    """Self-attention of layer `layer`: fused q/k/v projection, optional per-head q/k norm,
    RoPE on the first `rotary_dim` dims of each head, the backend's paged attention
    (`window`: this layer's sliding window, None = full), output projection."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, ops: Ops,
                 layer: int = 0) -> None:
        super().__init__()
        self.layer, self.window = layer, cfg.layer_window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.rotary_dim = cfg.rotary_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.hidden_size, self.bias = cfg.hidden_size, cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
        # this layer's view of the shared backend (its window, scale and soft cap)
        self.backend = (backend.for_layer(layer_attention_spec(cfg, layer))
                        if backend is not None else None)
        self.ops = ops

    def _rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """RoPE in place on x [T, heads, D] (partial: its first rotary_dim dims)."""
        if self.rotary_dim == self.head_dim:
            return self.ops.rope_(x, *rope)
        self.ops.rope_(x[..., : self.rotary_dim], *rope)
        return x

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: Any) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        if self.q_norm is not None:  # per-head norms (new tensors), then RoPE on each
            q = self._rope(self.q_norm(qk[:, : self.num_heads]), rope)
            k = self._rope(self.k_norm(qk[:, self.num_heads:]), rope)
        else:  # rotate q and k heads together, in place: [T, H + KVH, D]
            q, k = self._rope(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(t, self.q_size))

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | RowTarget]:
        """`prefix`: "model.layers.{i}.self_attn."."""
        q, kv = self.q_size, self.kv_size
        out: dict[str, torch.Tensor | RowTarget] = {}
        for kind in ("weight", "bias") if self.bias else ("weight",):
            for n, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                out[f"{prefix}{n}_proj.{kind}"] = rows(self.qkv_proj, kind, start, size)
        out[prefix + "o_proj.weight"] = rows(self.o_proj, "weight", 0, self.hidden_size)
        if self.q_norm is not None:
            out[prefix + "q_norm.weight"] = self.q_norm.weight
            out[prefix + "k_norm.weight"] = self.k_norm.weight
        return out


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up fused into `gate_up_proj`."""

    def __init__(self, cfg: ModelArchConfig, ops: Ops, intermediate: int | None = None) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.inter = cfg.intermediate_size if intermediate is None else intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | RowTarget]:
        """`prefix`: "model.layers.{i}.mlp."."""
        i = self.inter
        return {prefix + "gate_proj.weight": rows(self.gate_up_proj, "weight", 0, i),
                prefix + "up_proj.weight": rows(self.gate_up_proj, "weight", i, i),
                prefix + "down_proj.weight": rows(self.down_proj, "weight", 0, self.hidden_size)}


class DecoderLayer(nn.Module):
    """Pre-norm block with the residual stream kept apart (vLLM style) so that each
    "residual add + RMSNorm" pair is one fused op (plain norms without sandwich norms).

    With `sandwich_norms` (Gemma): h = x + post_attention_layernorm(attn(input_layernorm(x)))
    then h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))). `mlp` is any
    module with `forward(h)` and `weight_targets(prefix)` (a mixture of experts), default
    `MLP`."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, ops: Ops,
                 layer: int = 0, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.sandwich = cfg.sandwich_norms
        self.fused = not (cfg.norm_unit_offset or cfg.sandwich_norms)
        h, eps, unit = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(h, eps, unit)
        self.self_attn = Attention(cfg, backend, ops, layer)
        self.post_attention_layernorm = RMSNorm(h, eps, unit)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, unit)
            self.post_feedforward_layernorm = RMSNorm(h, eps, unit)
        self.mlp = MLP(cfg, ops) if mlp is None else mlp
        self.ops = ops

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: previous block's output (None for the first), residual: the stream before it.
        Returns (this block's MLP output, the stream before it); their sum is the HF hidden
        state after this layer."""
        if self.fused:
            h, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight,
                                                self.eps)
            attn = self.self_attn(h, rope, kv_cache, meta)
            h, residual = self.ops.add_rms_norm(attn, residual,
                                                self.post_attention_layernorm.weight, self.eps)
            return self.mlp(h), residual
        if x is not None:
            residual = residual + x
        attn = self.self_attn(self.input_layernorm(residual), rope, kv_cache, meta)
        if not self.sandwich:
            residual = residual + attn
            return self.mlp(self.post_attention_layernorm(residual)), residual
        residual = residual + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(out), residual

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | RowTarget]:
        """`prefix`: "model.layers.{i}."."""
        out = {prefix + "input_layernorm.weight": self.input_layernorm.weight,
               prefix + "post_attention_layernorm.weight": self.post_attention_layernorm.weight}
        if self.sandwich:
            out[prefix + "pre_feedforward_layernorm.weight"] = (
                self.pre_feedforward_layernorm.weight)
            out[prefix + "post_feedforward_layernorm.weight"] = (
                self.post_feedforward_layernorm.weight)
        out.update(self.self_attn.weight_targets(prefix + "self_attn."))
        out.update(self.mlp.weight_targets(prefix + "mlp."))
        return out
