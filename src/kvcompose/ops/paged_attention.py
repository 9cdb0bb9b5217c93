"""Decode attention that reads the paged store in place, every storage format decoded in registers.

One decode step has one query per row (``[B, Hq, 1, D]``). The kept tokens of a layer
live in *sources*: a pool of blocks in one storage format, addressed per row through a
block table, with a validity bit per slot (evicted, padding and empty slots are off),
plus the dense recent buffer as one more source. :func:`paged_decode_attention` runs:

1. one launch of :func:`_paged_partial_kernel` for all sources: a program per (row, KV
   head, split of a source's tokens) decodes a tile of keys and values where they lie (the
   values of the format's reference dequantize: exact in fp16 for ``EXACT_FORMATS``,
   otherwise rounded to the query dtype as the dense view is), scores every query head
   of the KV head's group against it with tensor-core dots, and keeps an online
   softmax; it writes a partial output and its log-sum-exp. Split-KV keeps the GPU busy
   at batch 1 with long rows; short sources (the buffer) ride on a program of a long one;
2. one launch of :func:`_merge_kernel`, which combines the partial results of all
   splits of all sources by their log-sum-exp.

Evictors that accumulate attention every step (``h2o``) pass ``mass``: the partial
kernel writes each valid slot's logit (base 2) in the same pass, and one more launch per
source, :func:`_mass_kernel`, turns them into probabilities against the merged
log-sum-exp, averages them over the query heads and adds the result to the slot's
channel where it lies, so the keys are never read twice and no ``[B, Hq, L]``
probabilities reach torch. ``probs=True`` returns the probabilities instead.

Formats (``KVOperand.fmt``): ``dense`` (bf16/fp16/fp32 as stored), ``fp8`` (E4M3 codes
times a per-(row, head) scale), ``nvfp4`` and ``ternary`` (codes, an E4M3 scale per 16
channels, a per-(row, head) second-level scale), ``int`` (asymmetric INT-k with a
scale and minimum per channel group of one token) and ``int_channel`` (KIVI keys:
scale and minimum per channel over ``token_group`` consecutive slots of a block).
:func:`paged_decode_attention_torch` is the plain-torch reference: it dequantizes each
source with the formats' reference functions, concatenates, and runs softmax attention
with the validity mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device_constants import device_constant
from .attention_launch import PROGRAMS_PER_SM, TILE_SHAPE, plan_splits, resident_programs
from .dispatch import step_kernel_runs
from .layout import OUT_KINDS, out_buffer, store_out_tl, unpack_codes
from .numerics import e2m1_decode_tl, e4m3_decode_tl
from .triton_shim import HAS_TRITON, cdiv, interpreted, jit, next_pow2, tl
from .quant_fp8 import fp8_dequantize_torch
from .quant_int import int_token_dequantize_torch
from .quant_nvfp4 import nvfp4_dequantize_torch
from .quant_ternary import ternary_dequantize_torch

#: Storage formats the op decodes, and their kernel codes (``FMT`` constexpr).
FORMATS = {"dense": 0, "fp8": 1, "nvfp4": 2, "ternary": 3, "int": 4, "int_channel": 5}
#: Codes per byte of the packed formats (``int`` and ``int_channel``: ``8 // bits``).
#: Formats whose every stored value times its block scale is exact in fp16 (an E4M3 value,
#: or an E2M1 or ternary level times an E4M3 block scale: at most 6 significant bits, and
#: within fp16's normal range): with a bf16 or fp16 model the kernel feeds these tiles to
#: the tensor cores in fp16, with the queries in fp16 after a power-of-two shift per
#: program (exact for a bf16 query) and the probabilities in fp16, and applies the
#: per-(row, head) scale to the dot products in fp32. The reference rounds each decoded
#: value to the model dtype instead; the kernel's products are the exact ones.
EXACT_FORMATS = ("fp8", "nvfp4", "ternary")
_PER_BYTE = {"dense": 1, "fp8": 1, "nvfp4": 2, "ternary": 4}
SMALL_SOURCE_TOKENS = 64  # sources with at most this many columns per row: light tile, ride on another's program
SMALL_TILE = 16  # tokens per tile of those
SMALL_STAGES = 1  # and their software-pipelining depth
MASS_BLOCK = 128  # tokens per program of the attention-mass kernel
MERGE_CHUNK = 16  # partial results the merge combines per step
MERGE_ROWS = 256  # below this many (row, query head) pairs the merge slices the channels:
MERGE_SLICE = 32  # this many per program. H200, 1 x 32K (32 pairs of 128 splits): 6-10% off the
MERGE_WARPS = 1  # whole op; 64 x 4K: 1-2% slower sliced, so large batches merge whole rows.
WARPS = 2  # of the attention-mass kernel (the merge's: MERGE_WARPS)
STAGES = 3  # software-pipelining depth of the partial kernel's loads (Triton's default)
MAX_REGISTERS = None  # registers per thread of the partial kernel (None: the compiler's choice)
LOG2E = 1.4426950408889634


@dataclass
class KVOperand:
    """Keys or values of one source in their storage format.

    ``codes``: per-slot payload ``[slots, H, D / codes per byte]`` (``dense``: the values
    themselves ``[slots, H, D]``). ``scale``/``minimum``: ``nvfp4``/``ternary`` E4M3 block
    scales ``[slots, H, D/16]`` (no minimum); ``int`` fp16/fp32 ``[slots, H, D/group]``;
    ``int_channel`` ``[slots / token_group, H, D]``. ``head_scale``: fp32 ``[B, H]``
    second-level scale of each row and head (``fp8``, ``nvfp4``, ``ternary``).
    """

    fmt: str
    codes: torch.Tensor
    scale: torch.Tensor | None = None
    minimum: torch.Tensor | None = None
    head_scale: torch.Tensor | None = None
    bits: int = 0
    token_group: int = 1

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown KV storage format {self.fmt!r}; accepted: {', '.join(FORMATS)}")
        if self.fmt.startswith("int") and self.bits not in (2, 4, 8):
            raise ValueError(f"{self.fmt} operand: bits={self.bits!r}; accepted: 2, 4, 8")
        needs = {"fp8": ("head_scale",), "nvfp4": ("scale", "head_scale"), "ternary": ("scale", "head_scale"),
                 "int": ("scale", "minimum"), "int_channel": ("scale", "minimum")}.get(self.fmt, ())
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{self.fmt} operand needs {', '.join(missing)}")

    @property
    def per_byte(self) -> int:
        return 8 // self.bits if self.fmt.startswith("int") else _PER_BYTE[self.fmt]

    def head_dim(self) -> int:
        return self.codes.shape[-1] * self.per_byte


@dataclass
class PagedSource:
    """One pool's worth of a layer's kept tokens: row ``b``'s token ``t`` lives in slot
    ``table[b, t // block_size] * block_size + t % block_size`` (table entry -1: no block);
    a slot takes part only where ``valid[slot]`` is set."""

    key: KVOperand
    value: KVOperand
    table: torch.Tensor  # [B, W] integer block ids
    block_size: int
    valid: torch.Tensor  # [slots] bool

    @property
    def tokens(self) -> int:
        """Token columns per row (``W * block_size``)."""
        return self.table.shape[1] * self.block_size

    def slots(self) -> torch.Tensor:
        """``[B, tokens]`` slot of every token column, -1 where the block is missing."""
        bs = self.block_size
        t = torch.arange(self.tokens, device=self.table.device)
        blk = self.table.long()[:, t // bs]
        return torch.where(blk >= 0, blk * bs + t % bs, -1)


# ---------------------------------------------------------------------------
# Plain-torch reference


def decode_operand_torch(op: KVOperand, slots: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values ``[M, H, D]`` of the given slots (``rows``: the batch row of each), rounded to ``dtype``."""
    if op.fmt == "dense":
        return op.codes[slots].to(dtype)
    if op.fmt == "fp8":
        x = fp8_dequantize_torch(op.codes[slots], op.head_scale[rows])
    elif op.fmt == "nvfp4":
        x = nvfp4_dequantize_torch(op.codes[slots], op.scale[slots], op.head_scale[rows])
    elif op.fmt == "ternary":
        x = ternary_dequantize_torch(op.codes[slots], op.scale[slots], op.head_scale[rows])
    elif op.fmt == "int":
        x = int_token_dequantize_torch(op.codes[slots], op.scale[slots], op.minimum[slots], op.bits)
    else:  # int_channel: the scale and minimum of the slot's token group
        group = slots // op.token_group
        q = unpack_codes(op.codes[slots], op.bits).to(torch.float32)
        x = q * op.scale[group].to(torch.float32) + op.minimum[group].to(torch.float32)
    return x.to(dtype)


def dense_source_view(src: PagedSource, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ``[B, H, L, D]`` and validity ``[B, L]`` of one source, decoded to ``dtype``."""
    slots = src.slots()
    B, L = slots.shape
    ok = slots >= 0
    flat = slots.clamp(min=0).reshape(-1)
    rows = torch.arange(B, device=slots.device).repeat_interleave(L)
    k = decode_operand_torch(src.key, flat, rows, dtype)
    v = decode_operand_torch(src.value, flat, rows, dtype)
    valid = ok & src.valid[flat].reshape(B, L)
    shape = (B, L, *k.shape[1:])
    return k.reshape(shape).transpose(1, 2), v.reshape(shape).transpose(1, 2), valid


def add_mass_torch(sources: list[PagedSource], mass: tuple[list[torch.Tensor], torch.Tensor],
                   probs: torch.Tensor) -> None:
    """Reference of the ``mass`` output: add ``weight[b]`` times the probabilities ``[B, Hq, L]``
    averaged over the query heads to each source's flat per-slot channel (fixed shapes: a
    missing block adds zero to slot 0)."""
    channels, weight = mass
    delta = probs.float().mean(dim=1) * weight.float()[:, None]
    col = 0
    for src, channel in zip(sources, channels):
        slots = src.slots()
        d = delta[:, col:col + slots.shape[1]]
        channel.index_add_(0, slots.clamp(min=0).reshape(-1), torch.where(slots >= 0, d, 0.0).reshape(-1))
        col += slots.shape[1]


def paged_decode_attention_torch(query: torch.Tensor, sources: list[PagedSource], scaling: float,
                                 return_probs: bool = False, mass=None):
    """Reference: dequantize each source, concatenate, softmax attention with the validity mask.

    Returns ``[B, Hq, 1, D]`` in the query dtype (rows with no valid token get zeros) and,
    with ``return_probs``, the probabilities ``[B, Hq, L]`` over the concatenated columns.
    ``mass``: see :func:`paged_decode_attention`.
    """
    B, Hq, _, D = query.shape
    parts = [dense_source_view(s, query.dtype) for s in sources]
    keys = torch.cat([p[0] for p in parts], dim=2)
    values = torch.cat([p[1] for p in parts], dim=2)
    valid = torch.cat([p[2] for p in parts], dim=1)
    group = Hq // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    logits = (query.float() @ k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(-1), nan=0.0)  # a row with nothing valid attends to nothing
    out = (probs @ v).to(query.dtype)
    if mass is not None:
        add_mass_torch(sources, mass, probs[:, :, 0])
    return (out, probs[:, :, 0]) if return_probs else out


# ---------------------------------------------------------------------------
# Triton kernels


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
# The block scale multiply is an fp16 multiply whose product is exact (see _EXACT_NOTE).
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
def _kivi_key_scores(q0, q1, q2, q3, codes_ptr, scale_ptr, min_ptr, table_ptr, row, W, t0, end, slot, head, ok,
                     H: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, TG: tl.constexpr,
                     PER: tl.constexpr, BS: tl.constexpr, N: tl.constexpr, OUT: tl.constexpr, NATIVE: tl.constexpr,
                     PREC: tl.constexpr):
    """Scores ``[GP, N]`` of KIVI keys without dequantizing them. The tile's ``N`` slots lie
    in one token group (``N <= TG``, :func:`_folds`), so ``q . (code * scale + min) =
    (q * scale) . code + q . min``: the group's scale goes into the queries (one
    ``[GP, D / PER]`` product per part), its minimum into one bias, and the codes reach the
    dot as exact small integers (no per-element scale, minimum or multiply-add)."""
    DQ: tl.constexpr = D // PER
    i = tl.arange(0, DQ)
    byte = tl.load(codes_ptr + (slot[:, None] * H + head) * DQ + i[None, :], mask=ok[:, None], other=0).to(tl.int32)
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
def _decode_parts(codes_ptr, scale_ptr, min_ptr, slot, head, ok,
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
    base = slot[:, None] * H + head  # [N, 1] int64 (token, head) row of the pool
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


@jit
def _query_part(q_ptr, qrow, gm, j: tl.constexpr, PER: tl.constexpr, D: tl.constexpr):
    """Channels ``PER * i + j`` of the group's queries ``[GP, D / PER]``, fp32."""
    i = tl.arange(0, D // PER)
    return tl.load(q_ptr + qrow[:, None] * D + PER * i[None, :] + j, mask=gm[:, None], other=0.0).to(tl.float32)


@jit
def _query_shift(amax):
    """The power of two that brings ``amax`` (the largest query magnitude of the program)
    into [2^14, 2^15): multiplied by it, a bf16 query is exact in fp16 (fp16 has the wider
    mantissa) down to elements 2^-28 of the largest. 1 for a non-finite ``amax``."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    shift = (tl.minimum(268 - e, 254) << 23).to(tl.float32, bitcast=True)  # 2^(14 - (e - 127))
    return tl.where(e < 255, shift, 1.0)


@jit
def _max_abs(x0, x1, x2, x3):
    return tl.maximum(tl.maximum(tl.max(tl.abs(x0)), tl.max(tl.abs(x1))),
                      tl.maximum(tl.max(tl.abs(x2)), tl.max(tl.abs(x3))))


#: Fields of one source's runtime tuple in a :func:`_paged_partial_kernel` launch.
SOURCE_FIELDS = ("table", "valid", "key codes", "key scale", "key minimum", "key head scale", "value codes",
                 "value scale", "value minimum", "value head scale", "table width", "tokens per split",
                 "first program", "programs", "first partial result", "first column")


@jit
def _paged_partial_kernel(q_ptr, out_ptr, lse_ptr, score_ptr, total_splits, total_cols, qk_scale, sources,
                          CONSTS: tl.constexpr, NSRC: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                          GP: tl.constexpr, D: tl.constexpr, SCORES: tl.constexpr, PREC: tl.constexpr,
                          OUT: tl.constexpr, NATIVE: tl.constexpr):
    """Partial attention of one (row, KV head) over some splits of a layer's sources, all
    sources in one launch.

    Source ``i`` (runtime fields ``SOURCE_FIELDS``, compile-time constants ``CONSTS[i]``)
    runs its splits on ``sources[i][13]`` programs from ``program_id(1) == sources[i][12]``
    on and writes them as partial results from ``sources[i][14]`` on. A short source (the
    recent buffer) rides on a program of a long one: both branches run there one after
    the other, so it adds no program and no wave to the launch. Each branch is one source's
    loop specialized to its format; the compiled kernel takes the registers and shared
    memory of its largest branch, not their sum."""
    split = tl.program_id(1)
    for i in tl.static_range(NSRC):
        src = sources[i]
        if (split >= src[12]) & (split < src[12] + src[13]):
            local = split - src[12]
            _source_partial(q_ptr, out_ptr, lse_ptr, score_ptr, src[0], src[1], src[2], src[3], src[4], src[5],
                            src[6], src[7], src[8], src[9], src[10], src[11], local, src[14] + local, total_splits,
                            src[15], total_cols, qk_scale,
                            CONSTS[i][0], CONSTS[i][1], CONSTS[i][2], CONSTS[i][3], CONSTS[i][4], CONSTS[i][5],
                            CONSTS[i][6], CONSTS[i][7], CONSTS[i][8], CONSTS[i][9], CONSTS[i][10], CONSTS[i][11],
                            H, G, GP, D, CONSTS[i][12], CONSTS[i][13], CONSTS[i][14], SCORES, PREC, OUT, NATIVE)


#: Order of a source's compile-time constants in ``CONSTS`` (see :func:`_partial_launch`).
SOURCE_CONSTS = ("KFMT", "VFMT", "KBITS", "VBITS", "KGROUP", "VGROUP", "KTG", "KPER", "VPER", "KEX", "VEX", "KFOLD",
                 "BS", "BLOCK", "STAGES")


@jit
def _source_partial(
    q_ptr, out_ptr, lse_ptr, score_ptr, table_ptr, valid_ptr,
    kc_ptr, ks_ptr, km_ptr, khs_ptr, vc_ptr, vs_ptr, vm_ptr, vhs_ptr,
    W, tokens_per_split, local_split, out_split, total_splits, col0, total_cols, qk_scale,
    KFMT: tl.constexpr, VFMT: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KGROUP: tl.constexpr, VGROUP: tl.constexpr, KTG: tl.constexpr, KPER: tl.constexpr, VPER: tl.constexpr,
    KEX: tl.constexpr, VEX: tl.constexpr, KFOLD: tl.constexpr,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, SCORES: tl.constexpr, PREC: tl.constexpr,
    OUT: tl.constexpr, NATIVE: tl.constexpr,
):
    """Partial attention of one (row, KV head, split) of one source: output ``[G, D]`` and
    log2-sum-exp ``[G]``, written as partial result ``out_split``.

    Keys and values come in channel parts (see :func:`_decode_parts`); the score is the sum
    of the parts' dots, and each value part accumulates its own output columns. ``KEX`` /
    ``VEX``: the keys / values are an exact format (see the module notes) and go to the
    tensor cores in fp16. ``KFOLD``: KIVI keys scored with their group scale folded into the
    queries (:func:`_kivi_key_scores`)."""
    pid = tl.program_id(0)
    row = pid // H
    head = pid % H
    g = tl.arange(0, GP)
    gm = g < G
    qrow = row * (H * G) + head * G + g  # the query heads of this KV head
    DV: tl.constexpr = D // VPER
    key_scale = qk_scale * _head_scale(khs_ptr, row, head, KFMT, H)
    q0 = _query_part(q_ptr, qrow, gm, 0, KPER, D)
    q1 = q0
    q2 = q0
    q3 = q0
    if KPER > 1:
        q1 = _query_part(q_ptr, qrow, gm, 1, KPER, D)
    if KPER > 2:
        q2 = _query_part(q_ptr, qrow, gm, 2, KPER, D)
        q3 = _query_part(q_ptr, qrow, gm, 3, KPER, D)
    if KEX:  # fp16 queries for fp16 key tiles, shifted by a power of two to fit fp16
        shift = _query_shift(_max_abs(q0, q1, q2, q3))
        key_scale = key_scale / shift
        q0 = _fp16(q0 * shift, NATIVE)
        q1 = _fp16(q1 * shift, NATIVE)
        q2 = _fp16(q2 * shift, NATIVE)
        q3 = _fp16(q3 * shift, NATIVE)
    else:
        q0 = _operand(q0, False, OUT, NATIVE)
        q1 = _operand(q1, False, OUT, NATIVE)
        q2 = _operand(q2, False, OUT, NATIVE)
        q3 = _operand(q3, False, OUT, NATIVE)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, DV], tl.float32)
    acc1 = tl.zeros([GP, DV], tl.float32)
    acc2 = tl.zeros([GP, DV], tl.float32)
    acc3 = tl.zeros([GP, DV], tl.float32)
    start = local_split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, W * BS)
    n = tl.arange(0, BLOCK)
    for t0 in tl.range(start, end, BLOCK, num_stages=STAGES):
        t = t0 + n
        inside = t < end
        blk = tl.load(table_ptr + row * W + t // BS, mask=inside, other=-1).to(tl.int64)
        slot = blk * BS + t % BS
        ok = inside & (blk >= 0)
        ok = ok & (tl.load(valid_ptr + slot, mask=ok, other=0) != 0)
        if KFOLD:
            s = _kivi_key_scores(q0, q1, q2, q3, kc_ptr, ks_ptr, km_ptr, table_ptr, row, W, t0, end, slot, head, ok,
                                 H, GP, D, KBITS, KTG, KPER, BS, BLOCK, OUT, NATIVE, PREC)
        else:
            k0, k1, k2, k3 = _decode_parts(kc_ptr, ks_ptr, km_ptr, slot, head, ok,
                                           KFMT, H, D, KBITS, KGROUP, KTG, KPER, BLOCK, KEX, NATIVE)
            s = tl.dot(q0, tl.trans(_operand(k0, KEX, OUT, NATIVE)), input_precision=PREC)
            if KPER > 1:
                s += tl.dot(q1, tl.trans(_operand(k1, KEX, OUT, NATIVE)), input_precision=PREC)
            if KPER > 2:
                s += tl.dot(q2, tl.trans(_operand(k2, KEX, OUT, NATIVE)), input_precision=PREC)
                s += tl.dot(q3, tl.trans(_operand(k3, KEX, OUT, NATIVE)), input_precision=PREC)
        s = tl.where(ok[None, :], s * key_scale, float("-inf"))  # [GP, BLOCK], log2 units
        if SCORES:
            tl.store(score_ptr + qrow[:, None] * total_cols + col0 + t[None, :], s, mask=gm[:, None] & inside[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if VEX:
            pm = _fp16(p, NATIVE)
        else:
            pm = _operand(p, False, OUT, NATIVE)
        v0, v1, v2, v3 = _decode_parts(vc_ptr, vs_ptr, vm_ptr, slot, head, ok,
                                       VFMT, H, D, VBITS, VGROUP, 1, VPER, BLOCK, VEX, NATIVE)
        acc0 = acc0 * alpha[:, None] + tl.dot(pm, _operand(v0, VEX, OUT, NATIVE), input_precision=PREC)
        if VPER > 1:
            acc1 = acc1 * alpha[:, None] + tl.dot(pm, _operand(v1, VEX, OUT, NATIVE), input_precision=PREC)
        if VPER > 2:
            acc2 = acc2 * alpha[:, None] + tl.dot(pm, _operand(v2, VEX, OUT, NATIVE), input_precision=PREC)
            acc3 = acc3 * alpha[:, None] + tl.dot(pm, _operand(v3, VEX, OUT, NATIVE), input_precision=PREC)
    at = qrow * total_splits + out_split
    tl.store(lse_ptr + at, tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf")), mask=gm)
    inv = _head_scale(vhs_ptr, row, head, VFMT, H) / tl.maximum(l_i, 1e-30)
    o = out_ptr + at[:, None] * D + VPER * tl.arange(0, DV)[None, :]
    tl.store(o, acc0 * inv[:, None], mask=gm[:, None])
    if VPER > 1:
        tl.store(o + 1, acc1 * inv[:, None], mask=gm[:, None])
    if VPER > 2:
        tl.store(o + 2, acc2 * inv[:, None], mask=gm[:, None])
        tl.store(o + 3, acc3 * inv[:, None], mask=gm[:, None])


@jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, final_lse_ptr, S, D: tl.constexpr, SP: tl.constexpr,
                  DP: tl.constexpr, OUT: tl.constexpr, CHUNK: tl.constexpr):
    """Combine the ``S`` partial results of one (row, query head) by their log2-sum-exp, for
    the ``DP`` output channels from ``program_id(1) * DP`` on: the weights from all ``S``
    log-sum-exps at once, the outputs ``CHUNK`` splits at a time (a ``[S, D]`` tile in
    registers spilled from 64 splits on). Slicing the channels over programs keeps the GPU
    busy when there are few rows and many splits (batch 1, long rows)."""
    pid = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * DP
    s = tl.arange(0, SP)
    lse = tl.load(lse_ptr + pid * S + s, mask=s < S, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m_safe), 0)
    c = tl.arange(0, CHUNK)
    d = first + tl.arange(0, DP)
    acc = tl.zeros([DP], tl.float32)
    for s0 in range(0, S, CHUNK):
        inside = s0 + c < S
        w = tl.exp2(tl.load(lse_ptr + pid * S + s0 + c, mask=inside, other=float("-inf")) - m_safe)
        o = tl.load(part_ptr + (pid * S + s0 + c[:, None]) * D + d[None, :], mask=inside[:, None] & (d[None, :] < D),
                    other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    store_out_tl(out_ptr + pid * D + d, acc / tl.maximum(total, 1e-30), d < D, OUT)
    tl.store(final_lse_ptr + pid, tl.where(total > 0, m_safe + tl.log2(tl.maximum(total, 1e-30)), float("-inf")),
             mask=first == 0)


@jit
def _mass_kernel(logit_ptr, lse_ptr, table_ptr, valid_ptr, mass_ptr, weight_ptr, W, tokens, col0, total_cols,
                 HQ: tl.constexpr, HP: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr):
    """One tile of one row of one source: each valid slot's probability (its logit against the
    merged log2-sum-exp), averaged over the ``HQ`` query heads, times the row's weight, added
    to the slot's channel in place (a slot belongs to one row: no two programs write it)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < tokens
    blk = tl.load(table_ptr + row * W + t // BS, mask=inside, other=-1).to(tl.int64)
    slot = blk * BS + t % BS
    ok = inside & (blk >= 0)
    ok = ok & (tl.load(valid_ptr + slot, mask=ok, other=0) != 0)
    h = tl.arange(0, HP)
    hm = h < HQ
    lse = tl.load(lse_ptr + row * HQ + h, mask=hm, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # a row with nothing valid: every logit is -inf
    logit = tl.load(logit_ptr + (row * HQ + h)[:, None] * total_cols + col0 + t[None, :],
                    mask=hm[:, None] & ok[None, :], other=float("-inf"))
    delta = tl.sum(tl.exp2(logit - lse[:, None]), 0) * (tl.load(weight_ptr + row) / HQ)
    current = tl.load(mass_ptr + slot, mask=ok, other=0.0)
    tl.store(mass_ptr + slot, current + delta, mask=ok)


# ---------------------------------------------------------------------------
# Launchers


def _operand_args(op: KVOperand, device) -> tuple:
    # a pointer for the arrays a format lacks (never read): one tensor per device, not a
    # fill kernel per call (128 graph nodes per step at 32 layers)
    dummy = device_constant((0.0,), device, torch.float32)
    return (op.codes, op.scale if op.scale is not None else dummy, op.minimum if op.minimum is not None else dummy,
            op.head_scale.float().contiguous() if op.head_scale is not None else dummy)


def _operand_constants(op: KVOperand, D: int) -> tuple[int, int, int]:
    """(bits, channel group of ``int`` scales, token group of ``int_channel`` scales)."""
    group = D // op.scale.shape[-1] if op.fmt == "int" else 1
    return op.bits, group, op.token_group


def check_sources(query: torch.Tensor, sources: list[PagedSource]) -> None:
    """Shapes and dtypes the kernel relies on; errors name the bad value."""
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"decode attention takes one query per row [B, Hq, 1, D]; got shape {tuple(query.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype {query.dtype} not supported; accepted: float16, bfloat16, float32")
    B, Hq, _, D = query.shape
    for i, src in enumerate(sources):
        for role, op in (("key", src.key), ("value", src.value)):
            H = op.codes.shape[1]
            if op.codes.dim() != 3 or op.head_dim() != D or Hq % H:
                raise ValueError(
                    f"source {i} {role}s: codes of shape {tuple(op.codes.shape)} ({op.fmt}) do not fit queries of "
                    f"shape {tuple(query.shape)} (need [slots, H, D / codes per byte] with Hq a multiple of H)"
                )
            if op.fmt == "dense" and op.codes.dtype != query.dtype:
                raise ValueError(f"source {i} {role}s: dtype {op.codes.dtype} differs from the query dtype {query.dtype}")
            if op.head_scale is not None and tuple(op.head_scale.shape) != (B, H):
                raise ValueError(
                    f"source {i} {role}s: head_scale of shape {tuple(op.head_scale.shape)}; expected {(B, H)}")
        if src.table.dim() != 2 or src.table.shape[0] != B:
            raise ValueError(f"source {i}: block table of shape {tuple(src.table.shape)}; expected [{B}, W]")


def paged_decode_attention(query: torch.Tensor, sources: list[PagedSource], scaling: float, *,
                           probs: bool = False, mass=None, backend: str | None = None):
    """Attention of one decode step over paged sources: ``[B, Hq, 1, D]`` in the query dtype.

    With ``probs=True`` also returns the attention probabilities ``[B, Hq, L]`` over the
    concatenated token columns of the sources (0 where a slot is not valid): the kernel
    writes each slot's logit in the same pass, and one exponential against the merged
    log-sum-exp finishes them. ``mass=(channels, weight)``: one flat float32 per-slot
    tensor per source and a ``[B]`` weight; each valid slot's channel entry gains
    ``weight[b]`` times its probability averaged over the query heads (what ``h2o``
    accumulates), computed on the device without returning the probabilities.
    ``backend``: None (Triton on CUDA, the torch reference elsewhere), "triton" (CUDA, or the
    CPU interpreter under ``TRITON_INTERPRET=1``), "torch". Rows with no valid token get zeros.
    """
    check_sources(query, sources)
    if mass is not None:
        check_mass(query, sources, mass)
    fits = backend is not None or kernel_fits(query, sources)
    if not step_kernel_runs(query, _paged_partial_kernel, backend, fits):
        return paged_decode_attention_torch(query, sources, scaling, return_probs=probs, mass=mass)
    return _paged_decode_triton(query, sources, scaling, probs, mass)


def check_mass(query: torch.Tensor, sources: list[PagedSource], mass) -> None:
    """The ``mass`` argument: a float32 channel with a value per slot of each source, a ``[B]`` weight."""
    channels, weight = mass
    if len(channels) != len(sources):
        raise ValueError(f"mass: {len(channels)} channels for {len(sources)} sources; give one per source")
    for i, (src, channel) in enumerate(zip(sources, channels)):
        if channel.dtype != torch.float32 or channel.shape != src.valid.shape:
            raise ValueError(f"mass channel {i}: {channel.dtype} of shape {tuple(channel.shape)}; expected float32 "
                             f"of shape {tuple(src.valid.shape)} (one value per slot)")
    if tuple(weight.shape) != (query.shape[0],):
        raise ValueError(f"mass weight of shape {tuple(weight.shape)}; expected ({query.shape[0]},), one per row")


def kernel_fits(query: torch.Tensor, sources: list[PagedSource]) -> bool:
    """Whether the compiled kernel takes this head dim: a power of two, at least 16 channels per
    code position of a byte (the tensor-core dot needs K >= 16). Elsewhere the reference runs."""
    D = query.shape[-1]
    per = max([1] + [op.per_byte for s in sources for op in (s.key, s.value)])
    return D == next_pow2(D) and D // per >= 16


def _paged_decode_triton(query, sources, scaling, probs, mass=None):
    B, Hq, _, D = query.shape
    if not interpreted(_paged_partial_kernel) and not kernel_fits(query, sources):
        raise ValueError(f"the paged attention kernel needs a power-of-two head dim with >= 16 channels per code "
                         f"position of a packed byte; got head dim {D} (use backend='torch' or None)")
    q = query.contiguous()
    device = q.device
    if mass is not None:  # sources without columns receive nothing
        mass = ([c for c, s in zip(mass[0], sources) if s.tokens > 0], mass[1])
    sources = [s for s in sources if s.tokens > 0]
    if not sources:  # nothing stored anywhere: every row attends to nothing
        out = torch.zeros_like(query)
        return (out, torch.zeros(B, Hq, 0, device=device)) if probs else out
    H = sources[0].key.codes.shape[1]
    cols = sum(s.tokens for s in sources)
    scores = probs or mass is not None
    args, consts = _partial_launch(q, sources, scores)
    programs, tuples, kwargs, total = _plan_launch(q, sources, args, consts, cols)
    part = torch.empty(B, Hq, total, D, dtype=torch.float32, device=device)
    lse = torch.empty(B, Hq, total, dtype=torch.float32, device=device)  # every split writes its own
    logits = torch.empty(B, Hq, cols if scores else 1, device=device)  # the splits cover every column
    _paged_partial_kernel[(B * H, programs)](q, part, lse, logits, total, cols, scaling * LOG2E, tuples, **kwargs)
    out, dst, kind = out_buffer((B, Hq, 1, D), query.dtype, device)
    final = torch.empty(B, Hq, dtype=torch.float32, device=device)
    width = merge_width(B * Hq, D, device)
    _merge_kernel[(B * Hq, cdiv(D, width))](part, lse, dst, final, total, D=D, SP=next_pow2(total), DP=width,
                                            OUT=kind, CHUNK=MERGE_CHUNK, num_warps=MERGE_WARPS)
    if mass is not None:
        weight = mass[1].float().contiguous()
        col0 = 0
        for src, channel in zip(sources, mass[0]):
            table = src.table.contiguous()
            _mass_kernel[(B, cdiv(src.tokens, MASS_BLOCK))](
                logits, final, table, src.valid.view(torch.uint8), channel, weight, table.shape[1], src.tokens,
                col0, cols, HQ=Hq, HP=next_pow2(Hq), BS=src.block_size, BLOCK=MASS_BLOCK, num_warps=WARPS)
            col0 += src.tokens
    if not probs:
        return out
    return out, torch.exp2(logits - final[..., None]).nan_to_num(0.0)  # -inf - -inf (empty row) -> 0


def _plan_launch(q: torch.Tensor, sources: list[PagedSource], args: list[tuple], consts: dict,
                 cols: int) -> tuple[int, tuple, dict, int]:
    """Which programs of the one partial launch run which source's splits.

    The long sources own programs, each split over as many as :func:`plan_splits` finds
    best for the launch's resident programs per SM; short ones (the recent buffer) ride on
    the last program of the longest, as one split, adding no program and no wave. A shared
    launch is held to the registers its longest source needs alone (measured on an H200,
    the buffer's branch otherwise raised them by 10-35 per thread, costing the pool one or
    two resident programs per SM). Returns the programs per (row, KV head), each source's
    runtime tuple (``SOURCE_FIELDS``), the launch's keyword arguments and the number of
    partial results."""
    B, H = q.shape[0], sources[0].key.codes.shape[1]
    riders = [i for i, s in enumerate(sources) if small_source(s)] if len(sources) > 1 else []
    owners = [i for i in range(len(sources)) if i not in riders] or riders[:1]
    riders = [i for i in riders if i not in owners]
    host = max(owners, key=lambda i: sources[i].tokens)
    kwargs = dict(consts)
    if len(sources) > 1 and MAX_REGISTERS is None and q.is_cuda:
        kwargs["maxnreg"] = _registers(q, ([args[host]], dict(consts, CONSTS=(consts["CONSTS"][host],), NSRC=1)), cols)
    per_sm = _resident(q, (args, kwargs), cols)
    block_at = SOURCE_CONSTS.index("BLOCK")
    fields, programs, partials = {}, 0, 0
    for i in owners + riders:
        block = consts["CONSTS"][i][block_at]
        n = plan_splits(B * H, sources[i].tokens, q.device, per_sm, block) if i in owners else 1
        per = cdiv(cdiv(sources[i].tokens, n), block) * block  # whole tiles; rounding up can empty the last
        n = cdiv(sources[i].tokens, per)  # splits: drop those
        if i in owners:
            fields[i] = (per, programs, n, partials)
            programs += n
        else:
            fields[i] = (per, fields[host][1] + fields[host][2] - 1, 1, partials)
        partials += n
    first_cols = [sum(s.tokens for s in sources[:i]) for i in range(len(sources))]
    tuples = tuple(args[i] + fields[i] + (first_cols[i],) for i in range(len(sources)))
    return programs, tuples, kwargs, max(1, partials)


def query_rows(group: int, dense: bool) -> int:
    """Rows of the partial kernel's query tile for a GQA group: the group rounded up to a power
    of two, which Triton pads to the tensor cores' 16 rows itself; 16 rows of our own where
    the launch's longest source is ``dense``. Measured on
    an H200 (G = 4, one launch with the buffer): the group's 4 rows made fp8, nvfp4,
    ternary and KIVI-2 3-13% faster (less shared memory and fewer registers, more programs
    per SM), int4 within 3%, and dense bf16 3-4% slower."""
    return 16 if dense else next_pow2(group)


def merge_width(pairs: int, D: int, device: torch.device) -> int:
    """Output channels per merge program: all of a row's, or ``MERGE_SLICE`` of them where
    fewer than ``MERGE_ROWS`` (row, head) pairs would leave most of a GPU idle (batch 1, long
    rows). The CPU interpreter pays for every program and has no SMs to fill: whole rows."""
    whole = next_pow2(D)
    if pairs >= MERGE_ROWS or device.type != "cuda":
        return whole
    return min(whole, MERGE_SLICE)


def small_source(src: PagedSource) -> bool:
    """Whether a source's rows are short enough (the recent buffer) for the light tile: 16
    tokens, no software pipelining. Its branch of the shared launch then never needs more
    registers or shared memory than a pool's branch."""
    return src.tokens <= SMALL_SOURCE_TOKENS


def _partial_launch(q: torch.Tensor, sources: list[PagedSource], scores: bool) -> tuple[list[tuple], dict]:
    """Per source, its runtime arguments of :func:`_paged_partial_kernel` before the split
    geometry (``SOURCE_FIELDS``); and the launch's keyword arguments, with ``CONSTS`` the
    sources' compile-time constants (``SOURCE_CONSTS``), at the launch shape ``TILE_SHAPE``
    (tokens per tile, warps)."""
    D, device = q.shape[-1], q.device
    H = sources[0].key.codes.shape[1]
    args, consts = [], []
    for src in sources:
        table = src.table.contiguous()
        kb, kg, ktg = _operand_constants(src.key, D)
        vb, vg, _ = _operand_constants(src.value, D)
        args.append((table, src.valid.view(torch.uint8), *_operand_args(src.key, device),
                     *_operand_args(src.value, device), table.shape[1]))
        block, stages = (SMALL_TILE, SMALL_STAGES) if small_source(src) else (TILE_SHAPE[0], STAGES)
        c = dict(KFMT=FORMATS[src.key.fmt], VFMT=FORMATS[src.value.fmt], KBITS=kb, VBITS=vb, KGROUP=kg, VGROUP=vg,
                 KTG=ktg, KPER=src.key.per_byte, VPER=src.value.per_byte, KEX=_exact(src.key, q.dtype),
                 VEX=_exact(src.value, q.dtype), KFOLD=_folds(src, block, q.dtype), BS=src.block_size,
                 BLOCK=block, STAGES=stages)
        consts.append(tuple(c[name] for name in SOURCE_CONSTS))
    G = q.shape[1] // H
    longest = max(sources, key=lambda s: s.tokens)
    kwargs = dict(
        CONSTS=tuple(consts), NSRC=len(sources), H=H, G=G, GP=query_rows(G, longest.key.fmt == "dense"), D=D,
        SCORES=scores,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", OUT=OUT_KINDS[q.dtype],
        NATIVE=not interpreted(_paged_partial_kernel), num_warps=TILE_SHAPE[1], num_stages=STAGES,
        **({} if MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}),
    )
    return args, kwargs


