"""Ternary (2-bit) quantization: {-1, 0, +1} times an E4M3 scale per block of 16 channels.

Format, for ``x`` of shape ``[N, H, D]`` with ``D % 16 == 0`` (all arithmetic fp32):

- Head scale, as in NVFP4, keeps block scales inside E4M3's range:
  ``s2[h] = amax(|x[:, h, :]|) / 448`` (1 if 0), or a caller-provided fixed ``s2``.
- Block scale: the least-squares ternary scale of the block. For a block with
  magnitudes ``a_i``, coding the set S of largest magnitudes as ``+-alpha`` and the
  rest as 0 has squared error ``sum(a^2) - (sum_S a)^2 / |S|`` at the best
  ``alpha = mean_S(a)``, so the rule picks the S (a "largest k" set, k = 1..16)
  that maximises ``(sum_S a)^2 / |S|``. In fp32, in a fixed order: sort the
  magnitudes in descending order ``v_1 >= ... >= v_16``, take running sums
  ``P_k = P_(k-1) + v_k`` (one addition per candidate, in order), and score candidate
  ``k`` as ``alpha_k * P_k`` with ``alpha_k = P_k * fp32(1 / k)`` (a multiply by the
  rounded reciprocal of the count, no division). The highest score wins, the smallest
  ``k`` on ties (fewest non-zeros), and ``alpha = alpha_k`` of the winner. Then
  ``bs = E4M3(alpha / s2)`` (saturating; all-zero block -> 1; a non-zero block
  whose scale rounds to 0 -> 2^-9). Compared with the usual fixed-threshold rule
  (threshold 0.7 * mean|x|) this matters most for outliers: a block with one large
  value codes that value alone instead of inflating the scale of the others.
- Code: with ``m = (bs * s2) * 0.5``, the midpoint between the levels 0 and
  ``bs * s2``: ``+1`` if ``x > m``, ``-1`` if ``x < -m``, else 0 (nearest level,
  ties to 0, decided on ``x`` itself, so no division or rounding enters).
- Storage: 2-bit codes 0 -> 0, 1 -> +1, 2 -> -1, 3 -> 0 (redundant, never written),
  four per byte with element ``4i`` in the lowest bits (``codes`` uint8
  ``[N, H, D/4]``); block scales as E4M3 bit patterns (uint8 ``[N, H, D/16]``);
  ``s2`` fp32 ``[H]``.
- Decoding: ``x_hat = level * (bs * s2)``.

2 + 8/16 = 2.5 bits per value; ``s2`` is shared by every token quantized with it
and not counted. A token's codes and block scales depend only on that token and ``s2``.
"""

from __future__ import annotations

import torch

from .checks import bad_scale_tl, new_flags, nonfinite_tl, set_flag_tl
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
from .numerics import E4M3_MAX, block_scale_code_tl, block_scale_e4m3, e4m3_decode, e4m3_encode
from .triton_shim import LAUNCH_OPTS, cdiv, interpreted, jit, tl

FORMAT = "ternary"
BLOCK = 16
COUNT_RECIPROCALS = [1.0 / k for k in range(1, BLOCK + 1)]  # fp32(1 / |S|) of the scores
QUANT_TILE = 128  # blocks per quantize program: one per thread
QUANT_WARPS = 4
NATIVE_COMPARE = True  # compiled kernels decide codes in the input's 16-bit dtype (see _ternary_codes)
DEQUANT_TILE = 512  # blocks per dequantize program: 8192 values
DEQUANT_WARPS = 4


