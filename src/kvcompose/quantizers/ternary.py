"""Ternary quantizer: {-1, 0, +1} times a least-squares E4M3 scale per 16 channels.

The 2-bit level of ThinKV, "ThinKV: Thought-Adaptive KV Cache Compression for Efficient
Reasoning Models" (Ramachandran et al., arXiv:2510.01290), appendix D.3, used for
transition thoughts. See :mod:`kvcompose.ops.quant_ternary` for the scale rule. Bits per value:
``2 + 8 / 16 = 2.5``; the per-head scale that keeps block scales in E4M3's range is
amortized over every token that shares it and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.quant_ternary import BLOCK, ternary_dequantize, ternary_quantize
from ..registry import register
from .block_scaled import BLOCK as SCALE_BLOCK
from .block_scaled import BlockScaledPacked, BlockScaledQuantizer

if BLOCK != SCALE_BLOCK:  # the ops and the quantizer must agree on the block size
    raise ImportError(f"block size mismatch: ops use {BLOCK}, the quantizer {SCALE_BLOCK}")


@dataclass(frozen=True)
class TernaryPacked(BlockScaledPacked):
    """Packed ternary data: four 2-bit codes per byte (see :class:`BlockScaledPacked`)."""

    codes_per_byte = 4


@register("quantizer", "ternary")
@dataclass
class TernaryQuantizer(BlockScaledQuantizer):
    """Ternary {-1, 0, +1} with a least-squares E4M3 scale per 16 channels; 2.5 bits per value."""

    code_bits = 2
    packed_type = TernaryPacked
    quantize_op = staticmethod(ternary_quantize)
    dequantize_op = staticmethod(ternary_dequantize)
