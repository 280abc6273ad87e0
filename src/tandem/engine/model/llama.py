"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened batch with paged attention.

Single-device and plain: QKV and gate/up projections are fused into one matmul each; the
attention itself is delegated to an `AttentionBackend`. Activations are `[T, hidden]` for
`T` new tokens of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.ops import Ops, rms_norm


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in float32, scale in the model dtype. The decoder calls
    the fused `Ops.add_rms_norm` with this weight; `forward` is the plain reference."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _inv_freq(cfg: ModelArchConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_freq_factors is not None:  # llama.cpp: theta_i / factor_i
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(
            rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    if kind in (None, "default"):
        return inv
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables `cos`, `sin`: `[max_pos, D]` float32, both halves equal."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        inv = _inv_freq(cfg)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, ops: Ops) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend
        self.ops = ops

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # rotate q and k heads together, in place: [T, H + KVH, D]
        qk = self.ops.rope_(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim),
                            *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops: Ops) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block with the residual stream kept apart (vLLM style) so that each
    "residual add + RMSNorm" pair is one fused op."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, ops: Ops) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: previous block's output (None for the first), residual: the stream before it.
        Returns (this block's MLP output, the stream before it); their sum is the HF hidden
        state after this layer."""
        h, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        attn = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.ops.add_rms_norm(attn, residual,
                                            self.post_attention_layernorm.weight, self.eps)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], kv_caches, meta, logits_indices [N]) -> [N, V]`."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend,
                 max_positions: int | None = None, ops: Ops | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops or Ops()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, self.ops)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
                logits_indices: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """`on_layer(i)` runs after layer i (its K/V written; queued, on a GPU)."""
        residual = self.embed_tokens(input_ids)
        x = None
        rope = (positions, self.rope.cos, self.rope.sin)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rope, cache, meta)
            if on_layer is not None:
                on_layer(i)
        h, _ = self.ops.add_rms_norm(x[logits_indices], residual[logits_indices],
                                     self.norm.weight, self.config.rms_norm_eps)
        return self.lm_head(h)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up; every parameter must be set."""
        cfg = self.config
        remaining = dict(weights)

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ConfigError(f"checkpoint is missing weight {name!r}")
            return remaining.pop(name)

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if cfg.tie_word_embeddings:
            remaining.pop("lm_head.weight", None)
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if cfg.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat(
                    [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            layer.mlp.gate_up_proj.weight.copy_(torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        leftovers = [n for n in remaining if "rotary_emb" not in n]
        if leftovers:
            raise ConfigError(f"unexpected weights in checkpoint: {leftovers[:5]}")
