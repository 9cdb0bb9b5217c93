"""How codes, scales and outputs of the quantization ops lie in memory.

Tensors in these ops are ``[N, H, D]``: N tokens, H KV heads, D head dim. Small codes are
packed along the head dim (:func:`pack_codes`). A second-level scale is ``[H]`` (one per
KV head) or ``[N, H]`` (one per token and head). Kernels read fp16/bf16/fp32 input and
compute in fp32; dequantize kernels write the caller's dtype directly
(:func:`store_out_tl`): fp32 as is, fp16 through Triton's round-to-nearest cast, bf16
through an integer round-to-nearest-even of the fp32 bit pattern (the interpreter's own
bf16 cast truncates), each equal to torch's ``.to()``.
"""

from __future__ import annotations

import torch

from .numerics import e4m3_decode_tl
from .triton_shim import jit, tl


#: Output kinds of the dequantize kernels (``OUT`` constexpr of :func:`store_out_tl`).
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def per_token(scale: torch.Tensor) -> torch.Tensor:
    """A ``[H]`` or ``[N, H]`` scale as ``[1 or N, H, 1]``, ready to broadcast over ``[N, H, D]``."""
    return scale.reshape(-1, scale.shape[-1])[:, :, None]


def token_stride(scale: torch.Tensor) -> int:
    """Token stride of a contiguous ``[H]`` or ``[N, H]`` scale: 0 (per head) or H."""
    return 0 if scale.dim() == 1 else scale.shape[1]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``< 2**bits`` along the last dim into uint8."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes of {bits} bits into whole bytes")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., B]`` -> int32 codes ``[..., B * 8 // bits]``."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


@jit
def scale_index_tl(unit0, u, PER_ROW: tl.constexpr, H: tl.constexpr, ST: tl.constexpr):
    """Offset of the scale of units ``unit0 + u`` in a ``[H]`` (``ST`` = 0) or ``[N, H]`` (``ST`` = H) scale.

    Units (rows or 16-value blocks, ``PER_ROW`` per (token, head) row) are numbered flat
    over ``[N, H, PER_ROW]``; ``unit0`` is an int64 tile start, ``u`` a small int32 range,
    so the per-unit arithmetic stays 32-bit.
    """
    g = (unit0 % (H * PER_ROW)).to(tl.int32) + u
    head = (g // PER_ROW) % H
    if ST == 0:
        return head
    return ((unit0 // (H * PER_ROW)).to(tl.int32) + g // (H * PER_ROW)) * ST + head  # token * H + head < 2^31


@jit
def block_dequant_tile_tl(bs_ptr, s2_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
                          ST: tl.constexpr):
    """Start of a block-scaled dequantize program (NVFP4, ternary): ``(blk0, b, ok, scale)`` with
    ``scale = E4M3 block scale * s2`` for the program's BLOCKS blocks ``blk0 + b``."""
    blk0 = tl.program_id(0).to(tl.int64) * BLOCKS
    b = tl.arange(0, BLOCKS)
    ok = b < n_blocks - blk0
    s2 = tl.load(s2_ptr + scale_index_tl(blk0, b, NB, H, ST), mask=ok, other=1.0)
    return blk0, b, ok, e4m3_decode_tl(tl.load(bs_ptr + blk0 + b, mask=ok, other=0)) * s2


@jit
def store_out_tl(ptr, x, mask, OUT: tl.constexpr):
    """Store fp32 ``x`` as the output dtype: 0 fp32, 1 bf16 (round to nearest even), 2 fp16."""
    if OUT == 1:
        # bf16 = the high half of the fp32 pattern after round-to-nearest-even on the low
        # half (inf stays inf, overflow rounds to inf); ``ptr`` points into an int16 view.
        bits = x.to(tl.int32, bitcast=True)
        tl.store(ptr, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    elif OUT == 2:
        tl.store(ptr, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


def out_buffer(shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(result, what the kernel writes to, OUT kind)`` for a dequantize kernel writing ``dtype``.

    Dtypes the kernels do not write (e.g. float64) get an fp32 kernel output, cast by the caller.
    """
    kind = OUT_KINDS.get(dtype, 0)
    out = torch.empty(shape, dtype=dtype if dtype in OUT_KINDS else torch.float32, device=device)
    return out, out.view(torch.int16) if kind == 1 else out, kind
