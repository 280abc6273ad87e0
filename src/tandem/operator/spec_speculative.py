"""A pool's `engine.speculative`: vLLM's `speculative_config` keys, as `tandem worker
--speculative-config` takes them (`SpeculativeSpec`, `parse_speculative`).

The checks are those of `tandem.engine.spec_decode.config.SpeculativeConfig`, repeated here
because the operator imports no engine code (tests/operator/test_spec_speculative.py checks
that both accept and refuse the same settings). Only `model` differs: the engine takes a
path, the spec a location like `model.uri`, which the operator mounts and rewrites:

    self                   method draft: the target model itself (quantized by
                           draft_quantization and/or truncated to draft_num_layers)
    file:///ABS/PATH       a path inside the worker image
    pvc://CLAIM[/PATH]     PATH inside a PersistentVolumeClaim, mounted read-only

`hf://` drafts are not fetched (put the draft on a PVC); for method eagle, `model` is the
head's .safetensors file (unset: a randomly initialised head, for tests and demos).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from tandem.operator.fields import get, get_enum, get_int
from tandem.operator.model_uri import ModelSource, SpecError, parse_model_uri

METHODS = ("ngram", "draft", "eagle")  # the engine's built-in proposers
MAX_SPECULATIVE_TOKENS = 16  # SpeculativeConfig's bound on k
SELF = "self"


@dataclass(frozen=True)
class SpeculativeSpec:
    """SpeculativeConfig's fields and defaults; `model` as written in the spec."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # "self" or a file:// / pvc:// location
    draft_quantization: str | None = None
    draft_num_layers: int | None = None
    adaptive: bool = True
    draft_tensor_parallel_size: int | None = None  # 1 (or unset): the proposer on rank 0

    @property
    def source(self) -> ModelSource | None:
        """Where the draft (or head) file is; None without one or for "self"."""
        if self.model is None or self.model == SELF:
            return None
        return parse_model_uri(self.model)

    def worker_json(self, model_path: str | None) -> str:
        """`--speculative-config`: compact JSON, unset keys left out, `model` the path the
        worker reads (`model_path`; "self" stays "self")."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.model is not None:
            out["model"] = model_path
        return json.dumps(out, separators=(",", ":"))


def _model(d: dict[str, Any], method: str, w: str) -> str | None:
    model = get(d, "model", str, None, w)
    if model is None:
        if method == "draft":
            raise SpecError(f"{w}.model is required for method draft ('self', "
                            "file:///PATH or pvc://CLAIM/PATH)")
        return None
    if method == "draft" and model == SELF:
        return model
    kind = None
    if model != SELF:
        try:
            kind = parse_model_uri(model).kind
        except SpecError as exc:
            raise SpecError(str(exc).replace("model.uri", f"{w}.model", 1)) from None
    if kind not in ("file", "pvc"):
        raise SpecError(f"{w}.model {model!r}: " + ("'self', " if method == "draft" else "")
                        + "file:///PATH or pvc://CLAIM/PATH (hf:// drafts are not fetched: "
                        "put the draft on a PersistentVolumeClaim)")
    return model


def parse_speculative(d: dict[str, Any] | None, where: str) -> SpeculativeSpec | None:
    """`where.speculative` (`where`: the pool's engine); None when unset."""
    if d is None:
        return None
    from tandem.operator.spec_engine import QUANTIZATIONS

    w = f"{where}.speculative"
    if unknown := sorted(set(d) - {f.name for f in fields(SpeculativeSpec)}):
        raise SpecError(f"{w}: unknown keys {unknown} (vLLM's speculative_config keys)")
    if "method" not in d:
        raise SpecError(f"{w}.method is required ({', '.join(METHODS)})")
    method = get_enum(d, "method", "", w, METHODS)
    lo = get_int(d, "prompt_lookup_min", 2, w, 1, 64)
    hi = get_int(d, "prompt_lookup_max", 5, w, 1, 64)
    if hi < lo:
        raise SpecError(f"{w}.prompt_lookup_max {hi} is below prompt_lookup_min {lo}")
    quant = d.get("draft_quantization")
    if quant is not None:
        quant = get_enum(d, "draft_quantization", "", w, QUANTIZATIONS)
    layers = get_int(d, "draft_num_layers", None, w, 1, 1024)
    if method != "draft" and (quant, layers) != (None, None):
        raise SpecError(f"{w}.draft_quantization and draft_num_layers apply to method draft "
                        "only")
    dtp = get(d, "draft_tensor_parallel_size", int, None, w)
    if dtp not in (None, 1):
        raise SpecError(f"{w}.draft_tensor_parallel_size: {dtp} is not 1 (draft models run "
                        "unsharded on rank 0)")
    if method == "ngram" and d.get("model") is not None:
        raise SpecError(f"{w}.model applies to methods draft and eagle")
    return SpeculativeSpec(
        method=method,
        num_speculative_tokens=get_int(d, "num_speculative_tokens", 4, w, 1,
                                       MAX_SPECULATIVE_TOKENS),
        prompt_lookup_min=lo, prompt_lookup_max=hi, model=_model(d, method, w),
        draft_quantization=quant, draft_num_layers=layers,
        adaptive=get(d, "adaptive", bool, True, w), draft_tensor_parallel_size=dtp)
