"""Triton helpers that decode a tile of keys or values where they lie, one branch per storage format.

:func:`_decode_parts` loads the codes and scales of ``N`` slots of one head and returns the
values split by channel residue (the ``j``-th code of every packed byte). Compiled, the
exact formats (``EXACT_FORMATS``: fp8, nvfp4, ternary) are decoded by inline PTX into
fp16 tiles for the tensor cores; the interpreter and the other formats use the formats'
reference arithmetic in fp32. :func:`_kivi_key_scores` scores KIVI keys without decoding
them, and :func:`_operand` rounds a tile to what the dot takes.
"""

from __future__ import annotations

from ..numerics import e2m1_decode_tl, e4m3_decode_tl
from ..triton_shim import HAS_TRITON, jit, tl


@jit
def _spread(x, N: tl.constexpr, UNITS: tl.constexpr, REPEAT: tl.constexpr):
    """``[N, UNITS]`` -> ``[N, UNITS * REPEAT]``, each column repeated ``REPEAT`` times in place
    (a block or group scale spread over the packed columns it covers)."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], [N, UNITS, REPEAT]), [N, UNITS * REPEAT])


@jit
def _ternary_level(c):
    """+1, 0 or -1 from the low two bits of ``c`` (code 1: +1, code 2: -1, codes 0 and 3: 0)."""
    return ((c & 3) == 1).to(tl.float32) - ((c & 3) == 2).to(tl.float32)


@jit
def _e4m3_values(code, NATIVE: tl.constexpr):
    """fp32 values of E4M3 bytes: the hardware conversion when compiled (the same values for
    every code the encoders write), :func:`e4m3_decode_tl` in the interpreter."""
    if NATIVE:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return e4m3_decode_tl(code)


# Compiled decode of the block-scaled formats, four packed bytes per call. Both build E4M3
# bytes with 32-bit integer operations (four codes at once) and let the hardware convert
# them to fp16 pairs; an E4M3 byte holds each code's value exactly: NVFP4's sign,
# exponent and mantissa bits move into an E4M3 byte whose value is the E2M1 value times
# 2^-6 (the caller folds 2^6 into the block scale), a ternary code becomes E4M3 +1, -1 or 0.
# The block scale multiply is an fp16 multiply whose product is exact (see ``EXACT_FORMATS``).
_FP4_ASM_TEXT = """{
.reg .b32 lo, hi, t, u;
.reg .b16 l0, l1, h0, h1;
shl.b32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
shl.b32 u, $4, 4;
and.b32 u, u, 0x80808080;
or.b32 lo, t, u;
shr.b32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $4, 0x80808080;
or.b32 hi, t, u;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $6;
}"""


def _ternary_part_asm(j: int) -> str:
    # code c (2 bits) -> nonzero = c ^ (c >> 1) (codes 1, 2), E4M3 1.0 is 0x38, sign = code 2
    return f"""shr.b32 x, $8, {2 * j};
