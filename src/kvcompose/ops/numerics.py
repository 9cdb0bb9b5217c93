"""E4M3 and E2M1 rounding, written once in torch and once as Triton helpers that agree bit for bit.

Every format module has a Triton kernel and a plain-torch reference that must agree
bit for bit. The rounding steps here are therefore written as integer and
correctly-rounded float arithmetic (add, subtract, multiply, IEEE division,
comparisons, bit casts) with one version in torch and one as ``@triton.jit``
helpers (same operations, same order), instead of hardware float8 casts. That keeps
results identical on CPU, in the Triton interpreter and on any CUDA GPU (Triton cannot
cast to E4M3 below sm_89), and the E4M3 helper is tested against ``torch.float8_e4m3fn``
casts. One exception: on GPUs that have an E4M3 conversion instruction (sm_89+) the fp8
kernels use it (:func:`e4m3_encode_hw_tl`; round to nearest even, the same codes, checked
against the reference by the GPU tests); ``KVCOMPOSE_HW_E4M3=0`` turns that off
(:func:`kvcompose.ops.dispatch.hw_e4m3`).

Triton's ``/`` lowers to an approximate division, so kernels use ``tl.div_rn``; and
signs are set through the bit pattern, never by negation (Triton 3.6 compiles ``-x`` as
``0 - x``, losing -0.0). Values are never divided one by one: a kernel takes the
correctly rounded reciprocal of each scale once (:func:`recip_tl`, :func:`reciprocal`)
and multiplies, because a division per value costs more than moving the value through
memory.
"""

from __future__ import annotations

import torch

from .triton_shim import interpreted, jit, tl


E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


#: Magnitudes of the eight E2M1 codes 0..7 (bit 3 of a nibble is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """Round finite fp32 values to E4M3 (nearest, ties to even, saturating) and return the bit patterns."""
    v = v.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX)
    bits = v.view(torch.int32)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: round the 23-bit fp32 mantissa to 3 bits; a carry bumps the exponent.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: multiples of 2^-9, i.e. round |v| * 512 to an integer.
    sub = rne_int(v.abs() * 512.0)
    code = torch.where(mag >= (121 << 23), normal, sub) | sign
    return code.to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) to fp32 values."""
    c = code.to(torch.int32)
    f = (c >> 3) & 0xF
    m = c & 7
    normal = (((f + 120) << 23) | (m << 20)).view(torch.float32)
    mag = torch.where(f > 0, normal, m.to(torch.float32) * E4M3_MIN_SUBNORMAL)
    return with_sign(mag, (c & 0x80) << 24)


def with_sign(mag: torch.Tensor, sign_bit: torch.Tensor) -> torch.Tensor:
    """Set the fp32 sign bit from an int32 mask (0 or 1 << 31).

    Negation is avoided on purpose: some Triton versions compile ``-x`` as ``0 - x``,
    which turns -0.0 into +0.0.
    """
    return (mag.view(torch.int32) | sign_bit).view(torch.float32)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of each fp32 value, as fp32."""
    return e4m3_decode(e4m3_encode(v))


