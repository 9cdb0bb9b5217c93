"""FP8 E4M3 quantization with one FP32 scale per KV head.

Format, for ``x`` of shape ``[N, H, D]`` (tokens, KV heads, head dim):

- ``scale[h] = amax(|x[:, h, :]|) / 448`` in fp32 (1 if that is 0), unless the
  caller passes a fixed per-(layer, head) scale; values beyond ``448 * scale``
  then saturate to +-448.
- ``code = E4M3(x * (1 / scale))``: the reciprocal once per head (IEEE division),
  a multiply per value, then round to nearest E4M3, ties to even (the same result as
  ``.to(torch.float8_e4m3fn)`` on the clamped product).
  Codes are the E4M3 bit patterns as uint8 (``codes.view(torch.float8_e4m3fn)``
  gives the float8 tensor).
- ``x_hat = E4M3_value(code) * scale`` (fp32, then cast to the requested dtype).

8 bits per value; the per-head scale is shared by every token quantized with it
and not counted. Each token's codes depend only on that token and the head scale.
"""

from __future__ import annotations

import torch

from .checks import amax_tl, bad_scale_tl, check_scale_shape, new_flags, nonfinite_tl, set_flag_tl
from .dispatch import hw_e4m3, quantize_two_level, use_triton
from .layout import out_buffer, per_token, scale_index_tl, store_out_tl, token_stride
from .numerics import (
    E4M3_MAX,
    e4m3_decode,
    e4m3_decode_tl,
    e4m3_encode,
    e4m3_encode_hw_tl,
    e4m3_encode_tl,
    recip_tl,
    reciprocal,
)
from .triton_shim import LAUNCH_OPTS, cdiv, jit, next_pow2, tl

FORMAT = "fp8"
QUANT_TILE = 4096  # values per quantize program: ROWS = QUANT_TILE / next_pow2(D) (token, head) rows
QUANT_WARPS = 8
DEQUANT_TILE = 4096  # values per dequantize program
DEQUANT_WARPS = 8


