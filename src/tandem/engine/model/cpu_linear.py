"""CPU fast path for float32 linear layers: weights packed once at load time.

* Native (AVX2 + FMA, `engine/csrc/linear_cpu.c`): W is repacked into 16-column panels
  `[ceil(N/16), K, 16]` and multiplied by a register-tiled kernel that reads each weight
  byte once per block of activation rows. One layout for every batch size; on AVX2 it is
  faster than oneDNN at decode batch sizes (`bench/linear_micro.py`; the measured ratios
  are in docs/cpu.md).
* Otherwise (no compiler, no AVX2), and on CPUs with AVX-512: oneDNN's blocked layout
  (`torch.nn.functional.linear` would repack the weight on every call). oneDNN's AVX-512
  kernels beat the AVX2 panels there from a few rows up (docs/cpu.md).
  `TANDEM_LINEAR_KERNEL=native|onednn` overrides the choice. It is made from the CPU alone
  (`cpu_isa`, which `TANDEM_CPU_ISA` caps), so every worker on one machine computes with
  the same kernel (same rounding).
* bfloat16, where the CPU multiplies bfloat16 in hardware (AVX512-BF16, or AMX): native
  pair panels `[ceil(N/32), ceil(K/2), 32, 2]` (`engine/csrc/linear_bf16_cpu.c`: VDPBF16PS
  over 8x32 register tiles) at the `avx512_bf16` level, where they match oneDNN from 24
  rows up and beat it below (up to 2x at decode sizes); oneDNN's blocked layout on AMX
  machines, whose tile units oneDNN drives. bfloat16 in and out, float32 accumulation;
  `TANDEM_LINEAR_KERNEL` overrides the choice here too. Elsewhere `F.linear`.
* A LM head tied to the token embedding always gets the native panels of its dtype where
  they are built (the embedding reads its rows from them; oneDNN's layout is opaque), else
  stays a plain linear over the embedding's weight: the vocabulary matrix is stored once.

The "packed" linear method (`quant/float_methods.py`) applies this after weight loading,
so the model file stays plain; results differ from MKL's only in float rounding order.
"""

from __future__ import annotations

import ctypes
import os

import torch

from tandem.engine.cpu_isa import cpu_isa

PANEL = 16  # output columns per packed panel (linear_cpu.c's NR)
BF16_PANEL = 32  # output columns per bfloat16 pair panel (linear_bf16_cpu.c's NR)
ONEDNN_BATCH_HINT = 64  # rows oneDNN tunes its packed layout for


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's packed linear serves `dtype` here: float32 anywhere it is built; bfloat16
    where the CPU multiplies bfloat16 in hardware (`cpu_isa` level `avx512_bf16` or above:
    elsewhere oneDNN would emulate it, slower than `F.linear`)."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return (dtype == torch.bfloat16 and cpu_isa().at_least("avx512_bf16")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def native_simd(native: ctypes.CDLL | None, dtype: torch.dtype = torch.float32) -> bool:
    """The native library is built with its fast linear kernel for `dtype`: AVX2 + FMA for
    float32, AVX512-BF16 for bfloat16."""
    if native is None:
        return False
    if dtype == torch.bfloat16:
        return native.tandem_linear_bf16_simd() >= 2
    return dtype == torch.float32 and bool(native.tandem_linear_simd())


def native_preferred(native: ctypes.CDLL | None, dtype: torch.dtype = torch.float32) -> bool:
    """Use the native panels for `dtype`: they are built, and (unless `TANDEM_LINEAR_KERNEL`
    says otherwise) oneDNN is unavailable or slower: float32 below AVX-512, bfloat16 below
    AMX."""
    if not native_simd(native, dtype):
        return False
    if not onednn_available(dtype, torch.device("cpu")):
        return True
    choice = os.environ.get("TANDEM_LINEAR_KERNEL", "").strip().lower()
    if choice in ("native", "onednn"):
        return choice == "native"
    if choice:
        raise ValueError(f"TANDEM_LINEAR_KERNEL must be 'native' or 'onednn', got {choice!r}")
    return not cpu_isa().at_least("amx" if dtype == torch.bfloat16 else "avx512")


def packing_available(dtype: torch.dtype, device: torch.device,
                      native: ctypes.CDLL | None) -> bool:
    """Whether `pack_linears` applies: float32 on the CPU with the native kernel (AVX2) or
    oneDNN, or bfloat16 where oneDNN multiplies it in hardware."""
    if device.type != "cpu":
        return False
    return dtype in (torch.float32, torch.bfloat16) and (
        native_simd(native, dtype) or onednn_available(dtype, device))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16], zero-padded past N, contiguous."""
    n, k = weight.shape
    padded = torch.zeros((n + PANEL - 1) // PANEL * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 -> pair panels [ceil(N/32), ceil(K/2), 32, 2], zero-padded past N
    and K, contiguous: element [p, q, j, r] is W[32 p + j, 2 q + r]."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // BF16_PANEL) * BF16_PANEL, k + (k & 1), dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(-1, BF16_PANEL, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_panel_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the weight packed by `pack_bf16_panels` -> [len(ids), k]."""
    rows = packed[ids // BF16_PANEL, :, ids % BF16_PANEL]  # [T, Kh, 2]
    return rows.reshape(rows.shape[0], -1)[:, :k]
