"""A pre-quantized checkpoint's tensors as the engine's compressed weights (no float round
trip): each quantized linear's stored parts become one logical `<prefix>.weight` of shape
[N, K] (out, in), yielded as a `GroupedWeight` (integer codes, float16 scales and mins) or
an `Fp8Weight` (e4m3 codes, float32 scale per row, or per row and K-group when
block-wise); every other tensor passes as float.

Layouts (the reference packers: AutoGPTQ's `QuantLinear.pack`, AutoAWQ's
`WQLinear_GEMM.from_linear`, compressed-tensors' `pack_to_int32`), w = (q - z) * s:
- GPTQ: `qweight` int32 [K * bits / 32, N] (32 / bits codes per word along K, the first in
  the lowest bits), `qzeros` int32 [K / g, N * bits / 32] (along N; stored minus one in the
  "gptq" checkpoint_format, as they are in "gptq_v2"), `scales` [K / g, N], `g_idx` [K] (the
  group of each input column: act-order when it is not k // g).
- AWQ GEMM: `qweight` int32 [K, N / 8] and `qzeros` [K / g, N / 8], packed along N in the
  nibble order 0, 2, 4, 6, 1, 3, 5, 7; `scales` [K / g, N].
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K * bits / 32] (along K) of
  q + 2^(bits-1); `weight_scale` [N, K / g]; `weight_zero_point` (asymmetric: int8
  [N, K / g], or int32 packed along N); `weight_shape` [2]; `weight_g_idx` [K] (act-order).
- FP8 (vLLM's "fp8" and compressed-tensors' float-quantized): `weight` float8_e4m3fn
  [N, K], `weight_scale` per tensor ([] or [1]) or per channel ([N] or [N, 1]),
  `input_scale` (static activation scale; kept on the weight, unused by the kernels).
  Block-wise ([bn, bk]: vLLM's `weight_block_size`, compressed-tensors' `block_structure`):
  `weight_scale_inv` (vLLM / DeepSeek-V3 naming; multiplied, despite the name) or
  `weight_scale` [ceil(N / bn), ceil(K / bk)], w[n, k] = q[n, k] * s[n // bn, k // bk]
  (partial last blocks included); served as an `Fp8Weight` of group bk, each block's scale
  repeated over its bn rows.
  Static KV cache scales (`k_scale`, `v_scale`, ... of a kv_cache_scheme) are skipped: the
  engine's FP8 / INT8 KV cache scales each token (`--kv-cache-dtype`).

Codes keep their exact values (4-bit: 0..15 with mins = -z * s; 8-bit: q - 128 with mins =
(128 - z) * s); scales become float16 (exact for float16 checkpoints, and for bfloat16
scales within float16's range), a min is z * s rounded once to float16 (exact when z is a
power of two, e.g. symmetric checkpoints' 8). An act-order weight's code columns are put
in group order with the permutation kept (`GroupedWeight.perm`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.engine.errors import ConfigError
from tandem.engine.quant.apply import SourceFormat
from tandem.engine.quant.base import Fp8Weight, GroupedWeight
from tandem.engine.quant.checkpoint import CheckpointQuant, kernel_group, read_quant_config

_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "gptq_v2": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
             "weight_g_idx"),
    "fp8": ("weight", "weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point"),
}
_MAIN = {"gptq": "qweight", "gptq_v2": "qweight", "awq": "qweight", "pack": "weight_packed",
         "fp8": "weight"}
_REQUIRED = {"gptq": ("qzeros", "scales"), "gptq_v2": ("qzeros", "scales"),
             "awq": ("qzeros", "scales"), "pack": ("weight_scale", "weight_shape"),
             "fp8": ()}
# AutoAWQ's order: nibble i of a word holds column 8c + _AWQ_ORDER[i]
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_FLOATS = ("F16", "BF16", "F32")
# static attention / KV cache scales a checkpoint may carry (vLLM's names); not parameters
_KV_SCALES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale",
              "k_proj.output_scale", "v_proj.output_scale")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 // bits codes each (the first in the lowest bits) packed along
    `dim` (0 or 1) of a 2-D tensor -> the unsigned codes (uint8), that dim 32 // bits times
    longer. One code position at a time (a byte per code, not four, held at once)."""
    pf, mask = 32 // bits, (1 << bits) - 1
    p = packed.to(torch.int32)
    r, c = p.shape
    out = torch.empty((r, pf, c) if dim == 0 else (r, c, pf), dtype=torch.uint8)
    for i in range(pf):
        code = ((p >> (bits * i)) & mask).to(torch.uint8)
        if dim == 0:
            out[:, i, :] = code
        else:
            out[:, :, i] = code
    return out.view(r * pf, c) if dim == 0 else out.view(r, c * pf)