def _rows(d: int, tile: int) -> tuple[int, int]:
    bd = next_pow2(d)
    return max(1, tile // bd), bd


@jit
def _fp8_quantize_kernel(
    x_ptr, scale_ptr, code_ptr, flag_ptr, n_rows, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    ROWS: tl.constexpr, ST: tl.constexpr, HW: tl.constexpr,
):
    # One program per ROWS (token, head) rows of D values; row r belongs to head r % H.
    # 64-bit offsets only for the program's start, 32-bit ones inside the tile.
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    r = tl.arange(0, ROWS)
    ok = r < n_rows - row0
    d = tl.arange(0, BD)[None, :]
    mask = ok[:, None] & (d < D)
    offs = r[:, None] * D + d
    x = tl.load(x_ptr + row0 * D + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + scale_index_tl(row0, r, 1, H, ST), mask=ok, other=1.0)
    y = x * recip_tl(scale)[:, None]
    if HW:
        code = e4m3_encode_hw_tl(y)
    else:
        code = e4m3_encode_tl(y)
    tl.store(code_ptr + row0 * D + offs, code.to(tl.uint8), mask=mask)
    set_flag_tl(flag_ptr, nonfinite_tl(amax_tl(x, 1, False)) | bad_scale_tl(scale))


@jit
def _fp8_dequantize_kernel(
    code_ptr, scale_ptr, out_ptr, n_rows, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
    ST: tl.constexpr, OUT: tl.constexpr, HW: tl.constexpr,
):
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    r = tl.arange(0, ROWS)
    ok = r < n_rows - row0
    d = tl.arange(0, BD)[None, :]
    mask = ok[:, None] & (d < D)
    offs = r[:, None] * D + d
    code = tl.load(code_ptr + row0 * D + offs, mask=mask, other=0)
    scale = tl.load(scale_ptr + scale_index_tl(row0, r, 1, H, ST), mask=ok, other=1.0)
    if HW:  # exact either way: every E4M3 value is an fp32 value
        value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        value = e4m3_decode_tl(code)
    store_out_tl(out_ptr + row0 * D + offs, value * scale[:, None], mask, OUT)


def fp8_quantize_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference: E4M3 codes (uint8 ``[N, H, D]``) of ``x`` under per-head ``scale`` ``[H]``."""
    return e4m3_encode(x.to(torch.float32) * reciprocal(per_token(scale)))


def fp8_quantize_triton(x: torch.Tensor, scale: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel version of :func:`fp8_quantize_torch` (``flags``: the error flag the kernel sets, see :mod:`~kvcompose.ops.checks`)."""
    x = x.contiguous()
    n, h, d = x.shape
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    flags = new_flags(x.device) if flags is None else flags
    if x.numel():
        rows, bd = _rows(d, QUANT_TILE)
        grid = (cdiv(n * h, rows),)
        _fp8_quantize_kernel[grid](
            x, scale, codes, flags, n * h, H=h, D=d, BD=bd, ROWS=rows, ST=token_stride(scale),
            HW=hw_e4m3(x, _fp8_quantize_kernel),
            num_warps=QUANT_WARPS, **LAUNCH_OPTS,
        )
    return codes


def fp8_dequantize_torch(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference: fp32 ``[N, H, D]`` values of E4M3 ``codes`` under per-head ``scale``."""
    return e4m3_decode(codes) * per_token(scale)


def fp8_dequantize_triton(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Kernel version of :func:`fp8_dequantize_torch`, written directly as ``dtype`` (rounded as ``.to(dtype)``)."""
    codes = codes.contiguous()
    n, h, d = codes.shape
    out, dst, kind = out_buffer(codes.shape, dtype, codes.device)
    if codes.numel():
        rows, bd = _rows(d, DEQUANT_TILE)
        grid = (cdiv(n * h, rows),)
        _fp8_dequantize_kernel[grid](
            codes, scale, dst, n * h, H=h, D=d, BD=bd, ROWS=rows, ST=token_stride(scale), OUT=kind,
            HW=hw_e4m3(codes, _fp8_dequantize_kernel),
            num_warps=DEQUANT_WARPS, **LAUNCH_OPTS,
        )
    return out


def fp8_quantize(
    x: torch.Tensor, scale: torch.Tensor | None = None, backend: str | None = None, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[N, H, D]`` to E4M3; returns ``(codes uint8 [N, H, D], scale fp32 [H])``.

    ``scale`` fixes the per-head scale (e.g. one per layer and head for a whole
    cache); by default it is computed from ``x``. ``backend``: None (auto), "triton", "torch".
    NaN/inf input or a scale that is not finite and > 0 raise a ValueError, at once, or
    with ``flags`` (kernel path) later through :func:`~kvcompose.ops.checks.check_flags`.
    """
    return quantize_two_level(x, scale, backend, flags, fmt=FORMAT, divisor=E4M3_MAX, multiple=1,
                              kernel=_fp8_quantize_kernel, reference=fp8_quantize_torch, launch=fp8_quantize_triton)


def fp8_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, backend: str | None = None
) -> torch.Tensor:
    """Values of E4M3 ``codes`` ``[N, H, D]`` times per-head ``scale`` ``[H]``, as ``dtype``."""
    _check_codes(codes, scale)
    if use_triton(codes, _fp8_dequantize_kernel, backend):
        out = fp8_dequantize_triton(codes, scale.to(torch.float32).contiguous(), dtype)
    else:
        out = fp8_dequantize_torch(codes, scale.to(torch.float32))
    return out.to(dtype)


def _check_codes(codes: torch.Tensor, scale: torch.Tensor) -> None:
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"{FORMAT}: codes must be uint8 [N, H, D], got {codes.dtype} {tuple(codes.shape)}")
    check_scale_shape(scale, codes.shape[0], codes.shape[1], FORMAT, "scale")
