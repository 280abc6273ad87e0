"""Applying linear methods to a Llama-family model (gpt-fast style: the model code stays
plain `nn.Linear` / `nn.Embedding`; this module swaps them).

Two ways in:
* `plan_quantization` + `prepare_model` on a model still on the meta device, before any
  weight exists (the engine's path): each quantized linear is a `QuantLinear` whose
  compressed buffers are allocated by `materialize` and filled row range by row range by
  `load_weights`, so the float model never exists in memory.
* `convert_linears` on a loaded model (the float "packed" CPU layout, tests): each
  `nn.Linear` is replaced by a `QuantLinear` of the method, one layer at a time.

A quantized token embedding is a `QuantEmbedding` over a `QuantLinear` storage; with tied
embeddings that storage *is* the LM head, so the vocabulary matrix exists once.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.quant.base import LinearMethod, QuantLinear, get_linear_method
from tandem.engine.quant.checkpoint import resolve_quantization

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceFormat:
    """How a checkpoint tensor is stored: `bits`-bit codes in groups of `group_size` with
    (`has_mins`) or without per-group mins (GGUF Q4_0 / Q4_1: 4, 32, True; Q8_0: 8, 32,
    False). Tensors absent from `ModelSource.formats` are float.

    A pre-quantized Hugging Face checkpoint's (`quant/checkpoint.py`) also names its
    `method` (gptq, awq, fp8, compressed-tensors); `kind` "fp8": e4m3 codes with a scale
    per row (an `Fp8Weight`; `group_size` 0), or per row and `group_size` input columns
    (block-wise); `act_order`: its codes come with an input permutation."""

    bits: int
    group_size: int
    has_mins: bool
    kind: str = "int"
    act_order: bool = False
    method: str | None = None


class QuantEmbedding(nn.Module):
    """Token embedding over the rows of a `QuantLinear` storage `[vocab, hidden]`:
    ids [T] -> [T, hidden] in the storage's dtype (only the looked-up rows dequantized)."""

    def __init__(self, storage: QuantLinear) -> None:
        super().__init__()
        self.storage = storage

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.storage.method.embed(self.storage, ids)


@dataclass
class QuantPlan:
    """Which method each module gets: keys are module paths of `LlamaForCausalLM`
    ("layers.3.self_attn.qkv_proj", "lm_head", "embed_tokens"); absent = stays float."""

    name: str | None
    methods: dict[str, LinearMethod] = field(default_factory=dict)


# Under "w8a8", the linears whose inputs keep their accuracy as per-token int8. Measured on
# the bundled model (tests/engine/test_quant_accuracy.py, corpus perplexity vs float32):
# every linear incl. the LM head +4.5 %; LM head weight-only +3.3 %; also down_proj (SwiGLU
# products, heavy outliers) +1.4 %; also qkv_proj (post-norm outlier channels) +0.36 %.
# Quantizing the rest needs outlier smoothing (SmoothQuant-style calibration).
W8A8_ACTIVATION_LAYERS = ("self_attn.o_proj", "mlp.gate_up_proj")

