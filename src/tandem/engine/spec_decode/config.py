"""`speculative_config`: vLLM's keys, validated once (engine args, CLI JSON, InferenceService).

Torch-free. Unknown keys and out-of-range values are a `ConfigError` naming the key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from tandem.engine.errors import ConfigError

MAX_SPECULATIVE_TOKENS = 16  # bound on k: every proposed token is a logits row per request


@dataclass(frozen=True)
class SpeculativeConfig:
    """One proposer for the engine; requests opt out with `SamplingParams(speculative=False)`.

    - `method`: a registered proposer ("ngram", "draft", "eagle").
    - `num_speculative_tokens`: the most tokens proposed per request and step (k).
    - `prompt_lookup_min` / `prompt_lookup_max`: n-gram sizes tried, longest first ("ngram").
    - `model`: the draft model ("draft": a .gguf file or HF directory, a Hugging Face
      repository id resolved through the hub cache as the target's is, or "self" for the
      target model itself, quantized by `draft_quantization` and/or truncated to its first
      `draft_num_layers` layers); "eagle": an optional safetensors file of the head's
      weights (`eagle.py`), null = a small randomly initialised head (tests, demos).
    - `revision`: the draft repository's branch, tag or commit (vLLM's key; null: main).
    - `adaptive`: the number of proposed tokens follows the measured acceptance rate and
      the batch size (`policy.py`); False = always k (where a proposal exists).
    - `draft_tensor_parallel_size`: the proposer's tensor-parallel size, null or 1 (the
      same): whatever the engine's `tensor_parallel_size`, a draft model or EAGLE head runs
      unsharded on rank 0 (its own weights and KV cache on rank 0's device) while the
      target runs sharded on every rank, as vLLM's `draft_tensor_parallel_size=1`.
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    draft_quantization: str | None = None
    draft_num_layers: int | None = None
    adaptive: bool = True
    draft_tensor_parallel_size: int | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        from tandem.engine.config import QUANTIZATIONS
        from tandem.engine.spec_decode import BUILTIN, PROPOSERS

        def int_in(name: str, lo: int, hi: int) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"speculative_config.{name} must be an integer in "
                                  f"[{lo}, {hi}], got {v!r}")
            return v

        methods = sorted(set(BUILTIN) | set(PROPOSERS))
        if self.method not in methods:
            raise ConfigError(f"speculative_config.method must be one of {methods}, "
                              f"got {self.method!r}")
        int_in("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        lo = int_in("prompt_lookup_min", 1, 64)
        int_in("prompt_lookup_max", lo, 64)
        if not isinstance(self.adaptive, bool):
            raise ConfigError("speculative_config.adaptive must be true or false")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (isinstance(dtp, bool) or not isinstance(dtp, int) or dtp != 1):
            raise ConfigError(f"speculative_config.draft_tensor_parallel_size must be 1 or "
                              f"null, got {dtp!r}: draft models run unsharded on rank 0")
        if self.revision is not None and (not isinstance(self.revision, str)
                                          or not self.revision):
            raise ConfigError(f"speculative_config.revision must be a non-empty string or "
                              f"null, got {self.revision!r}")
        if self.revision is not None and self.method != "draft":
            raise ConfigError("speculative_config.revision applies to method 'draft' (a "
                              "draft model's repository) only")
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError("speculative_config.model is required for method 'draft' "
                                  "(a model path, or 'self')")
            if self.draft_num_layers is not None:
                int_in("draft_num_layers", 1, 1024)
            q = self.draft_quantization
            if q is not None and q not in QUANTIZATIONS:
                raise ConfigError(f"speculative_config.draft_quantization must be one of "
                                  f"{QUANTIZATIONS} or null, got {q!r}")
        elif self.method == "eagle" and (self.draft_quantization, self.draft_num_layers) == (
                None, None):
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                raise ConfigError("speculative_config.model for method 'eagle' is a path to "
                                  "the head's .safetensors weights, or null")
        elif (self.model, self.draft_quantization, self.draft_num_layers) != (None, None, None):
            raise ConfigError("speculative_config.model applies to methods 'draft' and "
                              "'eagle', draft_quantization and draft_num_layers to 'draft' "
                              "only")

    @classmethod
    def from_dict(cls, raw: Any) -> SpeculativeConfig:
        """From vLLM-style keys (a JSON object); raises ConfigError."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ConfigError("speculative_config must be an object")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise ConfigError(f"speculative_config: unknown keys {unknown}")
        if "method" not in raw:
            raise ConfigError("speculative_config.method is required")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
