"""Fused element-wise ops of the Llama block: native CPU kernels where they apply, else torch.

Each op has one torch reference implementation (HF's math) and, for contiguous float32 CPU
tensors, a native kernel from `tandem.engine.csrc/elementwise_cpu.c` doing the same in one
pass. `Ops(native=False)` forces the torch path (tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.native import load_native


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Ops:
    def __init__(self, native: bool = True) -> None:
        self.lib = load_native() if native else None

    def _native_ok(self, *ts: torch.Tensor) -> bool:
        return self.lib is not None and all(
            t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (if given); return (rms_norm(residual) * weight, residual).

        x, residual: [T, H]. `residual` is updated in place when it is contiguous.
        """
        if self._native_ok(residual, weight) and residual.is_contiguous() and (
                x is None or (x.is_contiguous() and x.dtype == torch.float32)):
            out = torch.empty_like(residual)
            t, h = residual.shape
            self.lib.tandem_add_rms_norm_f32(out.data_ptr(), residual.data_ptr(), _ptr(x),
                                             weight.data_ptr(), t, h, eps,
                                             torch.get_num_threads())
            return out, residual
        if x is not None:
            residual = residual + x
        r = residual.float()
        r = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
        return weight * r.to(residual.dtype), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        t, two_i = gate_up.shape
        if self._native_ok(gate_up) and gate_up.is_contiguous():
            out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
            self.lib.tandem_silu_mul_f32(out.data_ptr(), gate_up.data_ptr(), t, two_i // 2,
                                         torch.get_num_threads())
            return out
        gate, up = gate_up.split(two_i // 2, dim=-1)
        return F.silu(gate) * up

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in place on x [T, heads, D] (rows may be strided; heads and D
        contiguous) with tables cos/sin [max_pos, D] at `positions` [T] int64. Returns x."""
        t, heads, d = x.shape
        if (self._native_ok(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == d
                and cos.is_contiguous() and sin.is_contiguous()
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            self.lib.tandem_rope_f32(x.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                                     sin.data_ptr(), t, heads, d, x.stride(0),
                                     torch.get_num_threads())
            return x
        c = cos[positions].to(x.dtype)[:, None, :]
        s = sin[positions].to(x.dtype)[:, None, :]
        half = d // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)
        return x
