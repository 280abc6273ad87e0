"""Linear-method interface and registry; the logical grouped-integer weight format.

A `LinearMethod` owns how one linear layer's weight is stored and multiplied (vLLM's
`LinearMethodBase`, gpt-fast's quantize handlers): float (plain or pre-packed), INT8 / INT4
weight-only, W8A8, FP8. The model code stays plain `nn.Linear`; `quant/apply.py` swaps
each for a `QuantLinear` on the meta device, before any weight exists, so a compressed
model never holds its float weights.

Life of a layer: `create` registers empty buffers (shapes only, on meta) -> the model is
materialised (`to_empty`) -> `load` fills row ranges, once each, from float rows or
`GroupedWeight` rows (fused q/k/v and gate/up parts arrive separately; a tensor-parallel
rank's columns of a per-channel layer as a `ColumnSlice`) -> `finish` turns
them into the kernel's layout -> `apply(x)` per step. `dequantize` returns the exact
float weight the layer computes with (tests compare kernels against it in float64).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tandem.engine.errors import ConfigError


@dataclass
class GroupedWeight:
    """Rows of an integer weight with one scale (and optional min) per group of K columns.

    w[n, k] = codes[n, k] * scales[n, k // g] + (mins[n, k // g] if mins is not None else 0)

    codes: [N, K] int8 -- signed -128..127 for `bits=8`, unsigned 0..15 for `bits=4`
    (GGUF's Q4_0 / Q4_1 convention: Q4_0 is mins = -8 * scales). scales / mins: [N, K // g]
    float16 (GGUF's own block scales, bit for bit). K % g == 0; g == K is per-channel.

    `perm` [K] int64 (act-order checkpoints, GPTQ's desc_act): the codes' columns are the
    layer's input columns reordered so that groups are contiguous; code column j holds input
    column perm[j] (`dequantize` returns the input order; a layer multiplies x[:, perm]).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in (4, 8) or k % self.group_size:
            raise ConfigError(f"bad grouped weight: bits={self.bits}, K={k}, "
                              f"group_size={self.group_size}")
        if tuple(self.scales.shape) != (n, k // self.group_size):
            raise ConfigError(f"grouped weight scales {tuple(self.scales.shape)} do not match "
                              f"codes {(n, k)} with group_size {self.group_size}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def rows(self, start: int, stop: int) -> GroupedWeight:
        return GroupedWeight(self.codes[start:stop], self.scales[start:stop],
                             None if self.mins is None else self.mins[start:stop],
                             self.bits, self.group_size, self.perm)

    def columns(self, start: int, stop: int) -> GroupedWeight:
        """Input columns [start, stop) (views): whole groups only (ConfigError otherwise)."""
        g = self.group_size
        if self.perm is not None:
            raise ConfigError(f"an act-order (desc_act) weight's input columns [{start}, {stop})"
                              " are scattered over its groups: it cannot be split by input "
                              "columns (tensor parallelism of o_proj / down_proj)")
        if start % g or stop % g or not 0 <= start < stop <= self.shape[1]:
            raise ConfigError(f"columns [{start}, {stop}) of a grouped weight of K="
                              f"{self.shape[1]} are not whole groups of {g}")
        return GroupedWeight(self.codes[:, start:stop], self.scales[:, start // g:stop // g],
                             None if self.mins is None else self.mins[:, start // g:stop // g],
                             self.bits, g)

    def padded_rows(self, rows: int) -> GroupedWeight:
        """These rows followed by zero rows up to `rows` (codes, scales and mins 0: each
        padding row dequantizes to 0)."""
        n, k = self.shape
        extra = rows - n

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra, t.shape[1])])

        return GroupedWeight(pad(self.codes), pad(self.scales),
                             None if self.mins is None else pad(self.mins), self.bits,
                             self.group_size, self.perm)

    def permute_rows(self, index: torch.Tensor) -> GroupedWeight:
        """Rows reordered by `index` (llama.cpp's Q/K un-permutation acts on whole rows)."""
        return GroupedWeight(self.codes[index], self.scales[index],
                             None if self.mins is None else self.mins[index],
                             self.bits, self.group_size, self.perm)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`, computed as `codes * scale + min` in float32 (GGUF's order:
        two roundings, no FMA), then cast; float64 computes in float64. Columns in input
        order (an act-order weight's codes are put back where `perm` says)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        n, k = self.shape
        g = self.group_size
        w = self.codes.to(work).view(n, k // g, g) * self.scales.to(work)[..., None]
        if self.mins is not None:
            w = w + self.mins.to(work)[..., None]
        w = w.view(n, k)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm.to(w.device)] = w
            w = out
        return w.to(dtype)


@dataclass
class Fp8Weight:
    """Rows of a float8_e4m3fn weight as an FP8 checkpoint stores it.

    Per row (`group_size` None): w[n, k] = codes[n, k] * scales[n] (a per-tensor scale
    arrives repeated per row, exactly); scales [N] float32.
    Block-wise (`group_size` g): w[n, k] = codes[n, k] * scales[n, k // g]; scales
    [N, ceil(K / g)] float32 (a checkpoint's [bn, bk] block scale repeated over its bn
    rows; the last group may be partial).

    codes: [N, K] float8_e4m3fn. `input_scale`: the checkpoint's static activation scale
    (a float32 scalar tensor) or None."""

    codes: torch.Tensor
    scales: torch.Tensor
    input_scale: torch.Tensor | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.float8_e4m3fn or self.codes.dim() != 2:
            raise ConfigError(f"fp8 weight codes must be [N, K] float8_e4m3fn, got "
                              f"{tuple(self.codes.shape)} {self.codes.dtype}")
        n, k = self.codes.shape
        if self.group_size is None:
            want: tuple[int, ...] = (n,)
        elif self.group_size < 1:
            raise ConfigError(f"fp8 weight group_size must be positive, got {self.group_size}")
        else:
            want = (n, -(-k // self.group_size))
        if tuple(self.scales.shape) != want:
            raise ConfigError(f"fp8 weight scales {tuple(self.scales.shape)} do not match "
                              f"codes {(n, k)}" + ("" if self.group_size is None else
                                                   f" with group_size {self.group_size}"))

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def rows(self, start: int, stop: int) -> Fp8Weight:
        return Fp8Weight(self.codes[start:stop], self.scales[start:stop], self.input_scale,
                         self.group_size)

    def columns(self, start: int, stop: int) -> Fp8Weight:
        """Input columns [start, stop) (views; each row keeps its scale). Block-wise: whole
        groups only (the last may end at K), ConfigError otherwise."""
        g, k = self.group_size, self.shape[1]
        if g is None:
            return Fp8Weight(self.codes[:, start:stop], self.scales, self.input_scale)
        if start % g or (stop % g and stop != k) or not 0 <= start < stop <= k:
            raise ConfigError(f"columns [{start}, {stop}) of a block-wise FP8 weight of K={k} "
                              f"are not whole groups of {g}")
        return Fp8Weight(self.codes[:, start:stop], self.scales[:, start // g:-(-stop // g)],
                         self.input_scale, g)

    def padded_rows(self, rows: int) -> Fp8Weight:
        """These rows followed by zero rows (scale 0) up to `rows`."""
        extra = rows - self.shape[0]
        pad = torch.zeros(extra, self.shape[1], dtype=torch.uint8, device=self.codes.device)
        codes = torch.cat([self.codes.view(torch.uint8), pad]).view(torch.float8_e4m3fn)
        zeros = self.scales.new_zeros(extra, *self.scales.shape[1:])
        return Fp8Weight(codes, torch.cat([self.scales, zeros]), self.input_scale,
                         self.group_size)

    def permute_rows(self, index: torch.Tensor) -> Fp8Weight:
        return Fp8Weight(self.codes[index], self.scales[index], self.input_scale,
                         self.group_size)

    def column_scales(self) -> torch.Tensor:
        """The scale of each element's group [N, K] (block-wise) or of each row [N, 1]."""
        if self.group_size is None:
            return self.scales[:, None]
        return self.scales.repeat_interleave(self.group_size, 1)[:, :self.shape[1]]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: codes * scale computed in float32 (float64 for float64)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.codes.to(work) * self.column_scales().to(work)).to(dtype)


@dataclass(frozen=True)
class ColumnSlice:
    """Input columns [start, start + size) of a whole weight `full` [N, K]: a
    tensor-parallel rank's share of a row-parallel layer (o_proj, down_proj), handed to a
    method whose scale spans a whole input row (`LinearMethod.row_scaled`). Such a method
    scales each row by the full row's range (`float_rows`), so every rank's codes and
    scales are exactly the unsharded layer's, sliced."""

    full: torch.Tensor | GroupedWeight | Fp8Weight
    start: int
    size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.full.shape[0]), self.size)

    def part(self) -> torch.Tensor | GroupedWeight | Fp8Weight:
        """The rank's columns as stored (views; a `GroupedWeight` in whole groups only)."""
        if not isinstance(self.full, torch.Tensor):
            return self.full.columns(self.start, self.start + self.size)
        return self.full[:, self.start:self.start + self.size]

    def float_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rank's columns in float32 [N, size], each whole row's max |w| [N] float32:
        the same values the unsharded layer's quantization sees)."""
        stop = self.start + self.size
        if not isinstance(self.full, torch.Tensor):
            full = self.full.dequantize(torch.float32)
            return full[:, self.start:stop], full.abs().amax(-1)
        amax = self.full.detach().abs().amax(-1).to(torch.float32)  # exact in any dtype
        return self.full[:, self.start:stop].detach().to(torch.float32), amax


def quantize_grouped(weight: torch.Tensor, bits: int, group_size: int,
                     symmetric: bool, row_amax: torch.Tensor | None = None) -> GroupedWeight:
    """Round-to-nearest quantization of float rows `weight` [N, K] (K % group_size == 0).

    bits=8, symmetric: codes in [-127, 127], scale = amax / 127 (mins None).
    bits=4, asymmetric: codes in [0, 15], scale = (max - min) / 15, min = the group's min
    (GGUF Q4_1 style); bits=4 symmetric: Q4_0 style, scale = -amax_signed / 8 with min
    = -8 * scale. Scales/mins are rounded to float16 first and codes computed against the
    rounded values, so `dequantize` is exactly what the kernels see.
    `row_amax` [N] (per-channel 8-bit symmetric only: group_size == K): each row's max |w|
    over its whole row when `weight` holds some of its columns (`ColumnSlice`).
    """
    n, k = weight.shape
    if k % group_size:
        raise ConfigError(f"K={k} is not a multiple of group_size {group_size}")
    if row_amax is not None and not (bits == 8 and symmetric and group_size == k):
        raise ConfigError("a whole row's range scales per-channel symmetric int8 only")
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    tiny = torch.finfo(torch.float16).tiny
    mins = None
    if bits == 8 and symmetric:
        amax = w.abs().amax(-1) if row_amax is None else row_amax.to(torch.float32).view(n, 1)
        scales = (amax / 127).clamp(min=tiny).to(torch.float16)
        codes = torch.round(w / scales.float()[..., None]).clamp(-127, 127)
    elif bits == 4 and not symmetric:
        lo, hi = w.amin(-1), w.amax(-1)
        scales = ((hi - lo) / 15).clamp(min=tiny).to(torch.float16)
        mins = lo.to(torch.float16)
        codes = torch.round((w - mins.float()[..., None]) / scales.float()[..., None])
        codes = codes.clamp(0, 15)
    elif bits == 4 and symmetric:
        # Q4_0: the value of largest magnitude maps to code 0 (-8), keeping its sign
        idx = w.abs().argmax(-1, keepdim=True)
        peak = w.gather(-1, idx).squeeze(-1)
        scales = (peak / -8).to(torch.float16)
        scales = torch.where(scales == 0, torch.full_like(scales, tiny), scales)
        mins = (scales.float() * -8).to(torch.float16)
        codes = torch.round(w / scales.float()[..., None] + 8).clamp(0, 15)
    else:
        raise ConfigError(f"no {bits}-bit {'symmetric' if symmetric else 'asymmetric'} "
                          "grouped quantization")
    return GroupedWeight(codes.to(torch.int8).reshape(n, k), scales, mins, bits, group_size)


# what `LinearMethod.load` accepts (a `ColumnSlice` only where `row_scaled`)
WeightRows = torch.Tensor | GroupedWeight | Fp8Weight | ColumnSlice


class QuantLinear(nn.Module):
    """`y = x @ W.T + b`, x [T, in] -> [T, out] in the activation dtype; W stored and
    multiplied by `method` (its buffers live on this module, registered by `create`)."""

    def __init__(self, method: LinearMethod, in_features: int, out_features: int,
                 bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.method = method
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype  # activation / output dtype
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        # a row-parallel rank's layer (`parallel.tp.share_input_ranges`): turns, in place,
        # each input row's max |x| over this rank's columns into the whole row's, for
        # methods that quantize their input per token; None: the input is the whole row
        self.input_amax: Callable[[torch.Tensor], torch.Tensor] | None = None
        method.create(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, method={self.method.name}"
                f", bias={self.bias is not None}")


class LinearMethod(ABC):
    """How a `QuantLinear` stores and multiplies its weight. One instance may serve many
    layers (it holds configuration, not tensors)."""

    name: ClassVar[str] = ""
    # whether one scale spans a layer's whole input row (per-channel): a row-parallel
    # shard then arrives as a `ColumnSlice`, so it is scaled by the full row's range
    row_scaled: bool = False

    @abstractmethod
    def create(self, layer: QuantLinear) -> None:
        """Register the (empty) weight buffers on `layer` for `layer.out_features` x
        `layer.in_features`, on the current default device (meta while the model is built)."""

    @abstractmethod
    def load(self, layer: QuantLinear, start: int, weight: WeightRows) -> None:
        """Fill output rows [start, start + rows) from float rows [rows, K], a
        `GroupedWeight` or an `Fp8Weight` (a pre-quantized checkpoint's codes, kept exactly
        where the method's format can hold them), or, where `row_scaled`, a `ColumnSlice`
        (scaled by its whole rows' range); every row is loaded exactly once before
        `finish`."""

    def finish(self, layer: QuantLinear) -> None:  # noqa: B027 - optional hook
        """After every row is loaded: convert to the kernel layout, drop staging buffers."""

    @abstractmethod
    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] (layer.dtype) -> [T, N] (layer.dtype), bias added."""

    @abstractmethod
    def dequantize(self, layer: QuantLinear) -> torch.Tensor:
        """The float weight [N, K] (float32) this layer computes with."""

    def embed(self, layer: QuantLinear, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the weight, dequantized -> [T, K] in layer.dtype (a quantized
        token embedding shares its storage with a tied LM head)."""
        return self.dequantize(layer)[ids].to(layer.dtype)

    def weight_bytes(self, layer: QuantLinear) -> int:
        """Resident bytes of the layer's weight storage (bias excluded)."""
        return sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False))


_REGISTRY: dict[str, Callable[..., LinearMethod]] = {}


def register_linear_method(name: str) -> Callable[[type[LinearMethod]], type[LinearMethod]]:
    def deco(cls: type[LinearMethod]) -> type[LinearMethod]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_linear_method(name: str, **options: object) -> LinearMethod:
    """An instance of the registered method `name` (options: its constructor's)."""
    from tandem.engine.quant import methods  # noqa: F401 - registers the built-in methods

    if name not in _REGISTRY:
        raise ConfigError(f"unknown linear method {name!r}; available: "
                          f"{', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**options)


def linear_methods() -> list[str]:
    from tandem.engine.quant import methods  # noqa: F401

    return sorted(_REGISTRY)
