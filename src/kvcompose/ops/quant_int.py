"""Asymmetric INT-k quantization (k = 2, 4, 8) with a scale and a minimum per group.

For a group of values with minimum ``lo`` and maximum ``hi`` (all arithmetic fp32):

- ``scale = (hi - lo) * fp32(1 / (2^k - 1))``; scale and ``lo`` are rounded to the storage
  dtype (fp16 by default, as in KIVI; fp32 optional) *before* coding, so decoding
  uses exactly the numbers coding used. A scale that is 0 after rounding
  (constant group) becomes 1; a minimum of zero is stored as +0 (the sign of a zero
  minimum would otherwise depend on the order of the min reduction).
- ``q = clamp(round_half_even((x - lo) * (1 / scale)), 0, 2^k - 1)``: the reciprocal once
  per group (IEEE division), ``x - lo`` in fp32, the product rounded once (one fused
  multiply-add per value in the kernels).
- ``x_hat = q * scale + lo`` (a multiply then an add, two roundings; kernels are
  launched without FMA fusion so the GPU matches torch).

Two groupings of ``x`` ``[N, H, D]``:

- ``token`` (this module): groups of ``group_size`` consecutive channels of one token
  and head (``D % group_size == 0``); scale and min are ``[N, H, D / group_size]``.
  Slot-local.
- ``channel`` (KIVI keys, :mod:`kvcompose.ops.quant_int_channel`): one group per channel
  over ``token_group`` consecutive tokens; the last group may be shorter when
  ``N % token_group != 0``. Scale and min are ``[ceil(N / token_group), H, D]``. Not
  slot-local: a scale spans several tokens.

This module also holds the arithmetic and the checks both groupings share.

Codes are packed along the head dim, ``8 // k`` per byte, element ``c*i + j`` in bits
``[k*j, k*(j+1))`` of byte ``i``: ``codes`` uint8 ``[N, H, D * k / 8]``.

Bits per value: ``k + 2 * s / g`` with ``s`` the scale dtype's bits (16 or 32) and
``g`` the number of values sharing one (scale, min) pair.
"""

from __future__ import annotations

import torch

from .checks import (
    FLAG_RANGE,
    check_flag_tensor,
    check_input,
    check_shape,
    flag_bits,
    new_flags,
    nonfinite_tl,
    raise_on_flags,
    set_flag_tl,
)
from .dispatch import use_triton
from .layout import out_buffer, pack_codes, store_out_tl, unpack_codes
from .numerics import max_keep_nan_tl, max_nan_tl, min_keep_nan_tl, min_nan_tl, recip_tl, reciprocal
from .triton_shim import LAUNCH_OPTS, cdiv, jit, next_pow2, tl


FORMAT = "int"
BITS = (2, 4, 8)
SCALE_DTYPES = (torch.float16, torch.float32)
FP16_MAX = 65504.0


# Launch shapes, per kernel: values per program and warps per program.
TOKEN_QUANT = (1024, 1)
TOKEN_DEQUANT = (8192, 4)


def tile_rows(width: int, values: int) -> int:
    """Groups (or rows) of ``width`` values per program: about ``values`` values in all."""
    return max(1, values // next_pow2(width))


# Shared arithmetic (torch and Triton versions, same operations in the same order)


def int_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, scale_dtype: torch.dtype):
    """Reference: (scale, lo) of groups with extremes ``lo``/``hi``, rounded to ``scale_dtype``, as fp32."""
    scale = ((hi - lo) * torch.full_like(hi, 1.0 / ((1 << bits) - 1))).to(scale_dtype).to(torch.float32)
    lo = lo.to(scale_dtype).to(torch.float32)
    lo = torch.where(lo == 0, torch.zeros_like(lo), lo)  # +0, never -0: min reductions disagree on a zero's sign
    return torch.where(scale > 0, scale, torch.ones_like(scale)), lo


