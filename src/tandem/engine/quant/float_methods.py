"""Float linear methods: "float" (`F.linear` over a `[N, K]` weight in the model dtype) and
"packed" (CPU float32 weights packed once after loading into `model/cpu_linear.py`'s
native 16-column panels or oneDNN's blocked layout; bfloat16 weights into its native pair
panels or oneDNN's, where the CPU multiplies bfloat16 in hardware)."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tandem.engine.model.cpu_linear import (
    ONEDNN_BATCH_HINT,
    bf16_panel_rows,
    native_preferred,
    native_simd,
    pack_bf16_panels,
    pack_panels,
)
from tandem.engine.quant.base import (
    ColumnSlice,
    GroupedWeight,
    LinearMethod,
    QuantLinear,
    WeightRows,
    register_linear_method,
)


def float_rows(rows: WeightRows, dtype: torch.dtype) -> torch.Tensor:
    """Float rows `[r, K]` in `dtype` from float or grouped rows (or a column slice)."""
    if isinstance(rows, ColumnSlice):
        rows = rows.part()
    if isinstance(rows, GroupedWeight):
        return rows.dequantize(dtype)
    return rows.to(dtype)


@register_linear_method("float")
class FloatMethod(LinearMethod):
    """The weight as it is, `[N, K]` in the layer's dtype."""

    def __init__(self, *, device: torch.device, native: ctypes.CDLL | None = None) -> None:
        self.device = device

    def create(self, layer: QuantLinear) -> None:
        layer.register_buffer("weight", torch.empty(layer.out_features, layer.in_features,
                                                    dtype=layer.dtype), persistent=False)

    def load(self, layer: QuantLinear, start: int, weight: WeightRows) -> None:
        rows = float_rows(weight, layer.dtype)
        layer.weight[start:start + rows.shape[0]].copy_(rows)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def dequantize(self, layer: QuantLinear) -> torch.Tensor:
        return layer.weight.float()

    def embed(self, layer: QuantLinear, ids: torch.Tensor) -> torch.Tensor:
        return layer.weight[ids]


@register_linear_method("packed")
class PackedMethod(FloatMethod):
    """float32 or bfloat16 on the CPU: loaded as "float", then packed by `finish` (the float
    weight is dropped) into native panels where that kernel is preferred (or
    `native_panels=True` and it is built: float32 `[ceil(N/16), K, 16]`, bfloat16 pair
    panels `[ceil(N/32), ceil(K/2), 32, 2]`), else oneDNN's layout. `embeds_cheaply`: rows
    can be read back from the layout (native panels), so a tied embedding can share the
    packed LM head instead of a second copy (`tied_head_method`)."""

    def __init__(self, *, device: torch.device, native: ctypes.CDLL | None = None,
                 native_panels: bool | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(device=device)
        self.native = native
        self.dtype = dtype
        if native_panels is None:
            native_panels = native_preferred(native, dtype)
        elif native_panels and not native_simd(native, dtype):
            raise ValueError(f"native_panels=True needs the native {dtype} linear kernel "
                             "(float32: AVX2 + FMA; bfloat16: AVX512-BF16)")
        self.bf16 = dtype == torch.bfloat16
        self.kernel = None
        if native_panels:
            assert native is not None
            self.kernel = native.tandem_linear_bf16 if self.bf16 else \
                native.tandem_linear_packed_f32
        self.embeds_cheaply = self.kernel is not None

    def tied_head_method(self) -> PackedMethod | None:
        """The method for an LM head tied to the token embedding: one whose layout serves
        embedding rows (this one, or native panels where oneDNN was chosen), else None
        (the head stays a plain linear over the embedding's weight), so the vocabulary
        matrix is never stored twice. SmolLM2's 49152x576 head on a 2-core AVX-512 EPYC
        (loaded, best of 9): panels vs oneDNN 1.1-1.8x as fast at 1 row, 0.8-0.9x at 16,
        0.9-1.0x at 64; the plain `F.linear` 1.3-3.5x slower than panels everywhere."""
        if self.embeds_cheaply:
            return self
        if native_simd(self.native, self.dtype):
            return PackedMethod(device=self.device, native=self.native, native_panels=True,
                                dtype=self.dtype)
        return None

    def finish(self, layer: QuantLinear) -> None:
        weight = layer.weight.contiguous()
        del layer.weight  # the buffer goes; only the packed copy stays
        if self.kernel is not None:
            packed = pack_bf16_panels(weight) if self.bf16 else pack_panels(weight)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
        layer.register_buffer("packed", packed, persistent=False)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.kernel is None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [],
                                                      "")
        rows = x.shape[0]
        y = torch.empty(rows, layer.out_features, dtype=x.dtype)
        if rows:
            bias = None if layer.bias is None else layer.bias.data_ptr()
            n, k, threads = layer.out_features, layer.in_features, torch.get_num_threads()
            if self.bf16:
                self.kernel(x.data_ptr(), layer.packed.data_ptr(), bias, y.data_ptr(), rows,
                            n, k, k, threads)
            else:
                self.kernel(x.data_ptr(), layer.packed.data_ptr(), bias, y.data_ptr(), rows,
                            n, k, threads)
        return y

    def dequantize(self, layer: QuantLinear) -> torch.Tensor:
        if hasattr(layer, "weight"):
            return layer.weight.float()
        n, k = layer.out_features, layer.in_features
        if self.kernel is not None and self.bf16:
            return bf16_panel_rows(layer.packed, torch.arange(n), k).float()
        if self.kernel is not None:  # [P, K, 16] -> [P*16, K]
            return layer.packed.transpose(1, 2).reshape(-1, k)[:n].float()
        eye = torch.eye(k, dtype=self.dtype)  # oneDNN's layout is opaque: W.T = I @ W.T
        return torch.ops.mkldnn._linear_pointwise(eye, layer.packed, None, "none", [],
                                                  "").T.float().contiguous()

    def embed(self, layer: QuantLinear, ids: torch.Tensor) -> torch.Tensor:
        if hasattr(layer, "weight"):
            return layer.weight[ids]
        if self.kernel is not None and self.bf16:
            return bf16_panel_rows(layer.packed, ids, layer.in_features)
        if self.kernel is not None:  # row n of W is column n % 16 of panel n // 16
            return layer.packed[ids // 16, :, ids % 16]
        return self.dequantize(layer)[ids].to(layer.dtype)
