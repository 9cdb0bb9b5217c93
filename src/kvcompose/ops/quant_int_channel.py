"""Asymmetric INT-k with a scale and a minimum per channel over a group of tokens (KIVI's key layout).

``x`` ``[N, H, D]`` is split into groups of ``token_group`` consecutive tokens; each
(group, head, channel) gets one scale and one minimum, ``[ceil(N / token_group), H, D]``
(the last group may be shorter when ``N % token_group != 0``). Not slot-local: a scale
spans several tokens. The arithmetic, code packing and checks are those of
:mod:`kvcompose.ops.quant_int`.

Kernels: one quantize program per (token group, head), viewed as [token, byte, slot];
the extremes reduce over the token axis.
"""

from __future__ import annotations

import torch

from .checks import new_flags, set_flag_tl
from .dispatch import use_triton
from .layout import out_buffer, pack_codes, store_out_tl, unpack_codes
from .numerics import max_keep_nan_tl, max_nan_tl, min_keep_nan_tl, min_nan_tl, recip_tl
from .quant_int import (
    BITS,
    FORMAT,
    check_codes,
    check_params,
    check_params_static,
    int_encode,
    int_encode_tl,
    int_params,
    int_params_tl,
    range_flags_tl,
    run_checked,
    tile_rows,
    unpack_tl,
)
from .triton_shim import LAUNCH_OPTS, cdiv, jit, next_pow2, tl


CHANNEL_QUANT_WARPS = 1  # a program handles one token group x head dim of one head
CHANNEL_QUANT_CHUNK = 16  # ... CHUNK tokens at a time, in two passes
CHANNEL_DEQUANT = (2048, 1)  # values per dequantize program, warps per program


