"""Ternary (2-bit) quantization: {-1, 0, +1} times an E4M3 scale per block of 16 channels.

Format, for ``x`` of shape ``[N, H, D]`` with ``D % 16 == 0`` (all arithmetic fp32):

- Head scale, as in NVFP4, keeps block scales inside E4M3's range:
  ``s2[h] = amax(|x[:, h, :]|) / 448`` (1 if 0), or a caller-provided fixed ``s2``.
- Block scale: the least-squares ternary scale of the block. For a block with
  magnitudes ``a_i``, coding the set S of largest magnitudes as ``+-alpha`` and the
  rest as 0 has squared error ``sum(a^2) - (sum_S a)^2 / |S|`` at the best
  ``alpha = mean_S(a)``, so the rule picks the S (a "largest k" set, k = 1..16)
  that maximises ``(sum_S a)^2 / |S|``. To make that exact and independent of
  summation order, magnitudes are measured in fixed point first:
  ``u_i = floor(a_i * (2^20 / block_amax))`` (the reciprocal once per block, IEEE
  division; integers held in fp32, whose sums of 16 are exact). Candidate ``j`` is
  ``S_j = {i : u_i >= u_j}`` with score ``fp32(sum_Sj u)^2 * fp32(1 / |S_j|)`` (a
  multiply by the rounded reciprocal of the count, so no division per candidate); the
  best score wins, ties go to the largest threshold ``u_j`` (fewest non-zeros). Then
  ``alpha = sum_S u / (|S| * 2^20) * block_amax`` and
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

from .quant_common import (
    E4M3_MAX,
    LAUNCH_OPTS,
    amax_tl,
    bad_scale_tl,
    block_dequant_tile_tl,
    block_scale_code_tl,
    block_scale_e4m3,
    cdiv,
    dequantize_block_scaled,
    e4m3_decode,
    e4m3_encode,
    jit,
    max_nan_tl,
    new_flags,
    nonfinite_tl,
    out_buffer,
    pack_codes,
    per_token,
    quantize_two_level,
    scale_index_tl,
    set_flag_tl,
    store_out_tl,
    tl,
    token_stride,
    unpack_codes,
)

FORMAT = "ternary"
BLOCK = 16
FIXED_ONE = 1048576.0  # 2^20: fixed-point unit of a magnitude relative to its block max
COUNT_RECIPROCALS = [1.0 / k for k in range(1, BLOCK + 1)]  # fp32(1 / |S|) of the scores
QUANT_TILE = 128  # blocks per quantize program
QUANT_WARPS = 4
DEQUANT_TILE = 512  # blocks per dequantize program: 8192 values
DEQUANT_WARPS = 4


def ternary_block_scale(x: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Reference block scales (fp32 values, ``[N, H, D/16]``) of fp32 ``x`` ``[N, H, D/16, 16]``."""
    a = x.abs()
    block_amax = a.amax(dim=-1)
    safe = torch.where(block_amax > 0, block_amax, torch.ones_like(block_amax))
    u = torch.floor(a * (torch.full_like(safe, FIXED_ONE) / safe)[..., None])
    ge = u[..., :, None] >= u[..., None, :]  # [..., i, j]: element i belongs to candidate set j
    count = ge.sum(dim=-2)
    total = (u[..., :, None] * ge).sum(dim=-2)  # integers below 2^24: exact in any order
    rcp = torch.tensor(COUNT_RECIPROCALS, dtype=torch.float32, device=x.device)
    score = total * total * rcp[count - 1]
    best = score.amax(dim=-1, keepdim=True)
    threshold = torch.where(score == best, u, torch.full_like(u, -1.0)).amax(dim=-1, keepdim=True)
    chosen = u >= threshold
    n_sel = chosen.sum(dim=-1).to(torch.float32)
    s_sel = (u * chosen).sum(dim=-1)
    alpha = s_sel / (n_sel * FIXED_ONE) * block_amax
    return block_scale_e4m3(alpha / per_token(s2), block_amax)


# ---------------------------------------------------------------------------
# Kernel scale search. Candidate set S_j = {i : u_i >= u_j} is the "largest k" set
# whose k is the last position of u_j's tie group in the descending order. So: sort
# each block's 16 magnitudes (a sorting network on 16 column vectors), walk the
# prefix sums, and keep the best score among the positions that end a tie group,
# the smaller k on equal scores. Each block lies in one thread (two [B, 8] halves
# split into columns in registers), so the network is plain elementwise min/max.
# Totals, counts and scores are the very numbers the reference computes (exact sums,
# the same fp32 multiplies), so the result is identical.


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
def _keep_best(best, k_best, s_best, total, k: tl.constexpr, ends):
    """Candidate ``k`` (its prefix sum ``total``) replaces the best if it ends a tie group and scores higher."""
    score = total * total * (1.0 / k)
    take = ends & (score > best)
    return tl.where(take, score, best), tl.where(take, k * 1.0, k_best), tl.where(take, total, s_best)