def int_encode(x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference: integer codes of ``x`` (int32) under broadcastable ``scale``/``lo``.

    ``(x - lo)`` in fp32, times the fp32 reciprocal of the scale, rounded once to the
    nearest integer, ties to even (the product of two fp32 values is exact in fp64, and
    the kernels round it with one fused multiply-add), then clamped to the code range.
    """
    d = (x - lo).to(torch.float64)
    q = torch.round(d * reciprocal(scale).to(torch.float64))
    return q.clamp(0.0, float((1 << bits) - 1)).to(torch.int32)


@jit
def int_params_tl(lo, hi, BITS: tl.constexpr, HALF: tl.constexpr):
    scale = (hi - lo) * (1.0 / ((1 << BITS) - 1))
    if HALF:
        scale = scale.to(tl.float16).to(tl.float32)
        lo = lo.to(tl.float16).to(tl.float32)
    return tl.where(scale > 0, scale, 1.0), tl.where(lo == 0.0, 0.0, lo)


@jit
def int_encode_tl(x, inv_scale, lo, BITS: tl.constexpr):
    # fma(d, 1/scale, 1.5 * 2^23) rounds d / scale once to an integer (the unit in the last place
    # of [2^23, 2^24) is 1, and 1.5 * 2^23 keeps results down to -2^22 in that binade); the
    # clamp saturates anything outside the code range. One FMA-pipe op instead of two.
    c = tl.fma(x - lo, inv_scale, 12582912.0)
    c = tl.minimum(tl.maximum(c, 12582912.0), 12582912.0 + ((1 << BITS) - 1))
    return c.to(tl.int32, bitcast=True) - 0x4B400000


@jit
def range_flags_tl(lo, hi, ok, HALF: tl.constexpr):
    """Error bits per group from its extremes (found by NaN-propagating reductions, so a NaN
    or inf anywhere in the group shows in them): FLAG_NONFINITE; with fp16 scales, FLAG_RANGE
    where an extreme lies beyond the fp16 range. Groups outside the tensor (``ok`` false) get 0."""
    top = tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL)
    bits = nonfinite_tl(top)
    if HALF:
        bits = bits | tl.where(top > 65504.0, 4, 0)
    return tl.where(ok, bits, 0)


@jit
def unpack_tl(packed, R: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    """``[R, NB]`` int32 bytes -> ``[R, NB * 8 / BITS]`` codes (element ``c*i + j`` from bits ``[k*j, k*(j+1))``)."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, PER)[None, None, :]
    q = (packed[:, :, None] >> (BITS * j)) & ((1 << BITS) - 1)
    return tl.reshape(q, [R, NB * PER]).to(tl.float32)


# Token groups: one program per tile of GROUPS groups, numbered flat over
# [N, H, D / GS] and viewed as [group, byte, slot].


@jit
def _bf16_pair(w):
    """The two bf16 values of int32 words ``w`` as fp32 (the low half is the first)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@jit
def _row_extremes(a, b):
    """Per-row ``(min, max)`` ``[R, 1]`` of ``a`` and ``b`` ``[R, C]``, NaN kept."""
    lo = min_nan_tl(min_keep_nan_tl(a, 1, True), min_keep_nan_tl(b, 1, True))
    return lo, max_nan_tl(max_keep_nan_tl(a, 1, True), max_keep_nan_tl(b, 1, True))


@jit
def _int_token_quantize_kernel(
    x_ptr, code_ptr, scale_ptr, lo_ptr, flag_ptr, n_groups,
    GS: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr, GROUPS: tl.constexpr, BG: tl.constexpr,
    WORDS: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    GB: tl.constexpr = GS // PER
    g0 = tl.program_id(0).to(tl.int64) * GROUPS  # 64-bit offsets for the tile start only
    grp = tl.arange(0, GROUPS)[:, None]  # per-group values stay [GROUPS, 1] in the tile's layout
    ok = grp < n_groups - g0
    if WORDS:
        # bf16 read as words (BG == GS): a bf16 is the high half of its fp32 pattern, so each
        # value is one shift or mask away. The words hold exactly one byte's values: int32
        # pairs for INT4, int64 quadruples for INT2 (x_ptr points at such a view).
        i = tl.arange(0, BG // PER)[None, :]
        w = tl.load(x_ptr + g0 * GB + grp * GB + i, mask=ok, other=0)
        v0, v1 = _bf16_pair(w.to(tl.int32))
        lo, hi = _row_extremes(v0, v1)
        if BITS == 2:
            v2, v3 = _bf16_pair((w >> 32).to(tl.int32))
            lo2, hi2 = _row_extremes(v2, v3)
            lo, hi = min_nan_tl(lo, lo2), max_nan_tl(hi, hi2)
    else:
        c = tl.arange(0, BG)[None, :]
        mask = ok & (c < GS)
        x = tl.load(x_ptr + g0 * GS + grp * GS + c, mask=mask, other=0.0).to(tl.float32)
        if BG == GS:  # rows past the end read zeros, and nothing of theirs is stored
            lo = min_keep_nan_tl(x, 1, True)
            hi = max_keep_nan_tl(x, 1, True)
        else:
            lo = min_keep_nan_tl(tl.where(mask, x, float("inf")), 1, True)
            hi = max_keep_nan_tl(tl.where(mask, x, float("-inf")), 1, True)
    flags = range_flags_tl(lo, hi, ok, HALF)
    scale, lo = int_params_tl(lo, hi, BITS, HALF)
    inv = recip_tl(scale)
    if WORDS:
        packed = int_encode_tl(v0, inv, lo, BITS) | (int_encode_tl(v1, inv, lo, BITS) << BITS)
        if BITS == 2:
            packed = packed | (int_encode_tl(v2, inv, lo, BITS) << 4) | (int_encode_tl(v3, inv, lo, BITS) << 6)
    else:
        j = tl.arange(0, PER)[None, None, :]
        packed = tl.sum(tl.reshape(int_encode_tl(x, inv, lo, BITS), [GROUPS, BG // PER, PER]) << (BITS * j), axis=2)

    b = tl.arange(0, BG // PER)[None, :]
    tl.store(code_ptr + g0 * GB + grp * GB + b, packed.to(tl.uint8), mask=ok & (b < GB))
    tl.store(scale_ptr + g0 + grp, scale, mask=ok)
    tl.store(lo_ptr + g0 + grp, lo, mask=ok)
    set_flag_tl(flag_ptr, flags)


@jit
def _int_token_dequantize_kernel(
    code_ptr, scale_ptr, lo_ptr, out_ptr, n_groups,
    GS: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, BG: tl.constexpr, OUT: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    GB: tl.constexpr = GS // PER
    grp = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    ok = grp < n_groups
    scale = tl.load(scale_ptr + grp, mask=ok, other=1.0).to(tl.float32)
    lo = tl.load(lo_ptr + grp, mask=ok, other=0.0).to(tl.float32)
    b = tl.arange(0, BG // PER)[None, :]
    packed = tl.load(code_ptr + grp[:, None] * GB + b, mask=ok[:, None] & (b < GB), other=0).to(tl.int32)
    q = unpack_tl(packed, GROUPS, BG // PER, BITS)
    x = q * scale[:, None] + lo[:, None]
    c = tl.arange(0, BG)[None, :]
    store_out_tl(out_ptr + grp[:, None] * GS + c, x, ok[:, None] & (c < GS), OUT)


def int_token_quantize_torch(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype):
    """Reference: ``(codes [N, H, D*k/8], scale [N, H, D/g], lo [N, H, D/g])`` for token groups."""
    n, h, d = x.shape
    xg = x.to(torch.float32).reshape(n, h, d // group_size, group_size)
    scale, lo = int_params(xg.amin(dim=-1), xg.amax(dim=-1), bits, scale_dtype)
    q = int_encode(xg, scale[..., None], lo[..., None], bits)
    return pack_codes(q.reshape(n, h, d), bits), scale.to(scale_dtype), lo.to(scale_dtype)


def int_token_quantize_triton(
    x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype, flags: torch.Tensor | None = None
):
    """Kernel version of :func:`int_token_quantize_torch` (``flags``: the error flag the kernel sets)."""
    x = x.contiguous()
    n, h, d = x.shape
    ng = d // group_size
    codes = torch.empty((n, h, d * bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n, h, ng), dtype=scale_dtype, device=x.device)
    lo = torch.empty((n, h, ng), dtype=scale_dtype, device=x.device)
    flags = new_flags(x.device) if flags is None else flags
    if x.numel():
        n_groups = n * h * ng
        values, warps = TOKEN_QUANT
        tile = tile_rows(group_size, values)
        # bf16 as words of one code byte's values (see the kernel), for power-of-two groups
        words = x.dtype == torch.bfloat16 and bits in (2, 4) and group_size == next_pow2(group_size) >= 4
        _int_token_quantize_kernel[(cdiv(n_groups, tile),)](
            x.view(torch.int64 if bits == 2 else torch.int32) if words else x, codes, scale, lo, flags, n_groups, GS=group_size, BITS=bits,
            HALF=scale_dtype == torch.float16, GROUPS=tile, BG=next_pow2(group_size), WORDS=words, num_warps=warps,
            **LAUNCH_OPTS,
        )
    return codes, scale, lo


def int_token_dequantize_torch(codes, scale, lo, bits: int) -> torch.Tensor:
    """Reference: fp32 ``[N, H, D]`` values of token-grouped INT-k data."""
    n, h, nbytes = codes.shape
    d = nbytes * 8 // bits
    q = unpack_codes(codes, bits).to(torch.float32).reshape(n, h, scale.shape[-1], -1)
    x = q * scale.to(torch.float32)[..., None] + lo.to(torch.float32)[..., None]
    return x.reshape(n, h, d)


def int_token_dequantize_triton(codes, scale, lo, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Kernel version of :func:`int_token_dequantize_torch`, written directly as ``dtype`` (as ``.to(dtype)``)."""
    codes, scale, lo = codes.contiguous(), scale.contiguous(), lo.contiguous()
    n, h, nbytes = codes.shape
    d = nbytes * 8 // bits
    ng = scale.shape[-1]
    gs = d // ng
    out, dst, kind = out_buffer((n, h, d), dtype, codes.device)
    if out.numel():
        n_groups = n * h * ng
        values, warps = TOKEN_DEQUANT
        tile = tile_rows(gs, values)
        _int_token_dequantize_kernel[(cdiv(n_groups, tile),)](
            codes, scale, lo, dst, n_groups, GS=gs, BITS=bits, GROUPS=tile, BG=next_pow2(gs), OUT=kind,
            num_warps=warps, **LAUNCH_OPTS,
        )
    return out


# Checks and dispatch


def check_params(x: torch.Tensor, bits: int, scale_dtype: torch.dtype, head_dim_multiple: int) -> None:
    """The torch path's checks: ``bits``, ``scale_dtype``, and one pass over ``x`` (NaN/inf, fp16 range)."""
    if bits not in BITS:
        raise ValueError(f"{FORMAT}: bits={bits!r} is not supported; accepted: {', '.join(map(str, BITS))}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{FORMAT}: scale_dtype {scale_dtype} is not supported; accepted: torch.float16, torch.float32"
        )
    amax = check_input(x, f"int{bits}", head_dim_multiple=head_dim_multiple)
    if scale_dtype == torch.float16 and x.numel():
        _check_fp16_range(amax.max().item(), bits)


def check_params_static(x, bits: int, scale_dtype: torch.dtype, head_dim_multiple: int) -> None:
    """:func:`check_params` without a pass over ``x`` (the kernels check values themselves)."""
    if bits not in BITS:
        raise ValueError(f"{FORMAT}: bits={bits!r} is not supported; accepted: {', '.join(map(str, BITS))}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{FORMAT}: scale_dtype {scale_dtype} is not supported; accepted: torch.float16, torch.float32"
        )
    check_shape(x, f"int{bits}", head_dim_multiple=head_dim_multiple)


def _check_fp16_range(top: float, bits: int) -> None:
    """An fp16 minimum cannot hold a value beyond the fp16 range; say so and name the way out."""
    if top > FP16_MAX:
        raise ValueError(
            f"int{bits}: |x| reaches {top:.6g}, beyond the float16 range of the stored minimum "
            f"({FP16_MAX:g}); use scale_dtype=torch.float32"
        )


def run_checked(kernel_call, x: torch.Tensor, bits: int, flags: torch.Tensor | None = None):
    """Run a quantize kernel with an error flag, then raise what the torch path would (one host sync).

    With a caller-owned ``flags`` the errors are only recorded there (no synchronization);
    :func:`~kvcompose.ops.checks.check_flags` raises them later.
    """
    x = x.detach().contiguous()
    if flags is not None:
        check_flag_tensor(flags, x)
        return kernel_call(x, flags)
    flags = new_flags(x.device)
    out = kernel_call(x, flags)
    raise_on_flags(flags, x, f"int{bits}")
    if flag_bits(flags) & FLAG_RANGE:
        _check_fp16_range(x.abs().amax().float().item(), bits)
    return out


def check_codes(codes, scale, lo, bits, scale_lead) -> None:
    """What a dequantize takes: uint8 codes ``[N, H, D*k/8]``, scale and minimum of one shape
    ``[*scale_lead, G]``."""
    if bits not in BITS:
        raise ValueError(f"{FORMAT}: bits={bits!r} is not supported; accepted: {', '.join(map(str, BITS))}")
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"{FORMAT}: codes must be uint8 [N, H, D*k/8], got {codes.dtype} {tuple(codes.shape)}")
    if scale.shape != lo.shape or tuple(scale.shape[:2]) != tuple(scale_lead) or scale.dim() != 3:
        raise ValueError(
            f"{FORMAT}: scale/min shapes {tuple(scale.shape)}/{tuple(lo.shape)} do not match codes {tuple(codes.shape)}"
        )