and.b32 x, x, 0x03030303;
shr.b32 t, x, 1;
xor.b32 t, t, x;
and.b32 t, t, 0x01010101;
shl.b32 s, t, 7;
shl.b32 u, x, 6;
and.b32 s, s, u;
mul.lo.u32 t, t, 0x38;
or.b32 t, t, s;
mov.b32 {{e0, e1}}, t;
cvt.rn.f16x2.e4m3x2 ${2 * j}, e0;
cvt.rn.f16x2.e4m3x2 ${2 * j + 1}, e1;
mul.rn.f16x2 ${2 * j}, ${2 * j}, $9;
mul.rn.f16x2 ${2 * j + 1}, ${2 * j + 1}, $10;
"""


_TERNARY_ASM_TEXT = "{\n.reg .b32 x, t, s, u;\n.reg .b16 e0, e1;\n" + "".join(map(_ternary_part_asm, range(4))) + "}"
# jit functions read module globals only as constexprs
_FP4_ASM = tl.constexpr(_FP4_ASM_TEXT) if HAS_TRITON else None
_TERNARY_ASM = tl.constexpr(_TERNARY_ASM_TEXT) if HAS_TRITON else None


@jit
def _nvfp4_exact_tiles(byte, scale):
    """fp16 ``(low-nibble, high-nibble)`` values of NVFP4 bytes times their block scale
    (``scale``: fp16 block scale times 2^6, one per byte)."""
    return tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@jit
def _ternary_exact_tiles(byte, scale):
    """fp16 values of the four ternary codes of each byte times its block scale."""
    return tl.inline_asm_elementwise(_TERNARY_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [byte, scale],
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)


@jit
def _kivi_part(byte, scale_ptr, min_ptr, at, m, j: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr):
    """Channels ``PER * i + j`` of channel-grouped INT codes: ``q * scale + minimum`` of each channel."""
    ok = m & (j < PER)
    q = ((byte >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    return q * tl.load(scale_ptr + at + j, mask=ok, other=0.0).to(tl.float32) \
        + tl.load(min_ptr + at + j, mask=ok, other=0.0).to(tl.float32)


@jit
def _kivi_key_scores(q0, q1, q2, q3, codes_ptr, scale_ptr, min_ptr, table_ptr, row, W, t0, end, slot, row_at, ok,
                     head, H: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, TG: tl.constexpr,
                     PER: tl.constexpr, BS: tl.constexpr, N: tl.constexpr, OUT: tl.constexpr, NATIVE: tl.constexpr,
                     PREC: tl.constexpr):
    """Scores ``[GP, N]`` of KIVI keys without dequantizing them. The tile's ``N`` slots lie
    in one token group (``N <= TG``, :func:`_folds`), so ``q . (code * scale + min) =
    (q * scale) . code + q . min``: the group's scale goes into the queries (one
    ``[GP, D / PER]`` product per part), its minimum into one bias, and the codes reach the
    dot as exact small integers (no per-element scale, minimum or multiply-add)."""
    DQ: tl.constexpr = D // PER
    i = tl.arange(0, DQ)
    byte = tl.load(codes_ptr + row_at[:, None] * DQ + i[None, :], mask=ok[:, None], other=0).to(tl.int32)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    c0 = _operand((byte & LEVELS).to(tl.float32), False, OUT, NATIVE)
    c1 = c0
    c2 = c0
    c3 = c0
    if PER > 1:
        c1 = _operand(((byte >> BITS) & LEVELS).to(tl.float32), False, OUT, NATIVE)
    if PER > 2:
        c2 = _operand(((byte >> (2 * BITS)) & LEVELS).to(tl.float32), False, OUT, NATIVE)
        c3 = _operand(((byte >> (3 * BITS)) & LEVELS).to(tl.float32), False, OUT, NATIVE)
    blk = tl.load(table_ptr + row * W + t0 // BS, mask=t0 < end, other=-1).to(tl.int64)
    live = (t0 < end) & (blk >= 0)  # else the tile's tokens are all masked: read no scales
    here = tl.full([DQ], 1, tl.int1) & live
    at = ((tl.maximum(blk * BS + t0 % BS, 0) // TG) * H + head) * D + PER * i
    s, bias = _kivi_folded_part(q0, c0, scale_ptr, min_ptr, at, here, 0, OUT, NATIVE, PREC)
    if PER > 1:
        part, lift = _kivi_folded_part(q1, c1, scale_ptr, min_ptr, at, here, 1, OUT, NATIVE, PREC)
        s += part
        bias += lift
    if PER > 2:
        part, lift = _kivi_folded_part(q2, c2, scale_ptr, min_ptr, at, here, 2, OUT, NATIVE, PREC)
        s += part
        bias += lift
        part, lift = _kivi_folded_part(q3, c3, scale_ptr, min_ptr, at, here, 3, OUT, NATIVE, PREC)
        s += part
        bias += lift
    return s + bias[:, None]


@jit
def _kivi_folded_part(q, c, scale_ptr, min_ptr, at, here, j: tl.constexpr, OUT: tl.constexpr,
                      NATIVE: tl.constexpr, PREC: tl.constexpr):
    """Part ``j`` of the tile's channels: its scores ``(q * scale) . codes`` ``[GP, N]`` and bias ``q . min`` ``[GP]``."""
    qf = q.to(tl.float32)
    qs = _operand(qf * tl.load(scale_ptr + at + j, mask=here, other=0.0).to(tl.float32)[None, :], False, OUT, NATIVE)
    lift = tl.sum(qf * tl.load(min_ptr + at + j, mask=here, other=0.0).to(tl.float32)[None, :], 1)
    return tl.dot(qs, tl.trans(c), input_precision=PREC), lift


@jit
def _head_scale(hs_ptr, row, head, FMT: tl.constexpr, H: tl.constexpr):
    """The second-level scale of one (row, KV head) for the formats that have one, else 1.
    Constant over the program: it multiplies the dot products (keys) or the finished output
    (values) instead of every decoded element."""
    if FMT == 1 or FMT == 2 or FMT == 3:
        return tl.load(hs_ptr + row * H + head)
    return 1.0


