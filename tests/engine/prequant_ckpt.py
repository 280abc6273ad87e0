"""Tiny pre-quantized checkpoints for the tests: GPTQ, AWQ, FP8 and compressed-tensors
tensors packed by each format's reference packer (AutoGPTQ's `QuantLinear.pack`, AutoAWQ's
`WQLinear_GEMM.from_linear`, compressed-tensors' `pack_to_int32`) from random codes, zero
points and scales, with the float checkpoint of their dequantized weights beside them."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 4, 2
E4M3_MAX = 448.0
HEAD_DIM = HIDDEN // HEADS
# HF linear -> (out N, in K)
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
          "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
          "mlp.down_proj": (HIDDEN, INTER)}
# the engine's fused modules and the HF linears whose rows they hold, in order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}
FLOAT_LINEAR = "model.layers.1.mlp.down_proj"  # left float (a checkpoint's ignore list)


# ---- the reference packers ---------------------------------------------------------------

def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits (numpy's astype)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_pack(q_kn: torch.Tensor, zeros_gn: torch.Tensor, bits: int, v1: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ `QuantLinear.pack`: intweight [K, N] -> qweight [K * bits / 32, N], row r
    word |= intweight[r * pf + j] << (bits * j); zeros [G, N] (minus one: the "gptq"
    checkpoint_format) -> qzeros [G, N * bits / 32], column c |= zeros[:, c * pf + j] <<
    (bits * j)."""
    pf = 32 // bits
    k, n = q_kn.shape
    qweight = torch.zeros(k // pf, n, dtype=torch.int64)
    for j in range(pf):
        qweight |= q_kn[j::pf].to(torch.int64) << (bits * j)
    z = zeros_gn.to(torch.int64) - (1 if v1 else 0)
    qzeros = torch.zeros(z.shape[0], n // pf, dtype=torch.int64)
    for j in range(pf):
        qzeros |= z[:, j::pf] << (bits * j)
    return _int32(qweight), _int32(qzeros)


def awq_pack(int_kn: torch.Tensor) -> torch.Tensor:
    """AutoAWQ `WQLinear_GEMM.from_linear`: [K, N] (or zeros [G, N]) -> [K, N / 8] int32,
    column c |= x[:, c * 8 + order_map[i]] << (4 * i), order_map = [0, 2, 4, 6, 1, 3, 5, 7]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = torch.zeros(int_kn.shape[0], int_kn.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        out |= int_kn[:, order_map[i]::8].to(torch.int64) << (4 * i)
    return _int32(out)


def pack_to_int32(value: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors `pack_to_int32`: signed int8 values + 2^(bits-1), 32 / bits to a
    word along `packed_dim`, the first in the lowest bits."""
    assert value.dtype == torch.int8
    value = (value.to(torch.int64) + (1 << (num_bits - 1)))
    if packed_dim == 0:
        value = value.T
    rows, cols = value.shape
    pf = 32 // num_bits
    value = torch.nn.functional.pad(value, (0, -cols % pf))
    shifts = torch.arange(pf, dtype=torch.int64) * num_bits
    packed = (value.view(rows, -1, pf) << shifts).sum(dim=2)
    packed = _int32(packed)
    return packed.T.contiguous() if packed_dim == 0 else packed


# ---- random quantized layers and their float reference ------------------------------------

@dataclass
class IntLinear:
    """Unsigned codes q [N, K] (0..2^bits-1), zero points z [N, G], float16 scales s [N, G]
    and the group of each input column g_idx [K]: w = (q - z[:, g_idx]) * s[:, g_idx]."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    def dequant(self) -> torch.Tensor:
        z, s = self.z[:, self.g_idx], self.s[:, self.g_idx].double()
        return ((self.q - z).double() * s).float()


def int_linear(gen: torch.Generator, n: int, k: int, group: int, bits: int, sym: bool,
               g_idx: torch.Tensor | None = None) -> IntLinear:
    top = 1 << bits
    q = torch.randint(0, top, (n, k), generator=gen)
    groups = k // group
    z = (torch.full((n, groups), top // 2) if sym
         else torch.randint(1, top, (n, groups), generator=gen))
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 0.004).to(torch.float16)
    return IntLinear(q, z, s, torch.arange(k) // group if g_idx is None else g_idx, bits)


def act_order_g_idx(gen: torch.Generator, k: int, group: int) -> torch.Tensor:
    """AutoGPTQ's act-order groups: g_idx = (i // group)[invperm] for its column order (one
    per layer input: q / k / v share it, as gate / up do)."""
    return (torch.arange(k) // group)[torch.argsort(torch.randperm(k, generator=gen))]


def fp8_linear(gen: torch.Generator, n: int, k: int, per_channel: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    codes = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n if per_channel else 1, generator=gen) * 4e-4 + 1e-4
    return codes, scale


def fp8_block_linear(gen: torch.Generator, n: int, k: int, block: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes [N, K], float32 block scales [ceil(N / bn), ceil(K / bk)], the float
    weight w[n, k] = q[n, k] * s[n // bn, k // bk]): DeepSeek-V3's block-wise layout."""
    bn, bk = block
    codes = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 4e-4 + 1e-4
    full = scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return codes, scale, (codes.double() * full).float()


def write_checkpoint(out: Path, base, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    """A sharded HF directory (two files, an index; one layer's parts split over both)."""
    cfg, keep, tok = base
    out.mkdir(parents=True, exist_ok=True)
    config = dict(cfg)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    everything = {**keep, **tensors}
    names = sorted(everything)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: everything[n].contiguous() for n in part}, str(out / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in tok.iterdir():
        shutil.copy(f, out / f.name)
    return out


def _prefixes():
    for i in range(LAYERS):
        for lin, (n, k) in SHAPES.items():
            yield f"model.layers.{i}.{lin}", n, k


def make_int(tmp: Path, base, fmt: str, *, bits: int = 4, group: int = 32, sym: bool = False,
             act_order: bool = False, v2: bool = False, packed_zp: bool = False,
             seed: int = 0) -> tuple[Path, Path, dict]:
    """(the quantized checkpoint, the float one of its dequantized weights, {HF linear
    prefix: reference float weight})."""
    gen = torch.Generator().manual_seed(seed)
    qt: dict[str, torch.Tensor] = {}
    ft: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    orders: dict[tuple[str, str], torch.Tensor] = {}  # act-order g_idx per fused layer
    for prefix, n, k in _prefixes():
        if prefix == FLOAT_LINEAR:  # kept float by both checkpoints
            w = torch.randn(n, k, generator=gen) * 0.05
            qt[prefix + ".weight"] = ft[prefix + ".weight"] = ref[prefix] = w
            continue
        g = k if group == -1 else group
        _, _, index, linear = prefix.split(".", 3)
        key = (index, next(f for f, parts in FUSED.items() if linear in parts))
        if act_order and key not in orders:
            orders[key] = act_order_g_idx(gen, k, g)
        lin = int_linear(gen, n, k, g, bits, sym, orders.get(key))
        ref[prefix] = ft[prefix + ".weight"] = lin.dequant()
        if fmt == "gptq":
            g_z = lin.z.T.contiguous()  # [G, N]
            qweight, qzeros = gptq_pack(lin.q.T.contiguous(), g_z, bits, v1=not v2)
            qt.update({prefix + ".qweight": qweight, prefix + ".qzeros": qzeros,
                       prefix + ".scales": lin.s.T.contiguous(),
                       prefix + ".g_idx": lin.g_idx.to(torch.int32),
                       prefix + ".bias": torch.zeros(n, dtype=torch.float16)})
        elif fmt == "awq":
            qt.update({prefix + ".qweight": awq_pack(lin.q.T.contiguous()),
                       prefix + ".qzeros": awq_pack(lin.z.T.contiguous()),
                       prefix + ".scales": lin.s.T.contiguous()})
        else:  # compressed-tensors pack-quantized: signed values, signed zero points
            off = 1 << (bits - 1)
            qt.update({prefix + ".weight_packed": pack_to_int32((lin.q - off).to(torch.int8),
                                                                bits),
                       prefix + ".weight_scale": lin.s.clone(),
                       prefix + ".weight_shape": torch.tensor([n, k], dtype=torch.int64)})
            if not sym:  # int8 [N, G], or (newer releases) packed along N
                zp = (lin.z - off).to(torch.int8)
                qt[prefix + ".weight_zero_point"] = (pack_to_int32(zp, bits, packed_dim=0)
                                                     if packed_zp else zp)
            if act_order:
                qt[prefix + ".weight_g_idx"] = lin.g_idx.to(torch.int32)
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
              "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    elif fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": ["down_proj"]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "quantization_status": "compressed", "ignore": ["lm_head", FLOAT_LINEAR],
              "config_groups": {"group_0": {
                  "targets": ["Linear"], "input_activations": None,
                  "weights": {"num_bits": bits, "type": "int", "strategy": "group",
                              "group_size": group, "symmetric": sym, "dynamic": False,
                              "actorder": "group" if act_order else None}}}}
    name = (f"{fmt}{bits}g{group}{'sym' if sym else ''}{'act' if act_order else ''}"
            f"{'v2' if v2 else ''}{'pz' if packed_zp else ''}{seed}")
    return (write_checkpoint(tmp / name, base, qt, qc),
            write_checkpoint(tmp / (name + "-float"), base, ft, None), ref)


def make_fp8_block(tmp: Path, base, fmt: str, block: tuple[int, int], seed: int = 0
                   ) -> tuple[Path, Path, dict]:
    """Block-wise FP8: vLLM's "fp8" with `weight_block_size` and `weight_scale_inv` (the
    DeepSeek-V3 / Qwen3 -FP8 layout, dynamic activations) or compressed-tensors' FP8
    `strategy: block` with its `block_structure` and `weight_scale`."""
    gen = torch.Generator().manual_seed(seed)
    qt, ft, ref = {}, {}, {}
    for prefix, n, k in _prefixes():
        if prefix == FLOAT_LINEAR:
            w = torch.randn(n, k, generator=gen) * 0.05
            qt[prefix + ".weight"] = ft[prefix + ".weight"] = ref[prefix] = w
            continue
        codes, scale, w = fp8_block_linear(gen, n, k, block)
        ref[prefix] = ft[prefix + ".weight"] = w
        qt[prefix + ".weight"] = codes
        qt[prefix + (".weight_scale_inv" if fmt == "fp8" else ".weight_scale")] = scale
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": list(block), "ignored_layers": ["lm_head", FLOAT_LINEAR]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head", FLOAT_LINEAR],
              "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                              "strategy": "block", "block_structure": list(block),
                              "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                        "group_size": 128, "dynamic": True,
                                        "symmetric": True}}}}
    name = f"{fmt}-block{block[0]}x{block[1]}-{seed}"
    return (write_checkpoint(tmp / name, base, qt, qc),
            write_checkpoint(tmp / (name + "-float"), base, ft, None), ref)


