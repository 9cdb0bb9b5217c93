"""NVFP4 quantizer: E2M1 codes, E4M3 scale per 16 channels, FP32 scale per KV head.

NVFP4 is NVIDIA's 4-bit format (described in NVIDIA's technical blog "Introducing NVFP4
for Efficient and Accurate Low-Precision Inference", 2025; no paper of its own). It is
the 4-bit level of ThinKV, "ThinKV: Thought-Adaptive KV Cache Compression for Efficient
Reasoning Models" (Ramachandran et al., arXiv:2510.01290), appendix D.3.
See :mod:`kvcompose.ops.quant_nvfp4` for the exact recipe. Bits per value:
``4 + 8 / 16 = 4.5`` (code plus its share of the block scale); the per-head
second-level scale is amortized over every token that shares it and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.quant_nvfp4 import BLOCK, nvfp4_dequantize, nvfp4_quantize
from ..registry import register
from .block_scaled import BLOCK as SCALE_BLOCK
from .block_scaled import BlockScaledPacked, BlockScaledQuantizer

if BLOCK != SCALE_BLOCK:  # the ops and the quantizer must agree on the block size
    raise ImportError(f"block size mismatch: ops use {BLOCK}, the quantizer {SCALE_BLOCK}")


@dataclass(frozen=True)
class NVFP4Packed(BlockScaledPacked):
    """Packed NVFP4 data: two E2M1 nibbles per byte (see :class:`BlockScaledPacked`)."""

    codes_per_byte = 2


@register("quantizer", "nvfp4")
@dataclass
class NVFP4Quantizer(BlockScaledQuantizer):
    """NVFP4: E2M1 values, E4M3 block scale per 16 channels, FP32 head scale; 4.5 bits per value."""

    code_bits = 4
    packed_type = NVFP4Packed
    quantize_op = staticmethod(nvfp4_quantize)
    dequantize_op = staticmethod(nvfp4_dequantize)
