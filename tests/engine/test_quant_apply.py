"""Quantized weights end to end through loading: GGUF tensors kept compressed
(`open_model(keep_quantized=True)`), the quantization plan per mode, meta-device swap and
row-range loads (`quant/apply.py`, `llama.py`), tied storage and `model_memory_bytes`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.engine.errors import ConfigError
from tandem.engine.model.config import ModelArchConfig
from tandem.engine.model.gguf_loader import grouped
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.loader import open_model
from tandem.engine.quant.apply import (
    QuantEmbedding,
    SourceFormat,
    convert_linears,
    model_memory_bytes,
    plan_quantization,
    prepare_model,
)
from tandem.engine.quant.base import GroupedWeight, QuantLinear, quantize_grouped
from tandem.engine.quant.float_methods import FloatMethod

CPU = torch.device("cpu")


def test_gguf_tensors_kept_compressed_dequantize_bit_exactly(bundled_gguf):
    """Every Q4_1 / Q8_0 tensor of the bundled file, kept as codes + scales (+ mins),
    dequantizes to exactly the float path's tensor (rows un-permuted the same way)."""
    floats = open_model(bundled_gguf)
    kept = open_model(bundled_gguf, keep_quantized=True)
    assert kept.formats["model.embed_tokens.weight"] == SourceFormat(8, 32, False)
    assert kept.formats["model.layers.0.self_attn.q_proj.weight"] == SourceFormat(4, 32, True)
    assert "model.norm.weight" not in kept.formats  # F32 stays float
    n_grouped = 0
    for (name, want), (name2, got) in zip(floats.tensors(), kept.tensors(), strict=True):
        assert name == name2
        if name in kept.formats:
            assert isinstance(got, GroupedWeight)
            assert got.bits == kept.formats[name].bits
            assert torch.equal(got.dequantize(), want), name
            n_grouped += 1
        else:
            assert torch.equal(got, want), name
    assert n_grouped == 1 + 7 * kept.config.num_layers


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_grouped_matches_gguf_reference_on_random_blocks(qtype):
    """Random GGUF blocks (seeded) through `grouped` vs gguf-py's own dequantizer."""
    from gguf import quants

    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((24, 96)).astype(np.float32)
    raw = quants.quantize(w, qtype)
    ref = quants.dequantize(raw, qtype)
    got = grouped(raw, qtype, (24, 96))
    assert got.group_size == 32 and got.bits == (8 if qtype == Q.Q8_0 else 4)
    np.testing.assert_array_equal(got.dequantize().numpy(), ref)


def _arch(tied: bool = True, layers: int = 2) -> ModelArchConfig:
    return ModelArchConfig(architecture="llama", vocab_size=96, hidden_size=64,
                           intermediate_size=128, num_layers=layers, num_heads=4,
                           num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                           max_position_embeddings=64, tie_word_embeddings=tied)


