"""NVFP4: E2M1 values in blocks of 16 along the head dim, E4M3 block scales, FP32 head scale.

Format, for ``x`` of shape ``[N, H, D]`` with ``D % 16 == 0`` (all arithmetic fp32):

- Second-level scale per KV head: ``s2[h] = amax(|x[:, h, :]|) / 2688`` (2688 =
  6 * 448, so the largest block scale lands at E4M3's maximum); 1 if that is 0.
  The caller may instead pass a fixed per-(layer, head) ``s2``.
- Block scale per 16 consecutive channels of one token and head:
  ``bs = E4M3(block_amax / (s2 * 6))``, saturating at 448. An all-zero block gets
  ``bs = 1``; a non-zero block whose scale rounds to 0 gets 2^-9.
- Code per value: ``y = x * (1 / (bs * s2))`` (the reciprocal once per block, IEEE
  division; a multiply per value) rounded to the nearest of
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} (with sign), ties to the even code (the one whose
  mantissa bit is 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
  3.5 -> 4, 5 -> 4), saturating at 6. A nibble is ``sign << 3 | index`` with the
  sign of ``y`` (a small negative value codes as -0, as hardware FP4 conversions do).
- Storage: two nibbles per byte, the even element in the low nibble
  (``codes`` uint8 ``[N, H, D/2]``); block scales as E4M3 bit patterns
  (``block_scales`` uint8 ``[N, H, D/16]``); ``s2`` fp32 ``[H]``.
- Decoding: ``x_hat = E2M1_value(code) * (bs * s2)``.

4 + 8/16 = 4.5 bits per value; ``s2`` is shared by every token quantized with it
and not counted. A token's codes and block scales depend only on that token and ``s2``.
"""

from __future__ import annotations

import torch

from .checks import amax_tl, bad_scale_tl, new_flags, nonfinite_tl, set_flag_tl
from .dispatch import dequantize_block_scaled, quantize_two_level
from .layout import (
    block_dequant_tile_tl,
    out_buffer,
    pack_codes,
    per_token,
    scale_index_tl,
    store_out_tl,
    token_stride,
    unpack_codes,
)
from .numerics import (
    block_scale_code_tl,
    block_scale_e4m3,
    e2m1_decode,
    e2m1_decode_tl,
    e2m1_encode,
    e2m1_encode_tl,
    e4m3_decode,
    e4m3_encode,
    max_nan_tl,
    recip_tl,
    reciprocal,
)
from .triton_shim import LAUNCH_OPTS, cdiv, jit, tl

FORMAT = "nvfp4"
BLOCK = 16
S2_DIVISOR = 6.0 * 448.0
TILE_BLOCKS = 64  # 16-value blocks per quantize program (1024 values): one per thread
QUANT_WARPS = 2
DEQUANT_TILE_BLOCKS = 1024  # blocks per dequantize program (16384 values)
DEQUANT_WARPS = 4