def make_fp8(tmp: Path, base, fmt: str, *, per_channel: bool, seed: int = 0
             ) -> tuple[Path, Path, dict]:
    gen = torch.Generator().manual_seed(seed)
    qt, ft, ref = {}, {}, {}
    for prefix, n, k in _prefixes():
        if prefix == FLOAT_LINEAR:
            w = torch.randn(n, k, generator=gen) * 0.05
            qt[prefix + ".weight"] = ft[prefix + ".weight"] = ref[prefix] = w
            continue
        codes, scale = fp8_linear(gen, n, k, per_channel)
        ref[prefix] = ft[prefix + ".weight"] = (codes.double() * scale.double()[:, None]
                                                if per_channel else
                                                codes.double() * scale.double()).float()
        if fmt == "fp8":  # vLLM's: a scalar per-tensor scale, or [N, 1] per channel
            stored = scale.view(n, 1) if per_channel else scale.view(())
        else:  # compressed-tensors: [1] per tensor, [N, 1] per channel
            stored = scale.view(n, 1) if per_channel else scale.view(1)
        qt.update({prefix + ".weight": codes, prefix + ".weight_scale": stored,
                   prefix + ".input_scale": torch.tensor([0.02])})
        if fmt != "fp8" and prefix.endswith("q_proj"):  # its kv_cache_scheme's scales
            attn = prefix.removesuffix(".q_proj")
            qt.update({attn + ".k_scale": torch.tensor(0.05), attn + ".v_scale":
                       torch.tensor(0.07)})
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static",
              "ignored_layers": ["lm_head", FLOAT_LINEAR]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head", FLOAT_LINEAR],
              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False, "symmetric": True},
              "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                              "strategy": "channel" if per_channel else "tensor"},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                        "dynamic": False, "symmetric": True}}}}
    name = f"{fmt}-{'channel' if per_channel else 'tensor'}{seed}"
    return (write_checkpoint(tmp / name, base, qt, qc),
            write_checkpoint(tmp / (name + "-float"), base, ft, None), ref)