def rne_int(w: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 values (< 2^31) to int32, ties to even; every step is exact."""
    ip = w.to(torch.int32)
    frac = w - ip.to(torch.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((ip & 1) == 1))
    return ip + up.to(torch.int32)


def reciprocal(t: torch.Tensor) -> torch.Tensor:
    """``1 / t`` correctly rounded, the reference of :func:`recip_tl` (a tensor numerator:
    CUDA turns division by a Python scalar into a multiply by an approximate reciprocal)."""
    return torch.ones_like(t) / t


def block_scale_e4m3(ratio: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale (fp32 value) for a block whose ideal scale is ``ratio``.

    All-zero blocks get 1. A non-zero block whose scale rounds to 0 gets the smallest
    subnormal 2^-9 so that dividing by it stays finite.
    """
    bs = e4m3_round(ratio.clamp(max=E4M3_MAX))
    bs = torch.clamp(bs, min=E4M3_MIN_SUBNORMAL)
    return torch.where(block_amax > 0, bs, torch.ones_like(bs))


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) to 4-bit E2M1 codes (uint8, 0..15).

    Midpoints 0.25, 1.25, 2.5, 5 round down (to even) and 0.75, 1.75, 3.5 round up.
    The sign bit is the sign of ``y``, so a small negative value codes as -0 (as hardware
    FP4 conversions do); both zeros decode to a zero.
    """
    a = y.abs()
    idx = (
        (a > 0.25).to(torch.int32)
        + (a >= 0.75).to(torch.int32)
        + (a > 1.25).to(torch.int32)
        + (a >= 1.75).to(torch.int32)
        + (a > 2.5).to(torch.int32)
        + (a >= 3.5).to(torch.int32)
        + (a > 5.0).to(torch.int32)
    )
    return (idx | (torch.signbit(y).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (any integer dtype, 0..15) to fp32 values."""
    c = code.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    pow2 = (1 << (e - 1).clamp(min=0)).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, pow2 * (1.0 + m * 0.5))
    return with_sign(mag, (c & 8) << 28)


# Triton versions of the helpers above (same operations, same order).


@jit
def e4m3_round_tl(a):
    """Nearest E4M3 magnitude of ``0 <= a <= 448`` (ties to even): ``(code, value)``.

    The integer rounding of :func:`e4m3_encode`. A normal result rounds the fp32 pattern to
    3 mantissa bits (a carry bumps the exponent); its value is that pattern with the low 20
    bits cleared. A subnormal one is the nearest multiple of 2^-9: adding 2^23 to
    ``a * 512`` (< 8 there) leaves a unit last place, so the fp32 addition itself rounds to
    the nearest integer, ties to even. The value comes out of the rounding itself instead
    of decoding the code.
    """
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # 3 mantissa bits, ties to even
    steps = (a * 512.0 + 8388608.0) - 8388608.0  # subnormal: nearest multiple of 2^-9, ties to even
    normal = bits >= (121 << 23)  # a >= 2^-6
    code = tl.where(normal, (rounded >> 20) - (120 << 3), steps.to(tl.int32))
    value = tl.where(normal, (rounded & -1048576).to(tl.float32, bitcast=True), steps * 0.001953125)
    return code, value


