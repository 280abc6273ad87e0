"""Rotary position embeddings: the inverse frequencies of every `rope_type` configs use
(default, `linear`, `dynamic`, `llama3`, `yarn`, `longrope`), partial rotary dims, and the
position-indexed cos/sin tables the decoder reads.

`inv_freq` matches transformers' `ROPE_INIT_FUNCTIONS` (the frequencies and the attention
factor that scales cos and sin). Tables are indexed by position, so the two RoPE kinds that
transformers switches at run time are fixed per position instead: `dynamic` (NTK) equals the
default frequencies inside `max_position_embeddings` (transformers rescales only past it,
and no table here reaches past it), and `longrope` uses its short factors for positions
below `original_max_position_embeddings` and its long factors from there on (transformers
picks one set for a whole sequence: the same while a sequence stays inside the original
context).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The `rope_type` of an HF rope_scaling dict (legacy `type`; None: "default")."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type")) or "default")


def _base(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, rs: dict[str, Any], max_pos: int
          ) -> tuple[torch.Tensor, float]:
    original = float(rs["original_max_position_embeddings"])
    factor = rs.get("factor")
    factor = max_pos / original if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


def _llama3(inv: torch.Tensor, rs: dict[str, Any]) -> torch.Tensor:
    factor, low, high = (float(rs["factor"]), float(rs["low_freq_factor"]),
                         float(rs["high_freq_factor"]))
    old_ctx = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_attention_factor(rs: dict[str, Any], max_pos: int) -> float:
    original = float(rs["original_max_position_embeddings"])
    factor = rs.get("factor")
    factor = max_pos / original if factor is None else float(factor)
    attn = rs.get("attention_factor")
    if attn is not None:
        return float(attn)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int,
             long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, attention factor) of RoPE over `dim` rotary
    dims, as transformers' `ROPE_INIT_FUNCTIONS[rope_type]` computes them for a sequence
    inside `max_pos` (`long`: longrope's long factors). ConfigError for an unknown type."""
    kind = rope_type(scaling)
    rs = scaling or {}
    inv = _base(dim, theta)
    try:
        if kind in ("default", "dynamic"):
            return inv, 1.0
        if kind == "linear":
            return inv / float(rs["factor"]), 1.0
        if kind == "llama3":
            return _llama3(inv, rs), 1.0
        if kind == "yarn":
            return _yarn(dim, theta, rs, max_pos)
        if kind == "longrope":
            ext = torch.tensor(rs["long_factor" if long else "short_factor"],
                               dtype=torch.float32)
            if ext.shape != (dim // 2,):
                raise ConfigError(f"longrope factors must be {dim // 2} numbers (rotary "
                                  f"dims / 2), got {tuple(ext.shape)}")
            base_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return 1.0 / (ext * theta ** base_shape), _longrope_attention_factor(rs, max_pos)
    except KeyError as e:
        raise ConfigError(f"rope_scaling {kind!r} needs {e.args[0]!r}") from None
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: "
                      f"{', '.join(ROPE_TYPES)})")


def check_rope(cfg: ModelArchConfig) -> None:
    """ConfigError now (at config parse time) for a rope setting the tables cannot build."""
    inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    if cfg.local_rope_theta is not None:
        inv_freq(cfg.rotary_dim, cfg.local_rope_theta, cfg.local_rope_scaling,
                 cfg.max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables `cos`, `sin`: `[max_pos, rotary_dim]` float32, both halves
    equal (`local`: the sliding layers' RoPE of `local_rope_theta`).

    Built on the meta device they stay empty until `compute`, which the engine calls after
    the model's cast, so a bfloat16 model still gets float32 tables.
    """

    def __init__(self, cfg: ModelArchConfig, max_positions: int, local: bool = False) -> None:
        super().__init__()
        self.cfg, self.max_positions, self.local = cfg, max_positions, local
        shape = (max_positions, cfg.rotary_dim)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        if self.cos.device.type != "meta":
            self.compute(self.cos.device)

    def _frequencies(self) -> list[tuple[int, torch.Tensor, float]]:
        """[(first position, inverse frequencies, attention factor)], by position."""
        cfg = self.cfg
        theta, scaling = ((cfg.local_rope_theta, cfg.local_rope_scaling) if self.local
                          else (cfg.rope_theta, cfg.rope_scaling))
        dim, max_pos = cfg.rotary_dim, cfg.max_position_embeddings
        inv, attn = inv_freq(dim, theta, scaling, max_pos)
        if cfg.rope_freq_factors is not None and not self.local:  # llama.cpp: theta_i / f_i
            inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
        parts = [(0, inv, attn)]
        if rope_type(scaling) == "longrope":
            long, attn_long = inv_freq(dim, theta, scaling, max_pos, long=True)
            parts.append((int(scaling["original_max_position_embeddings"]), long, attn_long))
        return parts

    def compute(self, device: torch.device) -> None:
        """(Re)build the tables on `device` in float32, as HF and vLLM do: the inverse
        frequencies on the host (D/2 values), the position * frequency products and their
        cos/sin on the device (times the attention factor where the type has one)."""
        parts = self._frequencies()
        cos, sin = [], []
        for j, (start, inv, attn) in enumerate(parts):
            end = parts[j + 1][0] if j + 1 < len(parts) else self.max_positions
            end = min(end, self.max_positions)
            if start >= end:
                continue
            positions = torch.arange(start, end, dtype=torch.float32, device=device)
            freqs = positions[:, None] * inv.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            c, s = emb.cos(), emb.sin()
            if attn != 1.0:
                c, s = c * attn, s * attn
            cos.append(c)
            sin.append(s)
        self.cos, self.sin = (cos[0], sin[0]) if len(cos) == 1 else (torch.cat(cos),
                                                                      torch.cat(sin))