def ternary_block_scale(x: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Reference block scales (fp32 values, ``[N, H, D/16]``) of fp32 ``x`` ``[N, H, D/16, 16]``."""
    a = x.abs().sort(dim=-1, descending=True).values
    rcp = torch.tensor(COUNT_RECIPROCALS, dtype=torch.float32, device=x.device)
    total = a[..., 0]
    best, alpha_best = total * total, total
    for k in range(1, BLOCK):  # one fp32 addition per candidate, in order: the kernel's sums
        total = total + a[..., k]
        alpha = total * rcp[k]
        score = alpha * total
        take = score > best
        best, alpha_best = torch.where(take, score, best), torch.where(take, alpha, alpha_best)
    return block_scale_e4m3(alpha_best / per_token(s2), a[..., 0])


# ---------------------------------------------------------------------------
# Kernel scale search: each block lies in one thread (two [B, 8] halves split into
# 16 column vectors in registers), a sorting network orders its magnitudes, and one
# pass over the prefix sums keeps the best candidate. Same additions and multiplies,
# in the same order, as the reference, so the result is identical.


@jit
def _columns(v, B: tl.constexpr):
    """The 8 columns of ``v`` ``[B, 8]`` as ``[B]`` vectors, in the order 0, 4, 2, 6, 1, 5, 3, 7."""
    even, odd = tl.split(tl.reshape(v, [B, 4, 2]))
    e0, e1 = tl.split(tl.reshape(even, [B, 2, 2]))
    o0, o1 = tl.split(tl.reshape(odd, [B, 2, 2]))
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c4, c2, c6, c1, c5, c3, c7


@jit
def _exchange(a, b):
    """Compare-exchange, larger first. NaN counts as larger than everything (the max keeps it,
    the min drops it), so a block's NaN ends at the top, where the amax check sees it."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL), tl.minimum(a, b)


@jit
def _fp32(a, b, c, d, e, f, g, h):
    """Eight sorted columns widened to fp32 (the network sorts in the input's dtype, exactly;
    the running sums are fp32)."""
    return (a.to(tl.float32), b.to(tl.float32), c.to(tl.float32), d.to(tl.float32),
            e.to(tl.float32), f.to(tl.float32), g.to(tl.float32), h.to(tl.float32))


@jit
def _candidate(total, best, alpha_best, k: tl.constexpr):
    """Candidate ``k`` (prefix sum ``total``) replaces the best where it scores strictly higher."""
    alpha = total * (1.0 / k)
    score = alpha * total
    take = score > best
    return tl.where(take, score, best), tl.where(take, alpha, alpha_best)


@jit
def _ternary_scale_search(lo, hi, B: tl.constexpr):
    """``(alpha, amax)`` of each block: its least-squares scale and its largest magnitude (NaN if
    it holds a NaN); ``lo``/``hi``: the block's 16 magnitudes as two ``[B, 8]``."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns(lo, B)  # the network sorts any order of its inputs
    c8, c9, c10, c11, c12, c13, c14, c15 = _columns(hi, B)
    # A 60 compare-exchange, 10-layer network for 16 inputs (descending).
    c0, c13 = _exchange(c0, c13)
    c1, c12 = _exchange(c1, c12)
    c2, c15 = _exchange(c2, c15)
    c3, c14 = _exchange(c3, c14)
    c4, c8 = _exchange(c4, c8)
    c5, c6 = _exchange(c5, c6)
    c7, c11 = _exchange(c7, c11)
    c9, c10 = _exchange(c9, c10)
    c0, c5 = _exchange(c0, c5)
    c1, c7 = _exchange(c1, c7)
    c2, c9 = _exchange(c2, c9)
    c3, c4 = _exchange(c3, c4)
    c6, c13 = _exchange(c6, c13)
    c8, c14 = _exchange(c8, c14)
    c10, c15 = _exchange(c10, c15)
    c11, c12 = _exchange(c11, c12)
    c0, c1 = _exchange(c0, c1)
    c2, c3 = _exchange(c2, c3)
    c4, c5 = _exchange(c4, c5)
    c6, c8 = _exchange(c6, c8)
    c7, c9 = _exchange(c7, c9)
    c10, c11 = _exchange(c10, c11)
    c12, c13 = _exchange(c12, c13)
    c14, c15 = _exchange(c14, c15)
    c0, c2 = _exchange(c0, c2)
    c1, c3 = _exchange(c1, c3)
    c4, c10 = _exchange(c4, c10)
    c5, c11 = _exchange(c5, c11)
    c6, c7 = _exchange(c6, c7)
    c8, c9 = _exchange(c8, c9)
    c12, c14 = _exchange(c12, c14)
    c13, c15 = _exchange(c13, c15)
    c1, c2 = _exchange(c1, c2)
    c3, c12 = _exchange(c3, c12)
    c4, c6 = _exchange(c4, c6)
    c5, c7 = _exchange(c5, c7)
    c8, c10 = _exchange(c8, c10)
    c9, c11 = _exchange(c9, c11)
    c13, c14 = _exchange(c13, c14)
    c1, c4 = _exchange(c1, c4)
    c2, c6 = _exchange(c2, c6)
    c5, c8 = _exchange(c5, c8)
    c7, c10 = _exchange(c7, c10)
    c9, c13 = _exchange(c9, c13)
    c11, c14 = _exchange(c11, c14)
    c2, c4 = _exchange(c2, c4)
    c3, c6 = _exchange(c3, c6)
    c9, c12 = _exchange(c9, c12)
    c11, c13 = _exchange(c11, c13)
    c3, c5 = _exchange(c3, c5)
    c6, c8 = _exchange(c6, c8)
    c7, c9 = _exchange(c7, c9)
    c10, c12 = _exchange(c10, c12)
    c3, c4 = _exchange(c3, c4)
    c5, c6 = _exchange(c5, c6)
    c7, c8 = _exchange(c7, c8)
    c9, c10 = _exchange(c9, c10)
    c11, c12 = _exchange(c11, c12)
    c6, c7 = _exchange(c6, c7)
    c8, c9 = _exchange(c8, c9)
    c0, c1, c2, c3, c4, c5, c6, c7 = _fp32(c0, c1, c2, c3, c4, c5, c6, c7)
    c8, c9, c10, c11, c12, c13, c14, c15 = _fp32(c8, c9, c10, c11, c12, c13, c14, c15)
    total = c0
    best = c0 * c0
    alpha = c0
    total += c1
    best, alpha = _candidate(total, best, alpha, 2)
    total += c2
    best, alpha = _candidate(total, best, alpha, 3)
    total += c3
    best, alpha = _candidate(total, best, alpha, 4)
    total += c4
    best, alpha = _candidate(total, best, alpha, 5)
    total += c5
    best, alpha = _candidate(total, best, alpha, 6)
    total += c6
    best, alpha = _candidate(total, best, alpha, 7)
    total += c7
    best, alpha = _candidate(total, best, alpha, 8)
    total += c8
    best, alpha = _candidate(total, best, alpha, 9)
    total += c9
    best, alpha = _candidate(total, best, alpha, 10)
    total += c10
    best, alpha = _candidate(total, best, alpha, 11)
    total += c11
    best, alpha = _candidate(total, best, alpha, 12)
    total += c12
    best, alpha = _candidate(total, best, alpha, 13)
    total += c13
    best, alpha = _candidate(total, best, alpha, 14)
    total += c14
    best, alpha = _candidate(total, best, alpha, 15)
    total += c15
    best, alpha = _candidate(total, best, alpha, 16)
    return alpha, c0


@jit
def _ternary_codes(x, half, B: tl.constexpr, NATIVE: tl.constexpr):
    """16-bit word per block of the 2-bit codes of ``x`` ``[B, 8]`` (element j in bits 2j, 2j + 1).

    ``NATIVE`` (compiled kernels only) compares bf16/fp16 ``x`` in its own dtype against
    ``half`` rounded down (toward zero: it is positive) to that dtype: a value of the
    dtype exceeds the one exactly when it exceeds the other, and two values compare in one
    packed instruction. The interpreter compares 16-bit floats as raw bits (wrong for
    negatives, seen with Triton 3.9), so it widens to fp32 instead; same codes either way.
    """
    if NATIVE and x.dtype != tl.float32:
        limit = half.to(x.dtype, fp_downcast_rounding="rtz")[:, None]
    else:
        x = x.to(tl.float32)
        limit = half[:, None]
    code = tl.where(x > limit, 1, tl.where(x < -limit, 2, 0))
    return tl.sum(code << (2 * tl.arange(0, 8))[None, :], axis=1)


@jit
def _ternary_quantize_kernel(
    x_ptr, s2_ptr, word_ptr, bs_ptr, flag_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
    ST: tl.constexpr, NATIVE: tl.constexpr,
):
    # One program per tile of BLOCKS 16-value blocks, numbered flat over [N, H, D/16], each
    # loaded as two [block, 8] halves; the codes of a block are one int32 word.
    blk0 = tl.program_id(0).to(tl.int64) * BLOCKS
    b = tl.arange(0, BLOCKS)
    ok = b < n_blocks - blk0
    s2 = tl.load(s2_ptr + scale_index_tl(blk0, b, NB, H, ST), mask=ok, other=1.0)
    offs = blk0 * 16 + b[:, None] * 16 + tl.arange(0, 8)[None, :]
    lo = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0)
    hi = tl.load(x_ptr + offs + 8, mask=ok[:, None], other=0.0)

    alpha, block_amax = _ternary_scale_search(tl.abs(lo), tl.abs(hi), BLOCKS)
    bs_code, bs = block_scale_code_tl(tl.div_rn(alpha, s2), block_amax)

    half = (bs * s2) * 0.5
    word = _ternary_codes(lo, half, BLOCKS, NATIVE) | (_ternary_codes(hi, half, BLOCKS, NATIVE) << 16)
    tl.store(word_ptr + blk0 + b, word, mask=ok)
    tl.store(bs_ptr + blk0 + b, bs_code.to(tl.uint8), mask=ok)
    set_flag_tl(flag_ptr, nonfinite_tl(block_amax) | bad_scale_tl(s2))


@jit
def _ternary_dequantize_kernel(
    word_ptr, bs_ptr, s2_ptr, out_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
    ST: tl.constexpr, OUT: tl.constexpr,
):
    blk0, b, ok, scale = block_dequant_tile_tl(bs_ptr, s2_ptr, n_blocks, H, NB, BLOCKS, ST)
    word = tl.load(word_ptr + blk0 + b, mask=ok, other=0)
    code = (word[:, None] >> (2 * tl.arange(0, 16))[None, :]) & 3
    neg = (scale.to(tl.int32, bitcast=True) | (-2147483647 - 1)).to(tl.float32, bitcast=True)  # -scale, sign bit set
    value = tl.where(code == 1, scale[:, None], tl.where(code == 2, neg[:, None], 0.0))
    offs = b[:, None] * 16 + tl.arange(0, 16)[None, :]
    store_out_tl(out_ptr + blk0 * 16 + offs, value, ok[:, None], OUT)


def ternary_quantize_torch(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``(codes uint8 [N, H, D/4], block_scales uint8 [N, H, D/16])`` of ``x`` under ``s2``."""
    n, h, d = x.shape
    xb = x.to(torch.float32).reshape(n, h, d // BLOCK, BLOCK)
    bs = ternary_block_scale(xb, s2)
    half = ((bs * per_token(s2)) * 0.5)[..., None]
    codes = torch.where(xb > half, 1, torch.where(xb < -half, 2, 0))
    return pack_codes(codes.reshape(n, h, d), 2), e4m3_encode(bs)


def ternary_quantize_triton(
    x: torch.Tensor, s2: torch.Tensor, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`ternary_quantize_torch` (``flags``: the error flag the kernel sets)."""
    x = x.contiguous()
    n, h, d = x.shape
    nb = d // BLOCK
    codes = torch.empty((n, h, d // 4), dtype=torch.uint8, device=x.device)
    bs = torch.empty((n, h, nb), dtype=torch.uint8, device=x.device)
    flags = new_flags(x.device) if flags is None else flags
    if x.numel():
        n_blocks = n * h * nb
        grid = (cdiv(n_blocks, QUANT_TILE),)
        _ternary_quantize_kernel[grid](
            x, s2, codes.view(torch.int32), bs, flags, n_blocks, H=h, NB=nb, BLOCKS=QUANT_TILE, ST=token_stride(s2),
            NATIVE=NATIVE_COMPARE and not interpreted(_ternary_quantize_kernel),
            num_warps=QUANT_WARPS, **LAUNCH_OPTS,
        )
    return codes, bs


def ternary_dequantize_torch(codes: torch.Tensor, block_scales: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Reference: fp32 ``[N, H, D]`` values of packed ternary data."""
    n, h, quarter = codes.shape
    c = unpack_codes(codes, 2).reshape(n, h, quarter // 4, BLOCK)
    level = (c == 1).to(torch.float32) - (c == 2).to(torch.float32)
    scale = e4m3_decode(block_scales) * per_token(s2)
    return (level * scale[..., None]).reshape(n, h, quarter * 4)


def ternary_dequantize_triton(
    codes: torch.Tensor, block_scales: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Kernel version of :func:`ternary_dequantize_torch`, written directly as ``dtype`` (rounded as ``.to(dtype)``)."""
    codes, block_scales = codes.contiguous(), block_scales.contiguous()
    n, h, quarter = codes.shape
    nb = quarter // 4
    out, dst, kind = out_buffer((n, h, quarter * 4), dtype, codes.device)
    if out.numel():
        n_blocks = n * h * nb
        grid = (cdiv(n_blocks, DEQUANT_TILE),)
        _ternary_dequantize_kernel[grid](
            codes.view(torch.int32), block_scales, s2, dst, n_blocks, H=h, NB=nb, BLOCKS=DEQUANT_TILE,
            ST=token_stride(s2), OUT=kind, num_warps=DEQUANT_WARPS, **LAUNCH_OPTS,
        )
    return out


def ternary_quantize(
    x: torch.Tensor, s2: torch.Tensor | None = None, backend: str | None = None, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[N, H, D]`` to ternary; returns ``(codes, block_scales, s2)``.

    ``s2`` fixes the per-head scale; by default it is computed from ``x``.
    ``backend``: None (auto), "triton", "torch". NaN/inf input or an ``s2`` that is
    not finite and > 0 raise a ValueError, at once, or with ``flags`` (kernel path)
    later through :func:`~kvcompose.ops.checks.check_flags`.
    """
    (codes, bs), s2 = quantize_two_level(x, s2, backend, flags, fmt=FORMAT, divisor=E4M3_MAX, multiple=BLOCK,
                                         kernel=_ternary_quantize_kernel, reference=ternary_quantize_torch,
                                         launch=ternary_quantize_triton)
    return codes, bs, s2


def ternary_dequantize(
    codes: torch.Tensor,
    block_scales: torch.Tensor,
    s2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode packed ternary data to ``[N, H, D]`` values of ``dtype``."""
    return dequantize_block_scaled(codes, block_scales, s2, dtype, backend, fmt=FORMAT, codes_per_byte=4,
                                   kernel=_ternary_dequantize_kernel, reference=ternary_dequantize_torch,
                                   launch=ternary_dequantize_triton)