def _awq_columns(q: torch.Tensor) -> torch.Tensor:
    """Unpacked AWQ columns (nibble order) -> column order."""
    inverse = torch.tensor([_AWQ_ORDER.index(j) for j in range(8)])
    n = q.shape[1]
    return q[:, (torch.arange(n) // 8) * 8 + inverse.repeat(n // 8)]


def act_order_perm(g_idx: torch.Tensor | None, k: int, g: int, where: str
                   ) -> torch.Tensor | None:
    """The input permutation that puts `g_idx`'s groups in order (None when it already is,
    or is absent); ConfigError unless every group holds exactly `g` columns."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.long).view(-1)
    plain = torch.arange(k) // g
    if g_idx.numel() != k:
        raise ConfigError(f"{where}: g_idx has {g_idx.numel()} entries for {k} input columns")
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ConfigError(f"{where}: g_idx does not assign {g} input columns to each group")
    return perm


def grouped_from_codes(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int,
                       group: int, perm: torch.Tensor | None, where: str) -> GroupedWeight:
    """Unsigned codes q [N, K], unsigned zero points [N, K / group] and scales [N, K / group]
    (w = (q - z) * s; input columns in checkpoint order) -> GroupedWeight rows in the
    kernel's group size (`kernel_group`), code columns in group order when `perm`."""
    s = scales.to(torch.float16)
    zf = zeros.to(torch.float32)
    if bits == 4:
        codes, mins = q.to(torch.int8), -(zf * s.float())
    else:  # 0..255 -> -128..127
        codes, mins = (q.to(torch.int16) - 128).to(torch.int8), (128 - zf) * s.float()
    mins = mins.to(torch.float16)
    g = kernel_group(group, bits, where)
    if g != group:
        s = s.repeat_interleave(group // g, dim=1)
        mins = mins.repeat_interleave(group // g, dim=1)
    if perm is not None:
        codes = codes[:, perm]
    return GroupedWeight(codes.contiguous(), s.contiguous(), mins.contiguous(), bits, g, perm)


def _fp8_scale(parts: Mapping[str, str]) -> str | None:
    """The suffix of an FP8 linear's weight scale: `weight_scale_inv` (block-wise, vLLM's
    naming) or `weight_scale`."""
    return next((s for s in ("weight_scale_inv", "weight_scale") if s in parts), None)


@dataclass
class _Linear:
    """One quantized linear: its stored parts (suffix -> tensor name), logical [N, K]."""

    prefix: str
    parts: dict[str, str]
    n: int
    k: int
    group: int  # the checkpoint's group (K: per channel)
    fmt: SourceFormat
    perm: torch.Tensor | None = None  # act-order: from g_idx, checked once by `_check`


class _Files:
    """Open safetensors files by tensor name (each file opened once)."""

    def __init__(self, files: Mapping[str, Path], stack: ExitStack) -> None:
        self.files, self.stack, self.open = files, stack, {}

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self.open:
            self.open[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        return self.open[path].get_tensor(name)


class PrequantCheckpoint:
    """The tensors of a pre-quantized checkpoint directory, validated against its layout:
    `shapes` (logical name -> shape, quantized linears as `<prefix>.weight` [N, K]),
    `formats` (logical name -> SourceFormat of each quantized linear) and `tensors(dtype)`
    (streamed once). A quantized linear's `bias` that the model lacks (`expected` names)
    is dropped when zero (AutoGPTQ writes them), kept (and so reported) otherwise.
    `split(name)`: the family's normaliser (a fused checkpoint tensor's row parts under
    standard names, `model.registry.Part`s, or None), applied to every logical tensor."""

    def __init__(self, quant: CheckpointQuant, source: str, files: Mapping[str, Path],
                 expected: Container[str],
                 split: Callable[[str], list | None] | None = None) -> None:
        self.quant, self.source, self.files = quant, source, dict(files)
        self.split = split
        meta: dict[str, tuple[tuple[int, ...], str]] = {}
        by_file: dict[Path, list[str]] = {}
        for name, path in self.files.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            if not path.is_file():
                raise ConfigError(f"{source}: shard {path.name} listed in the index is missing")
            with safe_open(path, framework="pt") as f:
                for name in names:
                    sl = f.get_slice(name)
                    meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
        layout = quant.layout
        blockwise = [n for n in meta if n.endswith(".weight_scale_inv")]
        if blockwise and quant.block is None:
            raise ConfigError(f"{source}: {blockwise[0]} is a block-wise FP8 scale, but "
                              "quantization_config names no block (weight_block_size)")
        main = _MAIN[layout]
        prefixes = [n.removesuffix("." + main) for n, (_, dt) in meta.items()
                    if n.endswith("." + main) and (layout != "fp8" or dt.startswith("F8"))]
        if not prefixes:
            raise ConfigError(f"{source}: quantization_config says {quant.method}, but no "
                              f"tensor is stored in its layout (no *.{main})")
        self.linears: dict[str, _Linear] = {}
        used: set[str] = set()
        with ExitStack() as stack:
            reader = _Files(self.files, stack)
            for prefix in prefixes:
                parts = {s: f"{prefix}.{s}" for s in _PARTS[layout] if f"{prefix}.{s}" in meta}
                used.update(parts.values())
                lin = self._check(prefix, parts, meta, reader)
                self.linears[prefix + ".weight"] = lin
                bias = prefix + ".bias"
                if bias in meta and bias not in expected and not reader.get(bias).any():
                    used.add(bias)
        used.update(n for n in meta if n.endswith(_KV_SCALES))
        self.floats = [n for n in self.files if n not in used]
        logical = {n: meta[n][0] for n in self.floats}
        logical.update({name: (lin.n, lin.k) for name, lin in self.linears.items()})
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.formats: dict[str, SourceFormat] = {}
        for name, shape in logical.items():
            for part, start, rows in self._parts(name):
                self.shapes[part] = shape if start is None else (rows, *shape[1:])
                if name in self.linears:
                    self.formats[part] = self.linears[name].fmt

    def _parts(self, name: str) -> list[tuple[str, int | None, int | None]]:
        """(standard name, first row or None, rows) of each part of logical tensor `name`."""
        parts = self.split(name) if self.split else None
        if parts is None:
            return [(name, None, None)]
        return [(p.name, p.start, p.rows) for p in parts]

    def _fail(self, what: str) -> ConfigError:
        q = self.quant
        grain = (f"blocks of {q.block[0]}x{q.block[1]}" if q.block is not None
                 else f"group_size {q.group_size or 'per channel'}")
        return ConfigError(f"{self.source}: {what} (a {q.method} checkpoint, {q.bits}-bit, "
                           f"{grain})")

    def _expect(self, name: str, meta: Mapping, shape: tuple[int, ...],
                dtypes: tuple[str, ...]) -> None:
        got, dt = meta[name]
        if tuple(got) != shape or dt not in dtypes:
            raise self._fail(f"{name} is {list(got)} {dt}, the layout needs {list(shape)} "
                             f"{'/'.join(dtypes)}")

    def _check(self, prefix: str, parts: dict[str, str], meta: Mapping,
               reader: _Files) -> _Linear:
        q, layout = self.quant, self.quant.layout
        missing = [s for s in _REQUIRED[layout] if s not in parts]
        if missing:
            raise self._fail(f"{prefix} has no {missing[0]}")
        main_shape, main_dt = meta[parts[_MAIN[layout]]]
        if len(main_shape) != 2:
            raise self._fail(f"{parts[_MAIN[layout]]} is {list(main_shape)}, not 2-D")
        pf = 32 // q.bits
        if layout == "fp8":
            if main_dt != "F8_E4M3":
                raise self._fail(f"{parts['weight']} is {main_dt}; float8_e4m3fn is served")
            n, k = main_shape
            scale = _fp8_scale(parts)
            if scale is None:
                raise self._fail(f"{prefix} has no weight_scale")
            scale_shape = meta[parts[scale]][0]
            if q.block is not None:
                bn, bk = q.block
                self._expect(parts[scale], meta, (-(-n // bn), -(-k // bk)), _FLOATS)
                fmt = SourceFormat(8, bk, False, kind="fp8", method=q.method)
                return _Linear(prefix, parts, n, k, bk, fmt)
            if tuple(scale_shape) not in ((), (1,), (n,), (n, 1)):
                raise self._fail(f"{parts[scale]} is {list(scale_shape)}; per-tensor "
                                 f"([] or [1]) or per-channel ([{n}] or [{n}, 1]) is served")
            fmt = SourceFormat(8, 0, False, kind="fp8", method=q.method)
            return _Linear(prefix, parts, n, k, k, fmt)
        if layout == "pack":
            n, k = (int(v) for v in reader.get(parts["weight_shape"]).view(-1).tolist())
            self._expect(parts["weight_packed"], meta, (n, -(-k // pf)), ("I32",))
        elif layout == "awq":
            k, n = main_shape[0], main_shape[1] * pf
            self._expect(parts["qweight"], meta, (k, n // pf), ("I32",))
        else:
            k, n = main_shape[0] * pf, main_shape[1]
            self._expect(parts["qweight"], meta, (k // pf, n), ("I32",))
        group = q.group_size or k
        if k % group:
            raise self._fail(f"{prefix}: {k} input columns are not whole groups of {group}")
        groups = k // group
        perm = None
        if layout == "pack":
            self._expect(parts["weight_scale"], meta, (n, groups), _FLOATS)
            if "weight_zero_point" in parts:
                zshape, zdt = meta[parts["weight_zero_point"]]
                if tuple(zshape) not in ((n, groups), (-(-n // pf), groups)):
                    raise self._fail(f"{parts['weight_zero_point']} is {list(zshape)}, the "
                                     f"layout needs [{n}, {groups}] (or packed along N)")
            if "weight_g_idx" in parts:
                perm = act_order_perm(reader.get(parts["weight_g_idx"]), k, group, prefix)
        else:
            if n % pf:
                raise self._fail(f"{prefix}: {n} output rows do not pack {pf} to a word")
            self._expect(parts["qzeros"], meta, (groups, n // pf), ("I32",))
            self._expect(parts["scales"], meta, (groups, n), _FLOATS)
            if "g_idx" in parts:
                self._expect(parts["g_idx"], meta, (k,), ("I32", "I64"))
                perm = act_order_perm(reader.get(parts["g_idx"]), k, group, prefix)
        where = f"{self.source}: {prefix}"
        fmt = SourceFormat(q.bits, kernel_group(group, q.bits, where), True,
                           act_order=perm is not None, method=q.method)
        return _Linear(prefix, parts, n, k, group, fmt, perm)

    def _weight(self, lin: _Linear, reader: _Files) -> GroupedWeight | Fp8Weight:
        q, layout, p = self.quant, self.quant.layout, lin.parts
        where = f"{self.source}: {lin.prefix}"
        if layout == "fp8":
            if "weight_zero_point" in p and reader.get(p["weight_zero_point"]).any():
                raise self._fail(f"{lin.prefix} has non-zero FP8 zero points")
            inp = p.get("input_scale")
            inp = None if inp is None else reader.get(inp).float().reshape(())
            scale = reader.get(p[_fp8_scale(p)]).to(torch.float32)
            if q.block is not None:  # each block's scale over its bn rows
                rows = scale.repeat_interleave(q.block[0], 0)[:lin.n].contiguous()
                return Fp8Weight(reader.get(p["weight"]), rows, inp, q.block[1])
            scale = scale.reshape(-1)
            scales = scale.expand(lin.n).clone() if scale.numel() == 1 else scale
            return Fp8Weight(reader.get(p["weight"]), scales, inp)
        bits, g = q.bits, lin.group
        if layout == "pack":
            codes = unpack_int32(reader.get(p["weight_packed"]), bits, 1)[:, :lin.k]
            offset = 1 << (bits - 1)  # stored q + offset
            zeros = torch.full((lin.n, lin.k // g), offset, dtype=torch.int32)
            if "weight_zero_point" in p:
                zp = reader.get(p["weight_zero_point"])
                if zp.dtype == torch.int32 and zp.shape[0] != lin.n:  # packed along N
                    zp = unpack_int32(zp, bits, 0)[:lin.n].to(torch.int32) - offset
                zeros = zeros + zp.to(torch.int32)
            return grouped_from_codes(codes, zeros, reader.get(p["weight_scale"]), bits, g,
                                      lin.perm, where)
        if layout == "awq":
            codes = _awq_columns(unpack_int32(reader.get(p["qweight"]), 4, 1))
            zeros = _awq_columns(unpack_int32(reader.get(p["qzeros"]), 4, 1))
        else:
            codes = unpack_int32(reader.get(p["qweight"]), bits, 0)
            zeros = unpack_int32(reader.get(p["qzeros"]), bits, 1).to(torch.int32)
            if layout == "gptq":  # stored minus one (vLLM adds it back)
                zeros = zeros + 1
        return grouped_from_codes(codes.T, zeros.T, reader.get(p["scales"]).T, bits, g,
                                  lin.perm, where)

    def tensors(self, dtype: torch.dtype
                ) -> Iterator[tuple[str, torch.Tensor | GroupedWeight | Fp8Weight]]:
        """(name, tensor) pairs, once: float tensors cast to `dtype`, quantized linears as
        compressed weights; in the order the files hold them."""
        order = sorted(list(self.floats) + list(self.linears),
                       key=lambda n: str(self.files[self.linears[n].parts[
                           _MAIN[self.quant.layout]]] if n in self.linears else self.files[n]))
        with ExitStack() as stack:
            reader = _Files(self.files, stack)
            for name in order:
                lin = self.linears.get(name)
                t = (reader.get(name).to(dtype).contiguous() if lin is None
                     else self._weight(lin, reader))
                for part, start, rows in self._parts(name):
                    if start is None:
                        yield part, t
                    elif isinstance(t, torch.Tensor):
                        yield part, t[start:start + rows]
                    else:
                        yield part, t.rows(start, start + rows)
                del t


def open_prequantized(model_dir: Path, files: Mapping[str, Path], expected: Container[str],
                      split: Callable[[str], list | None] | None = None
                      ) -> PrequantCheckpoint | None:
    """The checkpoint in `model_dir` (tensor name -> file in `files`) read through its
    `quantization_config`, or None for a float checkpoint (no quantization_config)."""
    quant = read_quant_config(model_dir)
    if quant is None:
        return None
    return PrequantCheckpoint(quant, str(model_dir), files, expected, split)
