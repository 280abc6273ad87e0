"""Architecture description of a decoder-only transformer, independent of where weights
come from (which family module builds it: `model/registry.py`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.errors import ConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelArchConfig:
    """Hyper-parameters of one decoder of a registered family (`architecture`: its
    registry name, e.g. "llama", "qwen3", "phi3").

    Weights that accompany this config use Hugging Face parameter names
    (`model.layers.{i}.self_attn.q_proj.weight`, ...), in the HF (non-permuted) Q/K layout,
    after the family's checkpoint-name normaliser (fused checkpoint tensors split).
    """

    architecture: str  # a registered family (registry.supported_architectures())
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    # the window of sliding layers; with `layer_types` None every layer slides (Mistral)
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF dict
    # GGUF `rope_freqs.weight` (how llama.cpp stores Llama 3.1+ rope scaling): head_dim // 2
    # divisors of the rotary frequencies, theta_i / factor_i; None = all 1
    rope_freq_factors: tuple[float, ...] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # --- family features (defaults: Llama) ---
    # per layer "full_attention" / "sliding_attention"; None: all alike (see sliding_window)
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w) in float32 (Gemma)
    sandwich_norms: bool = False  # post-attention and pre/post-feedforward norms (Gemma)
    embedding_multiplier: float = 1.0  # embeddings times this, in the model dtype (Gemma)
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims
    # sliding layers' RoPE (Gemma 3's local layers): None = the global one
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # cap * tanh(x / cap) on the attention scores / the logits (Gemma 2 style); None: none
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # --- mixture of experts (num_experts 0: dense) ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # the layers whose MLP is sparse; None = every layer when num_experts > 0
    moe_layers: tuple[int, ...] | None = None
    # the experts this model holds, [start, stop): a tensor-parallel rank's whole experts
    # (`parallel.tp.local_arch`); None = all
    expert_shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        from tandem.engine.model.registry import supported_architectures

        supported = supported_architectures()
        if self.architecture not in supported:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(supported)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.rotary_dim // 2
                                    or not all(0 < f < math.inf for f in factors)):
            raise ConfigError(f"rope_freq_factors must be {self.rotary_dim // 2} positive "
                              f"finite numbers (rotary dims / 2), got {len(factors)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}; "
                              f"supported: {', '.join(ACTIVATIONS)}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} must give "
                              f"an even number of rotary dims of {self.head_dim}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"{self.num_layers} layers")
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ConfigError(f"unsupported layer_types {sorted(bad)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ConfigError("sliding_attention layers need a sliding_window")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in [1, {self.num_experts}], got "
                              f"{self.num_experts_per_tok}")

    def with_layers(self, n: int) -> ModelArchConfig:
        """This config cut to its first `n` layers (a draft from the target's layers)."""
        return dataclasses.replace(
            self, num_layers=n,
            layer_types=None if self.layer_types is None else self.layer_types[:n],
            moe_layers=None if self.moe_layers is None else tuple(
                i for i in self.moe_layers if i < n))

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (HF: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: full attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's window, in order."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the local (sliding-layer) RoPE."""
        return (self.local_rope_theta is not None and self.layer_types is not None
                and self.layer_types[layer] == SLIDING_ATTENTION)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        if not self.num_experts:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale


def __getattr__(name: str) -> Any:
    """`SUPPORTED_ARCHITECTURES`: the registered families (read from the registry)."""
    if name == "SUPPORTED_ARCHITECTURES":
        from tandem.engine.model.registry import supported_architectures

        return supported_architectures()
    raise AttributeError(name)