@jit
def _load_even_odd(x_ptr, offs, ok, WORDS: tl.constexpr):
    """Elements ``2i`` and ``2i + 1`` of each block, fp32 ``[B, 8]`` each, from word offsets ``offs``.

    With ``WORDS`` the input is bf16 viewed as int32 pairs (little endian: the even element
    in the low half), and a bf16 is the high half of its fp32 pattern, so each element
    costs one shift or mask; otherwise the 16 values are loaded and split in registers.
    """
    if WORDS:
        w = tl.load(x_ptr + offs, mask=ok, other=0)
        return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
    pairs = offs[:, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    return tl.split(tl.load(x_ptr + pairs, mask=ok[:, :, None], other=0.0).to(tl.float32))


@jit
def _nvfp4_quantize_kernel(
    x_ptr, s2_ptr, code_ptr, bs_ptr, flag_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
    ST: tl.constexpr, WORDS: tl.constexpr,
):
    # One program per tile of BLOCKS 16-value blocks, numbered flat over [N, H, D/16]; 64-bit
    # offsets for the tile start only. One thread holds a whole block as its even and odd
    # elements ([BLOCKS, 8] each), which are exactly the low and high nibbles of its 8 code
    # bytes, and per-block values ([BLOCKS, 1]) need no exchange between threads.
    blk0 = tl.program_id(0).to(tl.int64) * BLOCKS
    b = tl.arange(0, BLOCKS)[:, None]
    ok = b < n_blocks - blk0
    pair = blk0 * 8 + b * 8 + tl.arange(0, 8)[None, :]  # pair i of a block: elements 2i, 2i + 1; byte i of its codes
    even, odd = _load_even_odd(x_ptr, pair, ok, WORDS)
    s2 = tl.load(s2_ptr + scale_index_tl(blk0, b, NB, H, ST), mask=ok, other=1.0)

    block_amax = max_nan_tl(amax_tl(even, 1, True), amax_tl(odd, 1, True))
    bs_code, bs = block_scale_code_tl(tl.div_rn(block_amax, s2 * 6.0), block_amax)
    inv = recip_tl(bs * s2)

    byte = e2m1_encode_tl(even * inv) | (e2m1_encode_tl(odd * inv) << 4)
    tl.store(code_ptr + pair, byte.to(tl.uint8), mask=ok)
    tl.store(bs_ptr + blk0 + b, bs_code.to(tl.uint8), mask=ok)
    set_flag_tl(flag_ptr, nonfinite_tl(block_amax) | bad_scale_tl(s2))


@jit
def _nvfp4_dequantize_kernel(
    code_ptr, bs_ptr, s2_ptr, out_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
    ST: tl.constexpr, OUT: tl.constexpr,
):
    blk0, b, ok, scale = block_dequant_tile_tl(bs_ptr, s2_ptr, n_blocks, H, NB, BLOCKS, ST)
    src = b[:, None] * 8 + tl.arange(0, 8)[None, :]
    packed = tl.load(code_ptr + blk0 * 8 + src, mask=ok[:, None], other=0).to(tl.int32)
    # byte i holds elements 2i (low nibble) and 2i + 1: shift each byte twice, then flatten
    nibbles = (packed[:, :, None] >> (4 * tl.arange(0, 2))[None, None, :]) & 0xF
    values = e2m1_decode_tl(tl.reshape(nibbles, [BLOCKS, 16]))
    offs = b[:, None] * 16 + tl.arange(0, 16)[None, :]
    store_out_tl(out_ptr + blk0 * 16 + offs, values * scale[:, None], ok[:, None], OUT)


def nvfp4_quantize_torch(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``(codes uint8 [N, H, D/2], block_scales uint8 [N, H, D/16])`` of ``x`` under ``s2`` ``[H]``."""
    n, h, d = x.shape
    xb = x.to(torch.float32).reshape(n, h, d // BLOCK, BLOCK)
    s2 = per_token(s2)
    block_amax = xb.abs().amax(dim=-1)
    bs = block_scale_e4m3(block_amax / (s2 * 6.0), block_amax)
    codes = e2m1_encode(xb * reciprocal(bs * s2)[..., None])
    return pack_codes(codes.reshape(n, h, d), 4), e4m3_encode(bs)


def nvfp4_quantize_triton(
    x: torch.Tensor, s2: torch.Tensor, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`nvfp4_quantize_torch` (``flags``: the error flag the kernel sets)."""
    x = x.contiguous()
    n, h, d = x.shape
    nb = d // BLOCK
    codes = torch.empty((n, h, d // 2), dtype=torch.uint8, device=x.device)
    bs = torch.empty((n, h, nb), dtype=torch.uint8, device=x.device)
    flags = new_flags(x.device) if flags is None else flags
    if x.numel():
        n_blocks = n * h * nb
        grid = (cdiv(n_blocks, TILE_BLOCKS),)
        words = x.dtype == torch.bfloat16
        _nvfp4_quantize_kernel[grid](
            x.view(torch.int32) if words else x, s2, codes, bs, flags, n_blocks, H=h, NB=nb, BLOCKS=TILE_BLOCKS,
            ST=token_stride(s2), WORDS=words, num_warps=QUANT_WARPS, **LAUNCH_OPTS,
        )
    return codes, bs


def nvfp4_dequantize_torch(codes: torch.Tensor, block_scales: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Reference: fp32 ``[N, H, D]`` values of packed NVFP4 data."""
    n, h, half = codes.shape
    values = e2m1_decode(unpack_codes(codes, 4)).reshape(n, h, half // 8, BLOCK)
    scale = e4m3_decode(block_scales) * per_token(s2)
    return (values * scale[..., None]).reshape(n, h, half * 2)


def nvfp4_dequantize_triton(
    codes: torch.Tensor, block_scales: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Kernel version of :func:`nvfp4_dequantize_torch`, written directly as ``dtype`` (rounded as ``.to(dtype)``)."""
    codes, block_scales = codes.contiguous(), block_scales.contiguous()
    n, h, half = codes.shape
    nb = half // 8
    out, dst, kind = out_buffer((n, h, half * 2), dtype, codes.device)
    if out.numel():
        n_blocks = n * h * nb
        grid = (cdiv(n_blocks, DEQUANT_TILE_BLOCKS),)
        _nvfp4_dequantize_kernel[grid](
            codes, block_scales, s2, dst, n_blocks, H=h, NB=nb, BLOCKS=DEQUANT_TILE_BLOCKS, ST=token_stride(s2),
            OUT=kind, num_warps=DEQUANT_WARPS, **LAUNCH_OPTS,
        )
    return out


def nvfp4_quantize(
    x: torch.Tensor, s2: torch.Tensor | None = None, backend: str | None = None, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[N, H, D]`` to NVFP4; returns ``(codes, block_scales, s2)``.

    ``s2`` fixes the per-head second-level scale; by default it is computed from ``x``.
    ``backend``: None (auto), "triton", "torch". NaN/inf input or an ``s2`` that is
    not finite and > 0 raise a ValueError, at once, or with ``flags`` (kernel path)
    later through :func:`~kvcompose.ops.checks.check_flags`.
    """
    (codes, bs), s2 = quantize_two_level(x, s2, backend, flags, fmt=FORMAT, divisor=S2_DIVISOR, multiple=BLOCK,
                                         kernel=_nvfp4_quantize_kernel, reference=nvfp4_quantize_torch,
                                         launch=nvfp4_quantize_triton)
    return codes, bs, s2


def nvfp4_dequantize(
    codes: torch.Tensor,
    block_scales: torch.Tensor,
    s2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode packed NVFP4 data to ``[N, H, D]`` values of ``dtype``."""
    return dequantize_block_scaled(codes, block_scales, s2, dtype, backend, fmt=FORMAT, codes_per_byte=2,
                                   kernel=_nvfp4_dequantize_kernel, reference=nvfp4_dequantize_torch,
                                   launch=nvfp4_dequantize_triton)