_RESIDENT: dict = {}  # (device, compile-time constants) -> programs per SM of that variant


def _resident(q: torch.Tensor, launch: tuple[list[tuple], dict], cols: int) -> int:
    """Programs per SM of the variant a launch compiles to; compiled ahead of its first launch
    so that even the first call splits as every later one does."""
    if q.device.type != "cuda":
        return PROGRAMS_PER_SM
    key = (q.device.index, q.dtype, *launch[1].values())  # _partial_launch builds consts in one fixed order
    if key not in _RESIDENT:
        _RESIDENT[key] = resident_programs(compiled_partial(q, launch, cols), q.device)
    return _RESIDENT[key]


_REGISTERS: dict = {}  # (device, compile-time constants) -> registers per thread of that variant


def _registers(q: torch.Tensor, launch: tuple[list[tuple], dict], cols: int) -> int:
    """Registers per thread of the variant a launch compiles to (the cap of a shared launch:
    measured on an H200, the short source's branch otherwise raised them by 10-35, costing the
    long source one or two resident programs per SM)."""
    key = (q.device.index, q.dtype, *launch[1].values())
    if key not in _REGISTERS:
        kernel = compiled_partial(q, launch, cols)
        kernel._init_handles()
        _REGISTERS[key] = kernel.n_regs
    return _REGISTERS[key]