# the HF weight names whose rows make up each fused linear of layer i
_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _linear_paths(arch: ModelArchConfig) -> dict[str, list[str]]:
    """Module path -> HF weight names of its rows (embedding and head included)."""
    out = {f"layers.{i}.{mod}": [f"model.layers.{i}.{p}.weight" for p in parts]
           for i in range(arch.num_layers) for mod, parts in _PARTS.items()
           if not (mod.startswith("mlp.") and arch.is_moe_layer(i))}
    for i in range(arch.num_layers):  # a mixture of experts: all its experts, one method
        if arch.is_moe_layer(i):
            out[f"layers.{i}.mlp.experts"] = [
                f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for e in range(arch.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")]
    out["embed_tokens"] = ["model.embed_tokens.weight"]
    if not arch.tie_word_embeddings:
        out["lm_head"] = ["lm_head.weight"]
    return out


def _gguf_method(parts: list[SourceFormat | None], device: torch.device,
                 native: ctypes.CDLL | None) -> LinearMethod | None:
    """The storage that keeps every part's own codes: all 4-bit -> int4 g32; any 8-bit or
    float part -> int8 g32 (4-bit parts fit exactly as codes 0..15 with mins; float parts
    are quantized, symmetric int8 per 32 columns); all float -> None (stays float)."""
    if all(p is None for p in parts):
        return None
    groups = {p.group_size for p in parts if p is not None}
    if len(groups) != 1:
        raise ConfigError(f"GGUF tensors of one layer use different group sizes {groups}")
    group = groups.pop()
    if all(p is not None and p.bits == 4 for p in parts):
        return get_linear_method("int4", device=device, native=native, group_size=group)
    mins = any(p is not None and p.has_mins for p in parts)
    return get_linear_method("int8", device=device, native=native, group_size=group,
                             has_mins=mins)


def _checkpoint_plan(plan: QuantPlan, paths: Mapping[str, list[str]],
                     formats: Mapping[str, SourceFormat], device: torch.device,
                     native: ctypes.CDLL | None, source: str) -> QuantPlan:
    """A pre-quantized checkpoint's plan: each linear whose parts are stored quantized gets
    the method that holds their codes exactly (4-bit: int4 in the format's group size,
    8-bit: int8 with mins, fp8: fp8; act-order ones permute their input); the rest (the
    checkpoint's ignored modules) stay float."""
    made: dict[SourceFormat, LinearMethod] = {}
    for path, names in paths.items():
        parts = [formats.get(n) for n in names]
        if all(p is None for p in parts):
            continue
        if len(set(parts)) != 1:
            kinds = ", ".join(f"{n}: {'float' if p is None else p.kind}"
                              f"{'' if p is None else f' {p.bits}-bit g{p.group_size}'}"
                              for n, p in zip(names, parts, strict=True))
            raise ConfigError(f"{source or 'the model'}: the parts of the fused layer {path} "
                              f"are stored differently ({kinds}); they must share a format")
        fmt = parts[0]
        if fmt not in made:
            if fmt.kind == "fp8":  # group_size: a block-wise checkpoint's block columns
                made[fmt] = get_linear_method("fp8", device=device, native=native,
                                              block_k=fmt.group_size or None)
            elif fmt.bits == 4:
                made[fmt] = get_linear_method("int4", device=device, native=native,
                                              group_size=fmt.group_size,
                                              act_order=fmt.act_order)
            else:
                made[fmt] = get_linear_method("int8", device=device, native=native,
                                              group_size=fmt.group_size, has_mins=True,
                                              act_order=fmt.act_order)
        plan.methods[path] = made[fmt]
    return plan


def plan_quantization(name: str | None, arch: ModelArchConfig,
                      formats: Mapping[str, SourceFormat], device: torch.device,
                      native: ctypes.CDLL | None, group_size: int | None = None,
                      source: str = "") -> QuantPlan:
    """The plan for `EngineConfig.quantization` `name` (see config.py for the modes).

    A pre-quantized checkpoint (`formats` naming a method: quant/checkpoint.py) is served
    with its own method whether `name` is unset or names it (a vLLM alias too); another
    `name` is a ConfigError, as is a checkpoint-only method for a float checkpoint.

    int8 / int4 / w8a8 / fp8 quantize every linear; the embedding (and the tied or untied
    LM head) gets per-channel weight-only int8 under int8 / int4 / w8a8 (a 4-bit vocabulary
    matrix, or int8 activations into the LM head, cost more accuracy than the rest of the
    model together), and fp8 under fp8; under w8a8 only `W8A8_ACTIVATION_LAYERS` take int8
    activations, the rest keep the same int8 weights weight-only. "gguf" keeps each
    tensor's file format (`formats`; ConfigError for a checkpoint without quantized
    tensors)."""
    checkpoint = next((f.method for f in formats.values() if f.method is not None), None)
    name = resolve_quantization(name, checkpoint, source)
    plan = QuantPlan(name)
    if name is None:
        return plan
    paths = _linear_paths(arch)
    if checkpoint is not None:
        return _checkpoint_plan(plan, paths, formats, device, native, source)
    if name == "gguf":
        if not formats:
            raise ConfigError(f"quantization 'gguf' keeps a GGUF file's Q4_0 / Q4_1 / Q8_0 "
                              f"tensors, but {source or 'the model'} has none; use int8 or "
                              "int4 to quantize float weights")
        for path, names in paths.items():
            method = _gguf_method([formats.get(n) for n in names], device, native)
            if method is not None:
                plan.methods[path] = method
        return plan

    def make(kind: str, **options: object) -> LinearMethod:
        return get_linear_method(kind, device=device, native=native, **options)

    if name == "int8":
        body = make("int8", group_size=group_size)
        vocab = make("int8", group_size=None)
    elif name == "int4":
        body = make("int4", group_size=group_size or 32)
        vocab = make("int8", group_size=None)
    elif name == "w8a8":
        body, vocab = make("w8a8"), make("int8", group_size=None)
        for path in paths:  # int8 activations only where they keep the accuracy
            w8a8 = path.endswith(W8A8_ACTIVATION_LAYERS)
            plan.methods[path] = body if w8a8 else vocab
        return plan
    elif name == "fp8":
        body = vocab = make(name)
    else:
        raise ConfigError(f"unknown quantization {name!r}")
    for path in paths:
        plan.methods[path] = vocab if path in ("embed_tokens", "lm_head") else body
    return plan


def row_scaled_weights(plan: QuantPlan, arch: ModelArchConfig) -> frozenset[str]:
    """The HF weight names whose layer's method scales whole input rows (`row_scaled`:
    per-channel): a tensor-parallel rank hands it their columns as `ColumnSlice`s."""
    paths = _linear_paths(arch)
    return frozenset(name for path, method in plan.methods.items() if method.row_scaled
                     for name in paths.get(path, ()))


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)


def prepare_model(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> int:
    """Swap the planned modules of a meta-device model for `QuantLinear` /
    `QuantEmbedding` (activations in `dtype`); returns how many linears were swapped.
    Call before `materialize`."""
    tied = model.config.tie_word_embeddings
    count = 0
    for path, method in plan.methods.items():
        if path == "embed_tokens":
            emb = model.embed_tokens
            storage = QuantLinear(method, emb.embedding_dim, emb.num_embeddings, False, dtype)
            model.embed_tokens = QuantEmbedding(storage)
            if tied:
                model.lm_head = storage
            continue
        if path.endswith(".mlp.experts"):  # `model.moe.FusedMoE`: a QuantLinear pair each
            moe = model.get_submodule(path.removesuffix(".experts"))
            moe.quantize(method, dtype)
            count += 2 * len(moe.local)
            continue
        old = model.get_submodule(path)
        try:
            layer = QuantLinear(method, old.in_features, old.out_features,
                                old.bias is not None, dtype)
        except ConfigError as e:  # name the layer (a tensor-parallel rank's share, say)
            raise ConfigError(f"{path} [{old.out_features} x {old.in_features}]: {e}") from None
        _set(model, path, layer)
        count += 1
    if plan.name:
        logger.info("quantization %s: %d linear layers%s", plan.name, count,
                    " + embedding" if "embed_tokens" in plan.methods else "")
    return count


def convert_linear(linear: nn.Linear, method: LinearMethod) -> QuantLinear:
    """A loaded `nn.Linear` as a `QuantLinear` of `method` (on the weight's device)."""
    w = linear.weight.detach()
    with torch.device(w.device):
        layer = QuantLinear(method, linear.in_features, linear.out_features,
                            linear.bias is not None, w.dtype)
    if linear.bias is not None:
        layer.bias.data.copy_(linear.bias.detach())
    method.load(layer, 0, w)
    method.finish(layer)
    return layer


def convert_linears(model: nn.Module, make: Callable[[], LinearMethod]) -> int:
    """Replace every `nn.Linear` of a loaded model by `convert_linear(_, make())`, one at
    a time (each original is freed as soon as its copy exists: the peak is the model plus
    one layer); returns how many. The vocabulary matrix of a tied embedding / LM head is
    never kept twice: the head gets a method that `embeds_cheaply` (the method's
    `tied_head_method()`, if it has one, else `make()` itself when it embeds cheaply) and
    the embedding reads its rows from that layout; without one the head stays the plain
    `nn.Linear` over the embedding's weight (not counted)."""
    emb, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = (isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear)
            and emb.weight is head.weight)
    slots = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    count = 0
    for parent, name in slots:
        linear, method = getattr(parent, name), make()
        if tied and linear is head:
            pick = getattr(method, "tied_head_method", None)
            method = pick() if pick else method
            if method is None or not getattr(method, "embeds_cheaply", False):
                continue
        setattr(parent, name, convert_linear(linear, method))
        count += 1
    head = getattr(model, "lm_head", None)
    if tied and isinstance(head, QuantLinear):
        model.embed_tokens = QuantEmbedding(head)
    return count


def model_memory_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: every parameter and every quantized buffer,
    each storage counted once (tied / fused weights), RoPE tables excluded."""
    seen: set[int] = set()
    total = 0
    tensors = [p for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, QuantLinear):
            tensors.extend(b for b in module.buffers(recurse=False) if b is not None)
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except NotImplementedError:  # opaque layouts (oneDNN-packed weights) own no storage
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total
