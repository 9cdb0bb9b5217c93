"""Which implementation runs an op (Triton kernel or torch reference), and what the GPU can do.

:func:`use_triton` picks for the quantization ops, :func:`step_kernel_runs` for the ops
that run every decode step; :func:`hw_e4m3` probes for a hardware E4M3 conversion.
:func:`quantize_two_level` and :func:`dequantize_block_scaled` are the checks and
dispatch the two-level formats share.
"""

from __future__ import annotations

import os

import torch

from .checks import (
    check_flag_tensor,
    check_head_scale,
    check_input,
    check_scale_shape,
    check_shape,
    new_flags,
    raise_on_flags,
)
from .head_scale import head_scale, head_scale_triton
from .triton_shim import HAS_TRITON, interpreted


BACKENDS = ("triton", "torch")


def use_triton(x: torch.Tensor, kernel, backend: str | None) -> bool:
    """Pick the implementation: Triton for CUDA tensors or an interpreted kernel, else torch.

    ``TRITON_INTERPRET=1`` is read by ``triton.jit`` when a module is imported, so the
    kernel object itself says whether it can run on CPU tensors.
    """
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; accepted: None (auto), 'triton', 'torch'")
    if backend == "torch":
        return False
    runnable = HAS_TRITON and (x.is_cuda or interpreted(kernel))
    if backend == "triton" and not runnable:
        why = "Triton is not installed" if not HAS_TRITON else "x is not on CUDA and kernels are not interpreted"
        raise RuntimeError(
            f"backend='triton' cannot run: {why} (set TRITON_INTERPRET=1 before importing kvcompose to run on CPU)"
        )
    return runnable


def step_kernel_runs(x: torch.Tensor, kernel, backend: str | None, fits: bool = True) -> bool:
    """Dispatch of the ops that run every decode step (paged attention, in-place eviction):
    ``backend=None`` picks the kernel on CUDA only (``fits``: the kernel takes these shapes),
    since a model's every step through the CPU interpreter would be too slow; ``"triton"``
    forces it (CUDA, or the interpreter under ``TRITON_INTERPRET=1``), ``"torch"`` the reference."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; accepted: None (auto), 'triton', 'torch'")
    if backend == "triton" and not (HAS_TRITON and (x.is_cuda or interpreted(kernel))):
        raise RuntimeError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (set before importing kvcompose)")
    if backend is None:
        return HAS_TRITON and x.is_cuda and fits
    return backend == "triton"


#: Use the GPU's own E4M3 conversion where it has one (see :func:`e4m3_encode_hw_tl`).
HW_E4M3 = os.environ.get("KVCOMPOSE_HW_E4M3", "1") != "0"


def hw_e4m3(x: torch.Tensor, kernel) -> bool:
    """Whether a kernel launched on ``x`` may convert to E4M3 in hardware (sm_89+, compiled, :data:`HW_E4M3`)."""
    if not HW_E4M3 or not x.is_cuda or interpreted(kernel) or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def quantize_two_level(x, scale, backend, flags, *, fmt: str, divisor: float, multiple: int, kernel, reference,
                       launch):
    """Dispatch shared by the formats with an fp32 per-head scale (fp8, nvfp4, ternary).

    Returns ``(codes, scale)`` (codes: whatever ``reference(x, scale)`` / ``launch(x, scale,
    flags)`` return). Torch path: every check first. Kernel path: one pass over ``x``
    (two when the scale comes from ``x``), errors found by the kernel; with ``flags=None``
    they are raised at once (one host synchronization), with a caller-owned ``flags``
    tensor they are only recorded there (no synchronization, CUDA-graph safe) and
    :func:`check_flags` raises them later.
    """
    check_shape(x, fmt, multiple)
    if not use_triton(x, kernel, backend):
        amax = check_input(x, fmt, multiple)
        scale = head_scale(amax, divisor) if scale is None else check_head_scale(scale, x, fmt)
        return reference(x, scale), scale
    x = x.detach().contiguous()
    if flags is not None:
        check_flag_tensor(flags, x)
    if scale is None:
        scale, own = head_scale_triton(x, divisor)
    else:
        scale = check_head_scale(scale, x, fmt, values=x.numel() == 0)
        own = new_flags(x.device) if flags is None else None
    codes = launch(x, scale, own if flags is None else flags)
    if flags is None:
        raise_on_flags(own, x, fmt, scale)
    return codes, scale


def dequantize_block_scaled(codes, block_scales, s2, dtype, backend, *, fmt: str, codes_per_byte: int, kernel,
                            reference, launch) -> torch.Tensor:
    """Checks and dispatch shared by the decoders of NVFP4 and ternary (codes ``[N, H, D / codes_per_byte]``,
    E4M3 block scales ``[N, H, D/16]``, ``s2`` ``[H]`` or ``[N, H]``)."""
    per_block = 16 // codes_per_byte  # code bytes per 16-value block
    if codes.dtype != torch.uint8 or codes.dim() != 3 or codes.shape[2] % per_block:
        raise ValueError(f"{fmt}: codes must be uint8 [N, H, D/{codes_per_byte}] with D % 16 == 0, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    n, h = codes.shape[:2]
    expected = (n, h, codes.shape[2] // per_block)
    if block_scales.shape != expected or block_scales.dtype != torch.uint8:
        raise ValueError(f"{fmt}: block_scales must be uint8 {expected}, got {tuple(block_scales.shape)}")
    check_scale_shape(s2, n, h, fmt, "s2")
    s2 = s2.to(torch.float32).contiguous()
    if use_triton(codes, kernel, backend):
        out = launch(codes, block_scales, s2, dtype)
    else:
        out = reference(codes, block_scales, s2)
    return out.to(dtype)