def test_gguf_plan_keeps_each_layers_own_format():
    """all-4-bit parts -> int4 g32; a Q8_0 part among Q4_1 ones -> int8 g32 with mins (both
    fit exactly); float parts only -> stays float; no quantized tensor -> ConfigError."""
    arch = _arch()
    q4, q8 = SourceFormat(4, 32, True), SourceFormat(8, 32, False)
    formats = {"model.embed_tokens.weight": q8}
    for i in range(2):
        p = f"model.layers.{i}."
        formats.update({p + "self_attn.q_proj.weight": q4, p + "self_attn.k_proj.weight": q4,
                        p + "self_attn.v_proj.weight": q8 if i == 0 else q4,
                        p + "mlp.gate_proj.weight": q4, p + "mlp.up_proj.weight": q4})
    plan = plan_quantization("gguf", arch, formats, CPU, None)
    m = plan.methods
    assert m["layers.0.self_attn.qkv_proj"].name == "int8"
    assert m["layers.0.self_attn.qkv_proj"].has_mins
    assert m["layers.1.self_attn.qkv_proj"].name == "int4"
    assert m["layers.1.mlp.gate_up_proj"].name == "int4"
    assert "layers.0.self_attn.o_proj" not in m  # float in this "file"
    assert m["embed_tokens"].name == "int8" and not m["embed_tokens"].has_mins
    with pytest.raises(ConfigError, match="has none"):
        plan_quantization("gguf", arch, {}, CPU, None, source="x.safetensors")


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8", "fp8"])
def test_every_mode_plans_every_linear_and_the_vocabulary(mode):
    arch = _arch(tied=False)
    plan = plan_quantization(mode, arch, {}, CPU, None)
    assert len(plan.methods) == 4 * arch.num_layers + 2
    head = {"int8": "int8", "int4": "int8", "w8a8": "int8", "fp8": "fp8"}[mode]
    assert plan.methods["lm_head"].name == head
    assert plan.methods["layers.1.mlp.gate_up_proj"].name == mode
    # w8a8: int8 activations only into o_proj and gate_up; qkv / down weight-only int8
    assert plan.methods["layers.1.mlp.down_proj"].name == ("int8" if mode == "w8a8" else mode)
    assert plan.methods["layers.0.self_attn.qkv_proj"].name == (
        "int8" if mode == "w8a8" else mode)


def _float_weights(arch: ModelArchConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named weights for `arch` (what a safetensors checkpoint would hold)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        ref = LlamaForCausalLM(arch, None)  # type: ignore[arg-type]
    names = ref._weight_targets()
    return {n: torch.randn(tuple(t.shape), generator=g) * 0.1 for n, t in names.items()}


class _Counting(FloatMethod):
    """"float" storage that records every row range it is given."""

    def __init__(self, *, device: torch.device, native=None) -> None:
        super().__init__(device=device)
        self.loads: list[tuple[int, int, int]] = []
        self.finished = 0

    def load(self, layer, start, weight):
        self.loads.append((id(layer), start, weight.shape[0]))
        super().load(layer, start, weight)

    def finish(self, layer):
        self.finished += 1


@pytest.mark.parametrize("tied", [True, False])
def test_swapped_layers_get_every_row_once_and_compute_the_same(tied):
    """prepare_model on meta + materialize + load_weights: every fused part lands in its
    row range of the `QuantLinear` exactly once, each layer is finished once, and the
    model computes exactly what the plain float model computes."""
    arch = _arch(tied=tied)
    weights = _float_weights(arch, seed=3)
    method = _Counting(device=CPU)
    plan = plan_quantization(None, arch, {}, CPU, None)
    with torch.device("meta"):
        paths = [f"layers.{i}.{m}" for i in range(arch.num_layers)
                 for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                           "mlp.down_proj")] + ["embed_tokens"] + ([] if tied else ["lm_head"])
        plan.methods = dict.fromkeys(paths, method)
        model = LlamaForCausalLM(arch, None)  # type: ignore[arg-type]
        assert prepare_model(model, plan, torch.float32) == len(paths) - 1
    model.materialize(CPU, torch.float32)
    model.load_weights(weights)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert (model.lm_head is model.embed_tokens.storage) == tied
    layers = {id(m): m for m in model.modules() if isinstance(m, QuantLinear)}
    assert method.finished == len(layers) == len(paths)
    for key, layer in layers.items():  # the row ranges tile [0, N) exactly once
        ranges = sorted((s, n) for k, s, n in method.loads if k == key)
        assert sum(n for _, n in ranges) == layer.out_features
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    with torch.device("meta"):
        plain = LlamaForCausalLM(arch, None)  # type: ignore[arg-type]
    plain.materialize(CPU, torch.float32)
    plain.load_weights(weights)
    ids = torch.tensor([1, 5, 9, 95])
    assert torch.equal(model.embed_tokens(ids), plain.embed_tokens(ids))
    x = torch.randn(3, arch.hidden_size)
    assert torch.equal(model.lm_head(x), plain.lm_head(x))
    assert torch.equal(model.layers[1].self_attn.qkv_proj(x),
                       plain.layers[1].self_attn.qkv_proj(x))
    # the same storage counted once: tied = one vocabulary matrix
    assert model_memory_bytes(model) == model_memory_bytes(plain)