@jit
def _ternary_scale_search(lo, hi, B: tl.constexpr):
    """``(k, sum)`` of the best "largest k" set of each block; ``lo``/``hi``: its 16 magnitudes as two ``[B, 8]``."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns(lo, B)  # the network sorts any order of its inputs
    c8, c9, c10, c11, c12, c13, c14, c15 = _columns(hi, B)
    # Batcher's odd-even merge sort of 16 (63 compare-exchanges), descending.
    c0, c1 = tl.maximum(c0, c1), tl.minimum(c0, c1)
    c2, c3 = tl.maximum(c2, c3), tl.minimum(c2, c3)
    c0, c2 = tl.maximum(c0, c2), tl.minimum(c0, c2)
    c1, c3 = tl.maximum(c1, c3), tl.minimum(c1, c3)
    c1, c2 = tl.maximum(c1, c2), tl.minimum(c1, c2)
    c4, c5 = tl.maximum(c4, c5), tl.minimum(c4, c5)
    c6, c7 = tl.maximum(c6, c7), tl.minimum(c6, c7)
    c4, c6 = tl.maximum(c4, c6), tl.minimum(c4, c6)
    c5, c7 = tl.maximum(c5, c7), tl.minimum(c5, c7)
    c5, c6 = tl.maximum(c5, c6), tl.minimum(c5, c6)
    c0, c4 = tl.maximum(c0, c4), tl.minimum(c0, c4)
    c2, c6 = tl.maximum(c2, c6), tl.minimum(c2, c6)
    c2, c4 = tl.maximum(c2, c4), tl.minimum(c2, c4)
    c1, c5 = tl.maximum(c1, c5), tl.minimum(c1, c5)
    c3, c7 = tl.maximum(c3, c7), tl.minimum(c3, c7)
    c3, c5 = tl.maximum(c3, c5), tl.minimum(c3, c5)
    c1, c2 = tl.maximum(c1, c2), tl.minimum(c1, c2)
    c3, c4 = tl.maximum(c3, c4), tl.minimum(c3, c4)
    c5, c6 = tl.maximum(c5, c6), tl.minimum(c5, c6)
    c8, c9 = tl.maximum(c8, c9), tl.minimum(c8, c9)
    c10, c11 = tl.maximum(c10, c11), tl.minimum(c10, c11)
    c8, c10 = tl.maximum(c8, c10), tl.minimum(c8, c10)
    c9, c11 = tl.maximum(c9, c11), tl.minimum(c9, c11)
    c9, c10 = tl.maximum(c9, c10), tl.minimum(c9, c10)
    c12, c13 = tl.maximum(c12, c13), tl.minimum(c12, c13)
    c14, c15 = tl.maximum(c14, c15), tl.minimum(c14, c15)
    c12, c14 = tl.maximum(c12, c14), tl.minimum(c12, c14)
    c13, c15 = tl.maximum(c13, c15), tl.minimum(c13, c15)
    c13, c14 = tl.maximum(c13, c14), tl.minimum(c13, c14)
    c8, c12 = tl.maximum(c8, c12), tl.minimum(c8, c12)
    c10, c14 = tl.maximum(c10, c14), tl.minimum(c10, c14)
    c10, c12 = tl.maximum(c10, c12), tl.minimum(c10, c12)
    c9, c13 = tl.maximum(c9, c13), tl.minimum(c9, c13)
    c11, c15 = tl.maximum(c11, c15), tl.minimum(c11, c15)
    c11, c13 = tl.maximum(c11, c13), tl.minimum(c11, c13)
    c9, c10 = tl.maximum(c9, c10), tl.minimum(c9, c10)
    c11, c12 = tl.maximum(c11, c12), tl.minimum(c11, c12)
    c13, c14 = tl.maximum(c13, c14), tl.minimum(c13, c14)
    c0, c8 = tl.maximum(c0, c8), tl.minimum(c0, c8)
    c4, c12 = tl.maximum(c4, c12), tl.minimum(c4, c12)
    c4, c8 = tl.maximum(c4, c8), tl.minimum(c4, c8)
    c2, c10 = tl.maximum(c2, c10), tl.minimum(c2, c10)
    c6, c14 = tl.maximum(c6, c14), tl.minimum(c6, c14)
    c6, c10 = tl.maximum(c6, c10), tl.minimum(c6, c10)
    c2, c4 = tl.maximum(c2, c4), tl.minimum(c2, c4)
    c6, c8 = tl.maximum(c6, c8), tl.minimum(c6, c8)
    c10, c12 = tl.maximum(c10, c12), tl.minimum(c10, c12)
    c1, c9 = tl.maximum(c1, c9), tl.minimum(c1, c9)
    c5, c13 = tl.maximum(c5, c13), tl.minimum(c5, c13)
    c5, c9 = tl.maximum(c5, c9), tl.minimum(c5, c9)
    c3, c11 = tl.maximum(c3, c11), tl.minimum(c3, c11)
    c7, c15 = tl.maximum(c7, c15), tl.minimum(c7, c15)
    c7, c11 = tl.maximum(c7, c11), tl.minimum(c7, c11)
    c3, c5 = tl.maximum(c3, c5), tl.minimum(c3, c5)
    c7, c9 = tl.maximum(c7, c9), tl.minimum(c7, c9)
    c11, c13 = tl.maximum(c11, c13), tl.minimum(c11, c13)
    c1, c2 = tl.maximum(c1, c2), tl.minimum(c1, c2)
    c3, c4 = tl.maximum(c3, c4), tl.minimum(c3, c4)
    c5, c6 = tl.maximum(c5, c6), tl.minimum(c5, c6)
    c7, c8 = tl.maximum(c7, c8), tl.minimum(c7, c8)
    c9, c10 = tl.maximum(c9, c10), tl.minimum(c9, c10)
    c11, c12 = tl.maximum(c11, c12), tl.minimum(c11, c12)
    c13, c14 = tl.maximum(c13, c14), tl.minimum(c13, c14)
    best = tl.full(c0.shape, -1.0, tl.float32)
    k_best = tl.zeros(c0.shape, tl.float32)
    s_best = tl.zeros(c0.shape, tl.float32)
    total = c0
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 1, c0 != c1)
    total += c1
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 2, c1 != c2)
    total += c2
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 3, c2 != c3)
    total += c3
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 4, c3 != c4)
    total += c4
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 5, c4 != c5)
    total += c5
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 6, c5 != c6)
    total += c6
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 7, c6 != c7)
    total += c7
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 8, c7 != c8)
    total += c8
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 9, c8 != c9)
    total += c9
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 10, c9 != c10)
    total += c10
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 11, c10 != c11)
    total += c11
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 12, c11 != c12)
    total += c12
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 13, c12 != c13)
    total += c13
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 14, c13 != c14)
    total += c14
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 15, c14 != c15)
    total += c15
    best, k_best, s_best = _keep_best(best, k_best, s_best, total, 16, c15 == c15)
    return k_best, s_best


@jit
def _ternary_codes(x, half, B: tl.constexpr):
    """16-bit word per block of the 2-bit codes of ``x`` ``[B, 8]`` (element j in bits 2j, 2j + 1)."""
    code = tl.where(x > half[:, None], 1, tl.where(x < 0.0 - half[:, None], 2, 0))
    return tl.sum(code << (2 * tl.arange(0, 8))[None, :], axis=1)


@jit
def _ternary_quantize_kernel(
    x_ptr, s2_ptr, word_ptr, bs_ptr, flag_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
    ST: tl.constexpr,
):
    # One program per tile of BLOCKS 16-value blocks, numbered flat over [N, H, D/16], each
    # loaded as two [block, 8] halves; the codes of a block are one int32 word.
    blk0 = tl.program_id(0).to(tl.int64) * BLOCKS
    b = tl.arange(0, BLOCKS)
    ok = b < n_blocks - blk0
    s2 = tl.load(s2_ptr + scale_index_tl(blk0, b, NB, H, ST), mask=ok, other=1.0)
    offs = blk0 * 16 + b[:, None] * 16 + tl.arange(0, 8)[None, :]
    lo = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + offs + 8, mask=ok[:, None], other=0.0).to(tl.float32)

    block_amax = max_nan_tl(amax_tl(lo, 1, False), amax_tl(hi, 1, False))
    r = tl.div_rn(tl.full(block_amax.shape, 1048576.0, tl.float32), tl.where(block_amax > 0, block_amax, 1.0))
    n_sel, s_sel = _ternary_scale_search(tl.floor(tl.abs(lo) * r[:, None]), tl.floor(tl.abs(hi) * r[:, None]), BLOCKS)
    alpha = tl.div_rn(s_sel, n_sel * 1048576.0) * block_amax
    bs_code, bs = block_scale_code_tl(tl.div_rn(alpha, s2), block_amax)

    half = (bs * s2) * 0.5
    word = _ternary_codes(lo, half, BLOCKS) | (_ternary_codes(hi, half, BLOCKS) << 16)
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
    later through :func:`~kvcompose.ops.quant_common.check_flags`.
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
