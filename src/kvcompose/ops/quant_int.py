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

- ``token``: groups of ``group_size`` consecutive channels of one token and head
  (``D % group_size == 0``); scale and min are ``[N, H, D / group_size]``. Slot-local.
- ``channel`` (KIVI keys): one group per channel over ``token_group`` consecutive
  tokens; the last group may be shorter when ``N % token_group != 0``. Scale and min
  are ``[ceil(N / token_group), H, D]``. Not slot-local: a scale spans several tokens.

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
from .numerics import max_nan_tl, min_nan_tl, recip_tl, reciprocal
from .triton_shim import LAUNCH_OPTS, cdiv, jit, next_pow2, tl

FORMAT = "int"
BITS = (2, 4, 8)
SCALE_DTYPES = (torch.float16, torch.float32)
FP16_MAX = 65504.0
# Launch shapes, per kernel: values per program and warps per program.
TOKEN_QUANT = (1024, 1)
TOKEN_DEQUANT = (8192, 4)
CHANNEL_QUANT_WARPS = 1  # a program handles one token group x head dim of one head
CHANNEL_QUANT_CHUNK = 16  # ... CHUNK tokens at a time, in two passes
CHANNEL_DEQUANT = (2048, 1)


def _tile(width: int, values: int) -> int:
    """Groups (or rows) of ``width`` values per program: about ``values`` values in all."""
    return max(1, values // next_pow2(width))


# ---------------------------------------------------------------------------
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
def _int_params_tl(lo, hi, BITS: tl.constexpr, HALF: tl.constexpr):
    scale = (hi - lo) * (1.0 / ((1 << BITS) - 1))
    if HALF:
        scale = scale.to(tl.float16).to(tl.float32)
        lo = lo.to(tl.float16).to(tl.float32)
    return tl.where(scale > 0, scale, 1.0), tl.where(lo == 0.0, 0.0, lo)


@jit
def _int_encode_tl(x, inv_scale, lo, BITS: tl.constexpr):
    # fma(d, 1/scale, 1.5 * 2^23) rounds d / scale once to an integer (the unit in the last place
    # of [2^23, 2^24) is 1, and 1.5 * 2^23 keeps results down to -2^22 in that binade); the
    # clamp saturates anything outside the code range. One FMA-pipe op instead of two.
    c = tl.fma(x - lo, inv_scale, 12582912.0)
    c = tl.minimum(tl.maximum(c, 12582912.0), 12582912.0 + ((1 << BITS) - 1))
    return c.to(tl.int32, bitcast=True) - 0x4B400000


# ---------------------------------------------------------------------------
# Token groups: one program per tile of GROUPS groups, numbered flat over
# [N, H, D / GS] and viewed as [group, byte, slot].


@jit
def _range_flags_tl(lo, hi, ok, HALF: tl.constexpr):
    """Error bits per group from its extremes (found by NaN-propagating reductions, so a NaN
    or inf anywhere in the group shows in them): FLAG_NONFINITE; with fp16 scales, FLAG_RANGE
    where an extreme lies beyond the fp16 range. Groups outside the tensor (``ok`` false) get 0."""
    top = tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL)
    bits = nonfinite_tl(top)
    if HALF:
        bits = bits | tl.where(top > 65504.0, 4, 0)
    return tl.where(ok, bits, 0)


