"""`DecoderForCausalLM`: the decoder-only model every family subclasses, over a flattened
batch with paged attention.

Single-device and plain: activations are `[T, hidden]` for `T` new tokens of the step; the
attention itself is delegated to an `AttentionBackend`. A family changes the blocks through
its config (`ModelArchConfig`: q/k norms, activation, norms, windows, rotary variants) and,
where the MLP differs (mixtures of experts), by overriding `make_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tandem.engine.attention.base import AttentionBackend, GroupedMetadata
from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.layers import DecoderLayer, RMSNorm, RowTarget, rows, scale_embedding
from tandem.engine.model.ops import Ops
from tandem.engine.model.rope import RotaryEmbedding
from tandem.engine.quant.apply import QuantEmbedding
from tandem.engine.quant.base import GroupedWeight, QuantLinear


class DecoderForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], kv_caches, meta, logits_indices [N]) -> [N, V]`
    (with `return_hidden=True`: `(logits [N, V], hidden [N, H])`)."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend,
                 max_positions: int | None = None, ops: Ops | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops or Ops()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, self.ops, i, self.make_mlp(cfg, i, self.ops))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        positions = max_positions or cfg.max_position_embeddings
        self.rope = RotaryEmbedding(cfg, positions)
        self.rope_local = (RotaryEmbedding(cfg, positions, local=True)
                           if cfg.local_rope_theta is not None else None)
        self._local = [cfg.uses_local_rope(i) for i in range(cfg.num_layers)]

    def make_mlp(self, cfg: ModelArchConfig, layer: int, ops: Ops) -> nn.Module | None:
        """Layer `layer`'s MLP (None: the dense gated `MLP`); MoE families override."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
                logits_indices: torch.Tensor,
                on_layer: Callable[[int], None] | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`on_layer(i)` runs after layer i (its K/V written; queued, on a GPU).

        `return_hidden`: also return the last layer's hidden states of the `logits_indices`
        rows after the final norm, i.e. exactly what the LM head reads (the features EAGLE
        heads take and predict), in the model dtype."""
        cfg = self.config
        residual = self.embed_tokens(input_ids)
        if cfg.embedding_multiplier != 1.0:  # in the model dtype, as HF
            residual = scale_embedding(residual, cfg.embedding_multiplier)
        x = None
        rope = (positions, self.rope.cos, self.rope.sin)
        local = (positions, self.rope_local.cos, self.rope_local.sin) if (
            self.rope_local is not None) else rope
        grouped = isinstance(meta, GroupedMetadata)  # hybrid: each layer its group's
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, local if self._local[i] else rope, cache,
                                meta.of_layer(i) if grouped else meta)
            if on_layer is not None:
                on_layer(i)
        if not cfg.norm_unit_offset:
            h, _ = self.ops.add_rms_norm(x[logits_indices], residual[logits_indices],
                                         self.norm.weight, cfg.rms_norm_eps)
        else:
            h = self.norm(x[logits_indices] + residual[logits_indices])
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
        self.compute_rope(device)

    def compute_rope(self, device: torch.device) -> None:
        """(Re)build the RoPE tables on `device` in float32."""
        self.rope.compute(device)
        if self.rope_local is not None:
            self.rope_local.compute(device)

    def _weight_targets(self) -> dict[str, torch.Tensor | RowTarget]:
        """HF weight name -> the parameter (or the slice of a fused one, or the rows of a
        `QuantLinear`) it fills."""
        cfg = self.config
        emb = self.embed_tokens
        out: dict[str, torch.Tensor | RowTarget] = {
            "model.embed_tokens.weight": (
                RowTarget(emb.storage, 0, emb.storage.out_features)
                if isinstance(emb, QuantEmbedding) else emb.weight),
            "model.norm.weight": self.norm.weight}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = rows(self.lm_head, "weight", 0, cfg.vocab_size)
        for i, layer in enumerate(self.layers):
            out.update(layer.weight_targets(f"model.layers.{i}."))
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
                dst.copy_(tensor if isinstance(tensor, torch.Tensor)  # (or a checkpoint's
                          else tensor.dequantize(dst.dtype))  # codes: GroupedWeight, Fp8Weight)
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


def weight_shapes(model_class: type[DecoderForCausalLM], cfg: ModelArchConfig
                  ) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a float `model_class` of `cfg` reads, by HF name, with its
    shape (the model built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        model = model_class(cfg, None, max_positions=1,  # type: ignore[arg-type]
                            ops=Ops(native=False))
    return {name: tuple(t.shape) for name, t in model._weight_targets().items()}