def int_quantize_tokens(
    x: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    scale_dtype: torch.dtype = torch.float16,
    backend: str | None = None,
    flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT-k with groups of ``group_size`` channels per token (None: the whole head dim).

    Returns ``(codes uint8 [N, H, D*k/8], scale [N, H, D/g], lo [N, H, D/g])``.
    """
    if bits in BITS and isinstance(x, torch.Tensor) and x.dim() == 3:
        gs = x.shape[-1] if group_size is None else group_size
        if gs <= 0 or x.shape[-1] % gs or gs % (8 // bits):
            raise ValueError(
                f"int{bits}: group_size {gs} must divide head_dim {x.shape[-1]} and be a multiple of {8 // bits} "
                f"(codes per byte)"
            )
    check_params_static(x, bits, scale_dtype, 1)
    gs = x.shape[-1] if group_size is None else group_size
    if use_triton(x, _int_token_quantize_kernel, backend):
        return run_checked(lambda x, f: int_token_quantize_triton(x, bits, gs, scale_dtype, f), x, bits, flags)
    check_params(x, bits, scale_dtype, 1)
    return int_token_quantize_torch(x, bits, gs, scale_dtype)


def int_dequantize_tokens(
    codes: torch.Tensor,
    scale: torch.Tensor,
    lo: torch.Tensor,
    bits: int,
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode token-grouped INT-k data to ``[N, H, D]`` values of ``dtype``."""
    check_codes(codes, scale, lo, bits, (codes.shape[0], codes.shape[1]))
    if use_triton(codes, _int_token_dequantize_kernel, backend):
        out = int_token_dequantize_triton(codes, scale, lo, bits, dtype)
    else:
        out = int_token_dequantize_torch(codes, scale, lo, bits)
    return out.to(dtype)