@jit
def _bf16_pair(w):
    """The two bf16 values of int32 words ``w`` as fp32 (the low half is the first)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@jit
def _row_extremes(a, b):
    """Per-row ``(min, max)`` ``[R, 1]`` of ``a`` and ``b`` ``[R, C]``, NaN kept."""
    lo = min_nan_tl(tl.reduce(a, 1, min_nan_tl, keep_dims=True), tl.reduce(b, 1, min_nan_tl, keep_dims=True))
    return lo, max_nan_tl(tl.reduce(a, 1, max_nan_tl, keep_dims=True), tl.reduce(b, 1, max_nan_tl, keep_dims=True))


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
            lo = tl.reduce(x, 1, min_nan_tl, keep_dims=True)
            hi = tl.reduce(x, 1, max_nan_tl, keep_dims=True)
        else:
            lo = tl.reduce(tl.where(mask, x, float("inf")), 1, min_nan_tl, keep_dims=True)
            hi = tl.reduce(tl.where(mask, x, float("-inf")), 1, max_nan_tl, keep_dims=True)
    flags = _range_flags_tl(lo, hi, ok, HALF)
    scale, lo = _int_params_tl(lo, hi, BITS, HALF)
    inv = recip_tl(scale)
    if WORDS:
        packed = _int_encode_tl(v0, inv, lo, BITS) | (_int_encode_tl(v1, inv, lo, BITS) << BITS)
        if BITS == 2:
            packed = packed | (_int_encode_tl(v2, inv, lo, BITS) << 4) | (_int_encode_tl(v3, inv, lo, BITS) << 6)
    else:
        j = tl.arange(0, PER)[None, None, :]
        packed = tl.sum(tl.reshape(_int_encode_tl(x, inv, lo, BITS), [GROUPS, BG // PER, PER]) << (BITS * j), axis=2)

    b = tl.arange(0, BG // PER)[None, :]
    tl.store(code_ptr + g0 * GB + grp * GB + b, packed.to(tl.uint8), mask=ok & (b < GB))
    tl.store(scale_ptr + g0 + grp, scale, mask=ok)
    tl.store(lo_ptr + g0 + grp, lo, mask=ok)
    set_flag_tl(flag_ptr, flags)


@jit
def _unpack_tl(packed, R: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    """``[R, NB]`` int32 bytes -> ``[R, NB * 8 / BITS]`` codes (element ``c*i + j`` from bits ``[k*j, k*(j+1))``)."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, PER)[None, None, :]
    q = (packed[:, :, None] >> (BITS * j)) & ((1 << BITS) - 1)
    return tl.reshape(q, [R, NB * PER]).to(tl.float32)


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
    q = _unpack_tl(packed, GROUPS, BG // PER, BITS)
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
        tile = _tile(group_size, values)
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
        tile = _tile(gs, values)
        _int_token_dequantize_kernel[(cdiv(n_groups, tile),)](
            codes, scale, lo, dst, n_groups, GS=gs, BITS=bits, GROUPS=tile, BG=next_pow2(gs), OUT=kind,
            num_warps=warps, **LAUNCH_OPTS,
        )
    return out


# ---------------------------------------------------------------------------
# Channel groups (KIVI keys): one program per (token group, head), viewed as
# [token, byte, slot]; the extremes reduce over the token axis.


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
        lo = min_nan_tl(lo, tl.reduce(tl.where(mask, x, float("inf")), 0, min_nan_tl))
        hi = max_nan_tl(hi, tl.reduce(tl.where(mask, x, float("-inf")), 0, max_nan_tl))
    dd = tl.arange(0, BD)
    flags = _range_flags_tl(lo, hi, dd < D, HALF)
    scale, lo = _int_params_tl(lo, hi, BITS, HALF)
    inv = recip_tl(scale)
    j = tl.arange(0, PER)[None, None, :]
    b = tl.arange(0, BD // PER)[None, :]
    for c in tl.static_range(0, BLOCK_G, CHUNK):
        rows = (c + t < G) & (c + t < N - tg * G)
        x = tl.load(x_ptr + row0 * D + ((c + t) * H) * D + d, mask=rows & (d < D), other=0.0).to(tl.float32)
        q = _int_encode_tl(x, inv[None, :], lo[None, :], BITS)
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
    q = _unpack_tl(packed, BLOCK_T, BD // PER, BITS)
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
        block_t = min(next_pow2(token_group), _tile(d, values))
        split = cdiv(token_group, block_t)
        _int_channel_dequantize_kernel[(cdiv(n, token_group) * split, h)](
            codes, scale, lo, dst, n, H=h, D=d, G=token_group, BITS=bits, BLOCK_T=block_t, BD=bd, OUT=kind,
            num_warps=warps, **LAUNCH_OPTS,
        )
    return out


# ---------------------------------------------------------------------------
# Dispatch


def _check_params(x: torch.Tensor, bits: int, scale_dtype: torch.dtype, head_dim_multiple: int) -> None:
    if bits not in BITS:
        raise ValueError(f"{FORMAT}: bits={bits!r} is not supported; accepted: {', '.join(map(str, BITS))}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{FORMAT}: scale_dtype {scale_dtype} is not supported; accepted: torch.float16, torch.float32"
        )
    amax = check_input(x, f"int{bits}", head_dim_multiple=head_dim_multiple)
    if scale_dtype == torch.float16 and x.numel():
        _check_fp16_range(amax.max().item(), bits)


def _check_params_static(x, bits: int, scale_dtype: torch.dtype, head_dim_multiple: int) -> None:
    """:func:`_check_params` without a pass over ``x`` (the kernels check values themselves)."""
    if bits not in BITS:
        raise ValueError(f"{FORMAT}: bits={bits!r} is not supported; accepted: {', '.join(map(str, BITS))}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{FORMAT}: scale_dtype {scale_dtype} is not supported; accepted: torch.float16, torch.float32"
        )
    check_shape(x, f"int{bits}", head_dim_multiple=head_dim_multiple)


def _check_fp16_range(top: float, bits: int) -> None:
    if top > FP16_MAX:
        raise ValueError(
            f"int{bits}: |x| reaches {top:.6g}, beyond the float16 range of the stored minimum "
            f"({FP16_MAX:g}); use scale_dtype=torch.float32"
        )


def _run_checked(kernel_call, x: torch.Tensor, bits: int, flags: torch.Tensor | None = None):
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
    _check_params_static(x, bits, scale_dtype, 1)
    gs = x.shape[-1] if group_size is None else group_size
    if use_triton(x, _int_token_quantize_kernel, backend):
        return _run_checked(lambda x, f: int_token_quantize_triton(x, bits, gs, scale_dtype, f), x, bits, flags)
    _check_params(x, bits, scale_dtype, 1)
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
    _check_codes(codes, scale, lo, bits, (codes.shape[0], codes.shape[1]))
    if use_triton(codes, _int_token_dequantize_kernel, backend):
        out = int_token_dequantize_triton(codes, scale, lo, bits, dtype)
    else:
        out = int_token_dequantize_torch(codes, scale, lo, bits)
    return out.to(dtype)


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
    _check_params_static(x, bits, scale_dtype, multiple)
    if use_triton(x, _int_channel_quantize_kernel, backend):
        return _run_checked(lambda x, f: int_channel_quantize_triton(x, bits, token_group, scale_dtype, f), x, bits, flags)
    _check_params(x, bits, scale_dtype, multiple)
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
    _check_codes(codes, scale, lo, bits, (cdiv(codes.shape[0], token_group), codes.shape[1]))
    if use_triton(codes, _int_channel_dequantize_kernel, backend):
        out = int_channel_dequantize_triton(codes, scale, lo, bits, token_group, dtype)
    else:
        out = int_channel_dequantize_torch(codes, scale, lo, bits, token_group)
    return out.to(dtype)


def _check_codes(codes, scale, lo, bits, scale_lead) -> None:
    if bits not in BITS:
        raise ValueError(f"{FORMAT}: bits={bits!r} is not supported; accepted: {', '.join(map(str, BITS))}")
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"{FORMAT}: codes must be uint8 [N, H, D*k/8], got {codes.dtype} {tuple(codes.shape)}")
    if scale.shape != lo.shape or tuple(scale.shape[:2]) != tuple(scale_lead) or scale.dim() != 3:
        raise ValueError(
            f"{FORMAT}: scale/min shapes {tuple(scale.shape)}/{tuple(lo.shape)} do not match codes {tuple(codes.shape)}"
        )