def test_a_mis_shaped_row_range_is_refused():
    arch = _arch()
    weights = _float_weights(arch, seed=1)
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    plan = plan_quantization(None, arch, {}, CPU, None)
    plan.methods = {"layers.0.self_attn.qkv_proj": FloatMethod(device=CPU)}
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, None)  # type: ignore[arg-type]
        prepare_model(model, plan, torch.float32)
    model.materialize(CPU, torch.float32)
    with pytest.raises(ConfigError, match="k_proj.weight' has shape"):
        model.load_weights(weights)


@pytest.mark.parametrize("kernel", ["default", "onednn", "no-native"])
def test_packed_float_lm_head_serves_the_tied_embedding_once(kernel, monkeypatch):
    """convert_linears with the packed method, whichever layout the CPU gets (oneDNN is
    the default on AVX-512): the tied vocabulary matrix stays resident once (the head in
    native panels serving the embedding's rows, or left a plain linear over the
    embedding's weight), embedding rows are bit-exact, logits match float64."""
    from tandem.engine.model.cpu_linear import onednn_available
    from tandem.engine.native import load_native
    from tandem.engine.quant.float_methods import PackedMethod

    lib = None if kernel == "no-native" else load_native()
    if kernel == "onednn":
        monkeypatch.setenv("TANDEM_LINEAR_KERNEL", "onednn")
    if kernel != "default" and not onednn_available(torch.float32, CPU):
        pytest.skip("needs oneDNN")
    arch = _arch()
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, None)  # type: ignore[arg-type]
    model.materialize(CPU, torch.float32)
    model.load_weights(_float_weights(arch, seed=2))
    before = model_memory_bytes(model)
    emb = model.embed_tokens.weight.detach().clone()
    body = model.layers[0].mlp.down_proj.weight.detach().clone()
    count = convert_linears(model, lambda: PackedMethod(device=CPU, native=lib))
    head = model.lm_head
    assert model_memory_bytes(model) == before
    if isinstance(head, QuantLinear):
        assert head.method.embeds_cheaply and isinstance(model.embed_tokens, QuantEmbedding)
        assert count == 4 * arch.num_layers + 1
    else:  # no layout that serves rows: the head shares the embedding's float weight
        assert head.weight is model.embed_tokens.weight and count == 4 * arch.num_layers
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and torch.equal(down.method.dequantize(down), body)
    ids = torch.tensor([0, 17, 95, 17])
    assert torch.equal(model.embed_tokens(ids), emb[ids])
    for rows in (1, 16):
        x = torch.randn(rows, arch.hidden_size, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ emb.double().T
        bound = arch.hidden_size * 2.0 ** -23 * (x.double().abs() @ emb.double().abs().T)
        assert ((head(x).double() - want).abs() <= bound).all()


def test_quantize_grouped_codes_ranges_and_reconstruction():
    """Seeded randomized: codes stay in range, and every weight is within half a step of
    its reconstruction (plus float16 rounding of the scale/min); Q4_0-style symmetric
    4-bit maps the peak to code 0, so its far side (code 16 -> 15) may be a whole step off,
    as in GGUF."""
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        w = torch.randn(8, 128, generator=g) * (10 ** (trial % 5 - 2))
        for bits, sym in ((8, True), (4, False), (4, True)):
            gw = quantize_grouped(w, bits, 32, sym)
            lo, hi = (-127, 127) if bits == 8 else (0, 15)
            assert int(gw.codes.min()) >= lo and int(gw.codes.max()) <= hi
            step = gw.scales.float().abs().repeat_interleave(32, dim=1)
            err = (gw.dequantize() - w).abs()
            half = 1.0 if (bits, sym) == (4, True) else 0.5
            assert bool((err <= step * (half + 1e-2) + 1e-6 * w.abs().amax()).all()), (
                bits, sym, float((err / step).max()))
