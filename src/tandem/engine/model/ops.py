"""Fused element-wise ops of the Llama block: Triton or native CPU kernels where they apply,
else torch.

Each op has one torch reference implementation (HF's math); for contiguous float32 or
bfloat16 CPU tensors, a native kernel from `tandem.engine.csrc/elementwise_cpu.c` does the
same in one pass (`*_f32` / `*_bf16`: bfloat16 computes in float32 and rounds each stored
value once, where torch's bfloat16 chain rounds after most ops), and `Ops(triton=True)`
(the Triton attention backend's engines) sends add + RMSNorm, SwiGLU and RoPE to
`tandem.engine.kernels.triton_ops` instead; the choice is made once per model.
`Ops(native=False)` forces the torch path (tests compare them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.errors import ConfigError
from tandem.engine.kernels import rows_strided_only, triton_unavailable_reason
from tandem.engine.native import load_native


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-exact RMSNorm: normalise in float32, scale in x's dtype."""
    r = x.float()
    r = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return weight * r.to(x.dtype)


# tensor dtype -> the suffix of its native kernels (other dtypes take torch)
_NATIVE_SUFFIX = {torch.float32: "_f32", torch.bfloat16: "_bf16"}


def _rows_ok(*tensors: torch.Tensor | None) -> bool:
    """The Triton kernels' layout: only rows (dim 0) may be strided."""
    return all(t is None or rows_strided_only(t) for t in tensors)


class Ops:
    """`native=True` uses the kernels when the model runs in float32 or bfloat16 on the CPU
    (decided once here, not per call; each call then takes the kernel of its tensors' dtype);
    callers still need contiguous tensors of one dtype for the native path.
    `triton=True` uses the Triton kernels on `device` (any float dtype) and raises
    `ConfigError` when they cannot run there; tensors strided within rows go to torch."""

    def __init__(self, native: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32, triton: bool = False) -> None:
        device = torch.device("cpu" if device is None else device)
        self.triton = None
        self.lib = None
        if triton:
            reason = triton_unavailable_reason(device)
            if reason is not None:
                raise ConfigError(f"Triton ops on {device}: {reason}")
            from tandem.engine.kernels import triton_ops

            self.triton = triton_ops
        elif native and device.type == "cpu" and dtype in _NATIVE_SUFFIX:
            self.lib = load_native()

    def _kernel(self, name: str, dtype: torch.dtype):
        """The native `tandem_<name>_<f32|bf16>` for tensors of `dtype`, or None (torch)."""
        suffix = _NATIVE_SUFFIX.get(dtype)
        if self.lib is None or suffix is None:
            return None
        return getattr(self.lib, f"tandem_{name}{suffix}")

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (if given); return (rms_norm(residual) * weight, residual).

        x, residual: [T, H]. `residual` is updated in place when it is contiguous (Triton:
        when its rows are).
        """
        if self.triton is not None and _rows_ok(x, residual):
            return self.triton.add_rms_norm(x, residual, weight, eps)
        kernel = self._kernel("add_rms_norm", residual.dtype)
        if kernel is not None and residual.is_contiguous() and (
                x is None or (x.is_contiguous() and x.dtype == residual.dtype)) and (
                weight.dtype == residual.dtype and weight.is_contiguous()):
            out = torch.empty_like(residual)
            t, h = residual.shape
            kernel(out.data_ptr(), residual.data_ptr(), _ptr(x), weight.data_ptr(), t, h, eps,
                   torch.get_num_threads())
            return out, residual
        if x is not None:
            residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        if self.triton is not None and _rows_ok(gate_up):
            return self.triton.silu_mul(gate_up)
        t, two_i = gate_up.shape
        kernel = self._kernel("silu_mul", gate_up.dtype)
        if kernel is not None and gate_up.is_contiguous():
            out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
            kernel(out.data_ptr(), gate_up.data_ptr(), t, two_i // 2, torch.get_num_threads())
            return out
        gate, up = gate_up.split(two_i // 2, dim=-1)
        return F.silu(gate) * up

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in place on x [T, heads, D] (rows may be strided; heads and D
        contiguous) with tables cos/sin [max_pos, D] at `positions` [T] int64. Returns x.
        The native kernels (x float32 or bfloat16) take float32 tables only."""
        if self.triton is not None and _rows_ok(x) and cos.stride(-1) == sin.stride(-1) == 1:
            return self.triton.rope_(x, positions, cos, sin)
        t, heads, d = x.shape
        kernel = self._kernel("rope", x.dtype)
        if (kernel is not None and x.stride(2) == 1 and x.stride(1) == d
                and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and positions.dtype == torch.int64
                and positions.is_contiguous()):
            kernel(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads,
                   d, x.stride(0), torch.get_num_threads())
            return x
        c = cos[positions].to(x.dtype)[:, None, :]
        s = sin[positions].to(x.dtype)[:, None, :]
        half = d // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)
        return x