@jit
def e4m3_encode_tl(v):
    """:func:`e4m3_encode`: E4M3 codes (int32) of fp32 values, saturating at +-448."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    code, _ = e4m3_round_tl(tl.abs(v))
    return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)


@jit
def e4m3_encode_hw_tl(v):
    """:func:`e4m3_encode_tl` through the hardware conversion (sm_89+: ``cvt.rn.satfinite.e4m3x2.f32``).

    Round to nearest even with saturation at +-448, the same codes for every finite
    input (the clamp first keeps it independent of how the hardware saturates).
    """
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@jit
def e4m3_decode_tl(code):
    c = code.to(tl.int32)
    f = (c >> 3) & 0xF
    m = c & 7
    normal = (((f + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(f > 0, normal, m.to(tl.float32) * 0.001953125)
    return (mag.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@jit
def rne_int_tl(w):
    ip = w.to(tl.int32)
    frac = w - ip.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((ip & 1) == 1))
    return ip + up.to(tl.int32)


@jit
def e2m1_encode_tl(y):
    """E2M1 code of ``y`` in the low 4 bits; bits 24-30 hold junk (0x4B), so keep the low
    byte (``.to(tl.uint8)``) or mask, as the packing does anyway.

    Same codes as the seven comparisons of :func:`e2m1_encode`, mostly on the FMA pipe
    (Hopper's integer/compare ALU pipe runs at half rate and bound the kernel). The index
    of ``a = |y|`` is RNE(f(a)) with the concave piecewise-linear
    ``f(a) = min(2a, a + 2, a/2 + 4, 7)``: grid spacing 0.5 below 2, 1 up to 4, 2 up to 6,
    and every midpoint lands on a half-integer whose even neighbour is the even code. RNE
    is monotone, so it is the min of RNE of each line, and ``fma(a, s, 2^23 + c)`` rounds
    a line exactly once to an integer (the unit in the last place of [2^23, 2^24) is 1):
    the fp32 pattern of the result is ``0x4B000000 + index``. The sign bit is ``y``'s (a
    small negative value gives -0), OR-ed into bit 3, which the index never sets.
    """
    a = tl.abs(y)
    c = tl.minimum(tl.fma(a, 2.0, 8388608.0), tl.fma(a, 1.0, 8388610.0))
    c = tl.minimum(tl.minimum(c, tl.fma(a, 0.5, 8388612.0)), 8388615.0)
    return c.to(tl.int32, bitcast=True) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@jit
def e2m1_decode_tl(code):
    # Built from bits instead of arithmetic: for magnitude index i = 2e + m >= 2 the value
    # 2^(e-1) * (1 + m/2) is the fp32 pattern ((i + 252) << 22) (1.0 = 254 << 22); index 1
    # is the subnormal 0.5 (0x3F000000) and 0 is 0. The same values as :func:`e2m1_decode`.
    c = code.to(tl.int32)
    i = c & 7
    mag = tl.where(i < 2, i * 0x3F000000, (i + 252) << 22)
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@jit
def block_scale_code_tl(ratio, block_amax):
    """E4M3 block scale for a block whose ideal scale is ``ratio`` (>= 0): ``(code, value)``.

    The rules of :func:`block_scale_e4m3`: round to nearest even (:func:`e4m3_round_tl`),
    saturate at 448, at least the smallest subnormal (code 1, 2^-9), and 1.0 (code 0x38)
    for an all-zero block. Always integer arithmetic: the hardware conversion gave wrong codes for
    these per-block vectors at some tile shapes (Triton 3.6, H200), never for full tiles.
    """
    code, value = e4m3_round_tl(tl.minimum(ratio, 448.0))
    nonzero = block_amax > 0
    return tl.where(nonzero, tl.maximum(code, 1), 0x38), tl.where(nonzero, tl.maximum(value, 0.001953125), 1.0)


@jit
def recip_tl(x):
    """``1 / x`` correctly rounded (IEEE division, as torch's ``1 / x``): kernels divide once
    per scale and multiply every value by the result, because a division per value costs
    more than moving the value through memory."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@jit
def max_nan_tl(a, b):
    """Combine function of a max reduction that keeps NaN (plain ``tl.max`` may drop it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def min_nan_tl(a, b):
    """Combine function of a min reduction that keeps NaN."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


#: Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` when kvcompose was imported).
INTERPRETED = tl.constexpr(interpreted(max_nan_tl)) if tl is not None else False


@jit
def max_keep_nan_tl(x, axis: tl.constexpr, KEEP: tl.constexpr):
    """``max`` of fp32 ``x`` along ``axis``, NaN kept (:func:`max_nan_tl` as the combine function). The
    interpreter runs a reduction with a function of ours one element at a time in Python
    (seconds per launch at the test suite's shapes), so there it takes NumPy's max and a
    separate NaN test instead: the same values (a zero's sign may differ)."""
    if INTERPRETED:
        nan = tl.max((x != x).to(tl.int32), axis, keep_dims=KEEP)
        rest = tl.max(tl.where(x == x, x, float("-inf")), axis, keep_dims=KEEP)  # NumPy warns on all-NaN rows
        return tl.where(nan != 0, float("nan"), rest)
    else:
        return tl.reduce(x, axis, max_nan_tl, keep_dims=KEEP)


@jit
def min_keep_nan_tl(x, axis: tl.constexpr, KEEP: tl.constexpr):
    """``min`` along ``axis``, NaN kept (as :func:`max_keep_nan_tl`)."""
    if INTERPRETED:
        nan = tl.max((x != x).to(tl.int32), axis, keep_dims=KEEP)
        rest = tl.min(tl.where(x == x, x, float("inf")), axis, keep_dims=KEEP)
        return tl.where(nan != 0, float("nan"), rest)
    else:
        return tl.reduce(x, axis, min_nan_tl, keep_dims=KEEP)