@jit
def _decode_parts(codes_ptr, scale_ptr, min_ptr, slot, row_at, head, ok,
                  FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                  TG: tl.constexpr, PER: tl.constexpr, N: tl.constexpr, EXACT: tl.constexpr, NATIVE: tl.constexpr):
    """Values of ``N`` slots of one head before the head scale (:func:`_head_scale`), split by
    channel residue: part ``j`` ``[N, D / PER]`` holds channels ``PER * i + j``, the ``j``-th
    code of every packed byte (parts ``>= PER`` repeat part 0 and are unused). Each byte,
    block scale and group scale is loaded once. Compiled, dense values stay in their dtype
    and ``EXACT`` formats come out in fp16 (exact); the rest, and everything in the
    interpreter, is fp32 from the formats' reference dequantize arithmetic."""
    DQ: tl.constexpr = D // PER
    FAST: tl.constexpr = EXACT and NATIVE
    i = tl.arange(0, DQ)
    m = ok[:, None]
    base = row_at[:, None]  # [N, 1] int64 (token, head) row of the per-slot tensors
    if FMT == 0:  # already in the model dtype (checked): compiled, it goes to the dot as loaded
        x0 = tl.load(codes_ptr + base * D + i[None, :], mask=m, other=0.0)
        if not NATIVE:
            x0 = x0.to(tl.float32)
        x1 = x0
        x2 = x0
        x3 = x0
    elif FMT == 1:
        c = tl.load(codes_ptr + base * D + i[None, :], mask=m, other=0)
        if FAST:
            x0 = c.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            x0 = _e4m3_values(c, NATIVE)
        x1 = x0
        x2 = x0
        x3 = x0
    elif FMT == 2 or FMT == 3:
        byte = tl.load(codes_ptr + base * DQ + i[None, :], mask=m, other=0)
        b = tl.arange(0, D // 16)
        bs = _e4m3_values(tl.load(scale_ptr + base * (D // 16) + b[None, :], mask=m, other=0), NATIVE)
        if FAST:
            if FMT == 2:
                x0, x1 = _nvfp4_exact_tiles(byte, _spread((bs * 64.0).to(tl.float16), N, D // 16, 16 // PER))
                x2 = x0
                x3 = x0
            else:
                x0, x1, x2, x3 = _ternary_exact_tiles(byte, _spread(bs.to(tl.float16), N, D // 16, 16 // PER))
        else:
            byte = byte.to(tl.int32)
            scale = _spread(bs, N, D // 16, 16 // PER)
            if FMT == 2:
                x0 = e2m1_decode_tl(byte & 15) * scale
                x1 = e2m1_decode_tl(byte >> 4) * scale
                x2 = x0
                x3 = x0
            else:
                x0 = _ternary_level(byte) * scale
                x1 = _ternary_level(byte >> 2) * scale
                x2 = _ternary_level(byte >> 4) * scale
                x3 = _ternary_level(byte >> 6) * scale
    else:
        byte = tl.load(codes_ptr + base * DQ + i[None, :], mask=m, other=0).to(tl.int32)
        LEVELS: tl.constexpr = (1 << BITS) - 1
        if FMT == 4:  # one (scale, minimum) per GROUP channels of the token
            g = tl.arange(0, D // GROUP)
            at = base * (D // GROUP) + g[None, :]
            sc = _spread(tl.load(scale_ptr + at, mask=m, other=0.0).to(tl.float32), N, D // GROUP, GROUP // PER)
            lo = _spread(tl.load(min_ptr + at, mask=m, other=0.0).to(tl.float32), N, D // GROUP, GROUP // PER)
            x0 = (byte & LEVELS).to(tl.float32) * sc + lo
            x1 = ((byte >> BITS) & LEVELS).to(tl.float32) * sc + lo
            x2 = ((byte >> (2 * BITS)) & LEVELS).to(tl.float32) * sc + lo
            x3 = ((byte >> (3 * BITS)) & LEVELS).to(tl.float32) * sc + lo
        else:  # KIVI keys: per channel, shared by the TG slots of a token group
            at = ((slot[:, None] // TG) * H + head) * D + PER * i[None, :]
            x0 = _kivi_part(byte, scale_ptr, min_ptr, at, m, 0, BITS, PER)
            x1 = _kivi_part(byte, scale_ptr, min_ptr, at, m, 1, BITS, PER)
            x2 = _kivi_part(byte, scale_ptr, min_ptr, at, m, 2, BITS, PER)
            x3 = _kivi_part(byte, scale_ptr, min_ptr, at, m, 3, BITS, PER)
    return x0, x1, x2, x3


@jit
def _operand(x, EXACT: tl.constexpr, OUT: tl.constexpr, NATIVE: tl.constexpr):
    """A tile as the dot takes it: ``EXACT`` tiles are fp16 already (compiled) or exact fp32
    (interpreter) and pass unchanged; the rest is rounded to the model dtype as the dense
    view is (in that dtype when compiled; the interpreter keeps the rounded values in fp32,
    its bf16 arithmetic is not reliable and a dot of the rounded values is the same)."""
    r = x
    if EXACT:
        pass
    elif NATIVE:  # the hardware conversion rounds to nearest even, as torch's does
        if OUT == 1:
            r = x.to(tl.bfloat16)
        elif OUT == 2:
            r = x.to(tl.float16)
    elif OUT == 1:
        bits = x.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif OUT == 2:
        r = x.to(tl.float16).to(tl.float32)
    return r


@jit
def _fp16(x, NATIVE: tl.constexpr):
    """``x`` rounded to fp16 (kept in fp32 by the interpreter)."""
    r = x.to(tl.float16)
    if not NATIVE:
        r = r.to(tl.float32)
    return r
