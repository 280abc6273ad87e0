"""Triton kernels for the engine on GPUs (and on the CPU under Triton's interpreter).

The kernel modules (`triton_ops`, `triton_attention`) import triton at top level and build
their `@triton.jit` functions then, which is when Triton reads `TRITON_INTERPRET`: import
them only after `triton_unavailable_reason(device)` returns None, so torch-only installs
never import triton and a CPU process sets the interpreter before the kernels exist.
"""

from __future__ import annotations

import os

import torch

# Triton's own support floor for NVIDIA GPUs it generates code for (Turing and newer).
MIN_CUDA_CAPABILITY = (7, 5)


def rows_strided_only(t: torch.Tensor) -> bool:
    """The Triton elementwise kernels' layout: only rows (dim 0) may be strided."""
    return t.stride(-1) == 1 and (t.dim() < 3 or t.shape[1] < 2 or t.stride(1) == t.shape[2])


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`)."""
    try:
        from triton import knobs
    except ImportError:  # triton < 3.4 had no knobs; it read the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return bool(knobs.runtime.interpret)


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """None when the Triton kernels can run on `device`, else a one-line reason.

    They run on a CUDA (or ROCm) GPU Triton supports, and on the CPU only under Triton's
    interpreter (`TRITON_INTERPRET=1`, set before the kernel modules are imported).
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    device = torch.device(device)
    if device.type == "cpu":
        if _interpreting():
            return None
        return ("Triton kernels run on the CPU only under Triton's interpreter "
                "(set TRITON_INTERPRET=1 before the engine starts)")
    if device.type != "cuda":
        return f"Triton kernels do not run on {device.type} devices"
    if not torch.cuda.is_available():
        why = "a CPU-only torch build" if torch.version.cuda is None and torch.version.hip \
            is None else "no CUDA device visible"
        return f"CUDA is not available ({why})"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        return f"no CUDA device {index} (this process sees {torch.cuda.device_count()})"
    if torch.version.hip is None:
        cap = torch.cuda.get_device_capability(index)
        if cap < MIN_CUDA_CAPABILITY:
            need = ".".join(map(str, MIN_CUDA_CAPABILITY))
            return (f"Triton needs CUDA compute capability {need} or newer "
                    f"(cuda:{index} has {cap[0]}.{cap[1]})")
    return None