FORMATS = {
    "gptq4-sym": lambda t, b: make_int(t, b, "gptq", sym=True, group=64),
    "gptq4-asym": lambda t, b: make_int(t, b, "gptq", group=32),
    "gptq4-act-order": lambda t, b: make_int(t, b, "gptq", sym=True, group=32,
                                             act_order=True),
    "gptq8-per-channel": lambda t, b: make_int(t, b, "gptq", bits=8, group=-1, sym=True),
    "gptq4-v2-g128": lambda t, b: make_int(t, b, "gptq", group=128, v2=True),
    "awq": lambda t, b: make_int(t, b, "awq", group=32),
    "ct-int4-asym": lambda t, b: make_int(t, b, "ct", group=32),
    "ct-int4-asym-packed-zp": lambda t, b: make_int(t, b, "ct", group=32, packed_zp=True),
    "ct-int4-act-order": lambda t, b: make_int(t, b, "ct", group=64, sym=True,
                                               act_order=True),
    "fp8-tensor": lambda t, b: make_fp8(t, b, "fp8", per_channel=False),
    "fp8-channel": lambda t, b: make_fp8(t, b, "fp8", per_channel=True),
    "ct-fp8-channel": lambda t, b: make_fp8(t, b, "ct", per_channel=True),
    # partial last blocks: N 128 = 48 + 48 + 32 (k/v: 64 = 48 + 16), K 128 = 96 + 32,
    # down_proj's K 256 = 96 + 96 + 64
    "fp8-block": lambda t, b: make_fp8_block(t, b, "fp8", (48, 96)),
    "ct-fp8-block": lambda t, b: make_fp8_block(t, b, "ct", (128, 32)),
}