def compiled_partial(q: torch.Tensor, launch: tuple[list[tuple], dict], cols: int):
    """The compiled :func:`_paged_partial_kernel` of a launch (``warmup``: the launch's own
    queries, sources and columns; a typical split geometry)."""
    args, consts = launch
    out = torch.empty(1, device=q.device)  # the fp32 outputs
    tuples = tuple(a + (c[SOURCE_CONSTS.index("BLOCK")], 2 * i, 2, 2 * i, 0)
                   for i, (a, c) in enumerate(zip(args, consts["CONSTS"])))
    return _paged_partial_kernel.warmup(q, out, out, out, 2 * len(args), cols, 1.0, tuples, grid=(1, 1), **consts)


def _folds(src: PagedSource, block: int, dtype: torch.dtype) -> bool:
    """Whether KIVI keys are scored with their scales in the queries (:func:`_kivi_key_scores`):
    the tile's ``block`` tokens (16 or more) must lie in one token group (powers of two
    dividing the block size). Measured on an H100 (kivi2, groups of 32): 4% faster than
    dequantizing on 32-token tiles, and 22% slower on 64-token tiles when each of the two
    runs dotted the whole tile, so a tile longer than its group dequantizes. Not for fp16
    queries, whose product with a scale could overflow fp16 where the dense keys do not."""
    tg = src.key.token_group
    return (src.key.fmt == "int_channel" and dtype != torch.float16 and 16 <= block <= tg
            and tg == next_pow2(tg) and block == next_pow2(block) and src.block_size % tg == 0)


def _exact(op: KVOperand, dtype: torch.dtype) -> bool:
    """Whether the operand's values go to the tensor cores in fp16 (see ``EXACT_FORMATS``)."""
    return op.fmt in EXACT_FORMATS and dtype != torch.float32


def bytes_read(sources: list[PagedSource], query: torch.Tensor) -> int:
    """Bytes the kernel must read for one step: codes, scales, tables, validity and queries."""
    total = query.numel() * query.element_size()
    for src in sources:
        total += src.table.numel() * 4 + src.valid.numel() * src.valid.element_size()
        for op in (src.key, src.value):
            for t in (op.codes, op.scale, op.minimum, op.head_scale):
                if t is not None:
                    total += t.numel() * t.element_size()
    return total


__all__ = [
    "EXACT_FORMATS", "FORMATS", "KVOperand", "PagedSource", "add_mass_torch", "bytes_read", "decode_operand_torch",
    "dense_source_view",
    "paged_decode_attention", "paged_decode_attention_torch",
]