@jit
def _int_channel_quantize_kernel(
    x_ptr, code_ptr, scale_ptr, lo_ptr, flag_ptr, N,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_G: tl.constexpr, BD: tl.constexpr, CHUNK: tl.constexpr,
):
    # One program per (token group, head): extremes over the token axis, then the codes. Two
    # passes over CHUNK tokens at a time (the second reads from cache), so a thread holds a
    # chunk, not the whole group: fewer registers, more warps in flight.
    PER: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PER
    tg = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    t = tl.arange(0, CHUNK)[:, None]
    d = tl.arange(0, BD)[None, :]
    row0 = tg * G * H + head  # (token, head) row of the group's first token; 64-bit for the start only
    lo = tl.full([BD], float("inf"), tl.float32)
    hi = tl.full([BD], float("-inf"), tl.float32)
    for c in tl.static_range(0, BLOCK_G, CHUNK):
        mask = (c + t < G) & (c + t < N - tg * G) & (d < D)
        x = tl.load(x_ptr + row0 * D + ((c + t) * H) * D + d, mask=mask, other=0.0).to(tl.float32)
        lo = min_nan_tl(lo, min_keep_nan_tl(tl.where(mask, x, float("inf")), 0, False))
        hi = max_nan_tl(hi, max_keep_nan_tl(tl.where(mask, x, float("-inf")), 0, False))
    dd = tl.arange(0, BD)
    flags = range_flags_tl(lo, hi, dd < D, HALF)
    scale, lo = int_params_tl(lo, hi, BITS, HALF)
    inv = recip_tl(scale)
    j = tl.arange(0, PER)[None, None, :]
    b = tl.arange(0, BD // PER)[None, :]
    for c in tl.static_range(0, BLOCK_G, CHUNK):
        rows = (c + t < G) & (c + t < N - tg * G)
        x = tl.load(x_ptr + row0 * D + ((c + t) * H) * D + d, mask=rows & (d < D), other=0.0).to(tl.float32)
        q = int_encode_tl(x, inv[None, :], lo[None, :], BITS)
        packed = tl.sum(tl.reshape(q, [CHUNK, BD // PER, PER]) << (BITS * j), axis=2)
        tl.store(code_ptr + row0 * DB + ((c + t) * H) * DB + b, packed.to(tl.uint8), mask=rows & (b < DB))
    soff = (tg * H + head) * D + dd
    tl.store(scale_ptr + soff, scale, mask=dd < D)
    tl.store(lo_ptr + soff, lo, mask=dd < D)
    set_flag_tl(flag_ptr, flags)


@jit
def _int_channel_dequantize_kernel(
    code_ptr, scale_ptr, lo_ptr, out_ptr, N,
    H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    BD: tl.constexpr, OUT: tl.constexpr,
):
    # One program per (BLOCK_T tokens of one token group, head): one row of scales and minima for all of them.
    PER: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PER
    SPLIT: tl.constexpr = (G + BLOCK_T - 1) // BLOCK_T  # programs per token group
    tg = tl.program_id(0).to(tl.int64) // SPLIT
    t0 = tg * G + (tl.program_id(0).to(tl.int64) % SPLIT) * BLOCK_T
    head = tl.program_id(1).to(tl.int64)
    t = tl.arange(0, BLOCK_T)[:, None]
    tok = t0 + t
    rows = (tok < tg * G + G) & (tok < N)
    dd = tl.arange(0, BD)
    soff = (tg * H + head) * D + dd
    scale = tl.load(scale_ptr + soff, mask=dd < D, other=1.0).to(tl.float32)
    lo = tl.load(lo_ptr + soff, mask=dd < D, other=0.0).to(tl.float32)
    b = tl.arange(0, BD // PER)[None, :]
    packed = tl.load(code_ptr + (tok * H + head) * DB + b, mask=rows & (b < DB), other=0).to(tl.int32)
    q = unpack_tl(packed, BLOCK_T, BD // PER, BITS)
    x = q * scale[None, :] + lo[None, :]
    d = dd[None, :]
    store_out_tl(out_ptr + (tok * H + head) * D + d, x, rows & (d < D), OUT)


def int_channel_quantize_torch(x: torch.Tensor, bits: int, token_group: int, scale_dtype: torch.dtype):
    """Reference: ``(codes [N, H, D*k/8], scale [T, H, D], lo [T, H, D])``, T = ceil(N / token_group)."""
    n, h, d = x.shape
    nt = cdiv(n, token_group)
    xf = x.to(torch.float32)
    pad = nt * token_group - n
    fill_hi = torch.full((pad, h, d), float("inf"), device=x.device)
    fill_lo = torch.full((pad, h, d), float("-inf"), device=x.device)
    lo = torch.cat([xf, fill_hi]).reshape(nt, token_group, h, d).amin(dim=1)
    hi = torch.cat([xf, fill_lo]).reshape(nt, token_group, h, d).amax(dim=1)
    scale, lo = int_params(lo, hi, bits, scale_dtype)
    per_token = torch.arange(n, device=x.device) // token_group
    q = int_encode(xf, scale[per_token], lo[per_token], bits)
    return pack_codes(q, bits), scale.to(scale_dtype), lo.to(scale_dtype)


def int_channel_quantize_triton(
    x: torch.Tensor, bits: int, token_group: int, scale_dtype: torch.dtype, flags: torch.Tensor | None = None
):
    """Kernel version of :func:`int_channel_quantize_torch` (``flags``: the error flag the kernel sets)."""
    x = x.contiguous()
    n, h, d = x.shape
    nt = cdiv(n, token_group)
    codes = torch.empty((n, h, d * bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty((nt, h, d), dtype=scale_dtype, device=x.device)
    lo = torch.empty((nt, h, d), dtype=scale_dtype, device=x.device)
    flags = new_flags(x.device) if flags is None else flags
    if x.numel():
        block_g, bd = next_pow2(token_group), next_pow2(d)
        _int_channel_quantize_kernel[(nt, h)](
            x, codes, scale, lo, flags, n, H=h, D=d, G=token_group, BITS=bits, HALF=scale_dtype == torch.float16,
            BLOCK_G=block_g, BD=bd, CHUNK=min(block_g, CHANNEL_QUANT_CHUNK), num_warps=CHANNEL_QUANT_WARPS,
            **LAUNCH_OPTS,
        )
    return codes, scale, lo


def int_channel_dequantize_torch(codes, scale, lo, bits: int, token_group: int) -> torch.Tensor:
    """Reference: fp32 ``[N, H, D]`` values of channel-grouped INT-k data."""
    n = codes.shape[0]
    per_token = torch.arange(n, device=codes.device) // token_group
    q = unpack_codes(codes, bits).to(torch.float32)
    return q * scale.to(torch.float32)[per_token] + lo.to(torch.float32)[per_token]


def int_channel_dequantize_triton(
    codes, scale, lo, bits: int, token_group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Kernel version of :func:`int_channel_dequantize_torch`, written directly as ``dtype`` (as ``.to(dtype)``)."""
    codes, scale, lo = codes.contiguous(), scale.contiguous(), lo.contiguous()
    n, h, nbytes = codes.shape
    d = nbytes * 8 // bits
    out, dst, kind = out_buffer((n, h, d), dtype, codes.device)
    if out.numel():
        bd = next_pow2(d)
        values, warps = CHANNEL_DEQUANT
        block_t = min(next_pow2(token_group), tile_rows(d, values))
        split = cdiv(token_group, block_t)
        _int_channel_dequantize_kernel[(cdiv(n, token_group) * split, h)](
            codes, scale, lo, dst, n, H=h, D=d, G=token_group, BITS=bits, BLOCK_T=block_t, BD=bd, OUT=kind,
            num_warps=warps, **LAUNCH_OPTS,
        )
    return out


def int_quantize_channels(
    x: torch.Tensor,
    bits: int,
    token_group: int = 32,
    scale_dtype: torch.dtype = torch.float16,
    backend: str | None = None,
    flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT-k with one group per channel over ``token_group`` tokens (KIVI keys).

    Returns ``(codes uint8 [N, H, D*k/8], scale [T, H, D], lo [T, H, D])`` with
    ``T = ceil(N / token_group)``; the last group holds the remaining tokens.
    """
    if not isinstance(token_group, int) or token_group <= 0:
        raise ValueError(f"{FORMAT}: token_group must be a positive int, got {token_group!r}")
    multiple = 8 // bits if bits in BITS else 1
    check_params_static(x, bits, scale_dtype, multiple)
    if use_triton(x, _int_channel_quantize_kernel, backend):
        return run_checked(lambda x, f: int_channel_quantize_triton(x, bits, token_group, scale_dtype, f), x, bits, flags)
    check_params(x, bits, scale_dtype, multiple)
    return int_channel_quantize_torch(x, bits, token_group, scale_dtype)


def int_dequantize_channels(
    codes: torch.Tensor,
    scale: torch.Tensor,
    lo: torch.Tensor,
    bits: int,
    token_group: int = 32,
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode channel-grouped INT-k data to ``[N, H, D]`` values of ``dtype``."""
    check_codes(codes, scale, lo, bits, (cdiv(codes.shape[0], token_group), codes.shape[1]))
    if use_triton(codes, _int_channel_dequantize_kernel, backend):
        out = int_channel_dequantize_triton(codes, scale, lo, bits, token_group, dtype)
    else:
        out = int_channel_dequantize_torch(codes, scale, lo, bits, token_group)
    return out.to(dtype)
