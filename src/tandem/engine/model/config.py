"""Architecture description of a Llama-family decoder, independent of where weights come from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.engine.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArchConfig:
    """Hyper-parameters of a Llama / Mistral / Qwen2 decoder.

    Weights that accompany this config use Hugging Face parameter names
    (`model.layers.{i}.self_attn.q_proj.weight`, ...), in the HF (non-permuted) Q/K layout.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
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
    sliding_window: int | None = None  # Mistral; None = full attention
    rope_scaling: dict[str, float | str] | None = field(default=None, hash=False)  # HF dict
    # GGUF `rope_freqs.weight` (how llama.cpp stores Llama 3.1+ rope scaling): head_dim // 2
    # divisors of the rotary frequencies, theta_i / factor_i; None = all 1
    rope_freq_factors: tuple[float, ...] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.head_dim // 2
                                    or not all(0 < f < math.inf for f in factors)):
            raise ConfigError(f"rope_freq_factors must be {self.head_dim // 2} positive "
                              f"finite numbers (head_dim / 2), got {len(factors)}")
