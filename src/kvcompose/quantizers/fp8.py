"""FP8 quantizer: E4M3 codes with one FP32 scale per KV head (ThinKV's 8-bit format).

The format is the E4M3 of "FP8 Formats for Deep Learning" (Micikevicius et al.,
arXiv:2209.05433); ThinKV, "ThinKV: Thought-Adaptive KV Cache Compression for Efficient
Reasoning Models" (Ramachandran et al., arXiv:2510.01290), stores reasoning tokens in it.
See :mod:`kvcompose.ops.quant_fp8` for the exact arithmetic. 8 bits per value; the
per-head scale (32 bits per head) is amortized over every token that shares it and
not counted in :attr:`FP8Quantizer.bits_per_value`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.quant_fp8 import fp8_dequantize, fp8_quantize
from ..registry import register
from .base import Packed, Quantizer, check_role


@dataclass(frozen=True)
class FP8Packed(Packed):
    """E4M3 codes ``[N, H, D]`` (uint8 bit patterns) and the per-head fp32 ``scale`` ``[H]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def head_scale(self) -> torch.Tensor:
        return self.scale

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.codes.shape)


@register("quantizer", "fp8")
@dataclass
class FP8Quantizer(Quantizer):
    """FP8 E4M3 with an FP32 scale per KV head (amax / 448); 8 bits per value."""

    @property
    def bits_per_value(self) -> float:
        return 8.0

    def attention_format(self, role: str) -> str:
        return "fp8"

    def quantize(self, x, *, role=None, head_scale=None, backend=None, flags=None) -> FP8Packed:
        check_role(role)
        codes, scale = fp8_quantize(x, head_scale, backend=backend, flags=flags)
        return FP8Packed(codes, scale, x.dtype)

    def dequantize(self, packed, dtype=None, *, backend=None) -> torch.Tensor:
        self._check_packed(packed, FP8Packed)
        return fp8_dequantize(packed.codes, packed.scale, dtype or packed.dtype, backend=backend)
