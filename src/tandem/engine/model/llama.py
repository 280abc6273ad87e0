"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened batch with paged attention.

Single-device and plain: QKV and gate/up projections are fused into one matmul each; the
attention itself is delegated to an `AttentionBackend`. Activations are `[T, hidden]` for
`T` new tokens of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.ops import Ops, rms_norm
from tandem.engine.quant.apply import QuantEmbedding
from tandem.engine.quant.base import GroupedWeight, QuantLinear


@dataclass(frozen=True)
class RowTarget:
    """Where a checkpoint tensor goes in a `QuantLinear`: its rows [start, start + rows)."""

    layer: QuantLinear
    start: int
    rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.layer.in_features)


def _rows(linear: nn.Module, kind: str, start: int, size: int) -> torch.Tensor | RowTarget:
    """Rows [start, start + size) of a linear's weight or bias, as a load target."""
    if isinstance(linear, QuantLinear) and kind == "weight":
        return RowTarget(linear, start, size)
    return getattr(linear, kind)[start:start + size]


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
    """Rotate-half RoPE tables `cos`, `sin`: `[max_pos, D]` float32, both halves equal.

    Built on the meta device they stay empty until `compute`, which the engine calls after
    the model's cast, so a bfloat16 model still gets float32 tables.
    """

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        shape = (max_positions, cfg.head_dim)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        if self.cos.device.type != "meta":
            self.compute(self.cos.device)

    def compute(self, device: torch.device) -> None:
        """(Re)build the tables on `device` in float32, as HF and vLLM do: the inverse
        frequencies on the host (D/2 values), the position * frequency products and their
        cos/sin on the device."""
        inv = _inv_freq(self.cfg).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()


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
    """`forward(input_ids [T], positions [T], kv_caches, meta, logits_indices [N]) -> [N, V]`
    (with `return_hidden=True`: `(logits [N, V], hidden [N, H])`)."""

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
                on_layer: Callable[[int], None] | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`on_layer(i)` runs after layer i (its K/V written; queued, on a GPU).

        `return_hidden`: also return the last layer's hidden states of the `logits_indices`
        rows after the final norm, i.e. exactly what the LM head reads (the features EAGLE
        heads take and predict), in the model dtype."""
        residual = self.embed_tokens(input_ids)
        x = None
        rope = (positions, self.rope.cos, self.rope.sin)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rope, cache, meta)
            if on_layer is not None:
                on_layer(i)
        h, _ = self.ops.add_rms_norm(x[logits_indices], residual[logits_indices],
                                     self.norm.weight, self.config.rms_norm_eps)
        logits = self.lm_head(h)
        return (logits, h) if return_hidden else logits

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """A model built under `torch.device("meta")` (and possibly `quant.prepare_model`d)
        -> uninitialised parameters on `device` in `dtype` (fill them with `load_weights`),
        float embeddings tied when the config says so, RoPE tables computed on `device` in
        float32. Quantized layers keep their buffers' own dtypes. No host copy is made."""
        tied = self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear)
        if tied:  # never allocate an lm_head that the tie replaces
            self.lm_head.weight = None
        for module in self.modules():  # free on meta
            if not isinstance(module, QuantLinear):
                module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t,
                              recurse=False)
        self.to_empty(device=device)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope.compute(device)

    def _weight_targets(self) -> dict[str, torch.Tensor | RowTarget]:
        """HF weight name -> the parameter (or the slice of a fused one, or the rows of a
        `QuantLinear`) it fills."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, (
            cfg.intermediate_size)
        emb = self.embed_tokens
        out: dict[str, torch.Tensor | RowTarget] = {
            "model.embed_tokens.weight": (
                RowTarget(emb.storage, 0, emb.storage.out_features)
                if isinstance(emb, QuantEmbedding) else emb.weight),
            "model.norm.weight": self.norm.weight}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = _rows(self.lm_head, "weight", 0, cfg.vocab_size)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
            for kind in kinds:
                for n, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                    out[p + f"self_attn.{n}_proj.{kind}"] = _rows(attn.qkv_proj, kind, start,
                                                                  size)
            out.update({
                p + "self_attn.o_proj.weight": _rows(attn.o_proj, "weight", 0, cfg.hidden_size),
                p + "mlp.gate_proj.weight": _rows(mlp.gate_up_proj, "weight", 0, inter),
                p + "mlp.up_proj.weight": _rows(mlp.gate_up_proj, "weight", inter, inter),
                p + "mlp.down_proj.weight": _rows(mlp.down_proj, "weight", 0, cfg.hidden_size),
                p + "input_layernorm.weight": layer.input_layernorm.weight,
                p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            })
        return out

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor | GroupedWeight]
                     | Iterable[tuple[str, torch.Tensor | GroupedWeight]]) -> None:
        """Copy HF-named weights in as they come, each q/k/v and gate/up part straight into
        its slice of the fused parameter, or handed to its `QuantLinear`'s method as rows
        (no concatenation, one tensor held at a time). A `GroupedWeight` (a GGUF tensor
        kept compressed) bound for a float parameter is dequantized. Each `QuantLinear` is
        `finish`ed at the end.

        Every parameter must be set exactly once: ConfigError for a missing, repeated,
        unexpected or mis-shaped weight. A tied model ignores `lm_head.weight`.
        """
        targets = self._weight_targets()
        items = weights.items() if isinstance(weights, Mapping) else weights
        done: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in items:
            dst = targets.get(name)
            if dst is None:
                if "rotary_emb" not in name and not (
                        name == "lm_head.weight" and self.config.tie_word_embeddings):
                    unexpected.append(name)
                continue
            if name in done:
                raise ConfigError(f"checkpoint has weight {name!r} twice")
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ConfigError(f"weight {name!r} has shape {tuple(tensor.shape)}, the "
                                  f"model expects {tuple(dst.shape)}")
            if isinstance(dst, RowTarget):
                dst.layer.method.load(dst.layer, dst.start, tensor)
            else:
                dst.copy_(tensor.dequantize(dst.dtype) if isinstance(tensor, GroupedWeight)
                          else tensor)
            done.add(name)
            del tensor, dst  # nothing held while the loader reads the next tensor
        if unexpected:
            raise ConfigError(f"unexpected weights in checkpoint: {unexpected[:5]}")
        missing = [n for n in targets if n not in done]
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(f"checkpoint is missing weight {missing[0]!r}{more}")
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight  # (`materialize` tied them)
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.method.finish(module)
