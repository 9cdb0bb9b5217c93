"""The shared shape of NVFP4 and ternary: small codes, an E4M3 scale per 16 channels, an FP32 head scale.

Both formats pack ``codes_per_byte`` codes per byte, keep one E4M3 block scale per 16
values along the head dimension and one FP32 second-level scale ``s2`` per KV head;
only the code alphabet and the scale rule (in their ops modules) differ. Subclasses
name their ops and code width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Packed, Quantizer, check_role

BLOCK = 16  # values per E4M3 block scale


@dataclass(frozen=True)
class BlockScaledPacked(Packed):
    """``codes`` uint8 ``[N, H, D / codes_per_byte]``, ``block_scales`` uint8 E4M3 ``[N, H, D/16]``, ``s2`` fp32 ``[H]``."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    s2: torch.Tensor
    dtype: torch.dtype

    codes_per_byte = 1  # set by subclasses

    @property
    def head_scale(self) -> torch.Tensor:
        return self.s2

    @property
    def shape(self) -> tuple[int, int, int]:
        n, h, packed = self.codes.shape
        return (n, h, packed * self.codes_per_byte)


class BlockScaledQuantizer(Quantizer):
    """Quantize/dequantize through a format's ops; subclasses set the class attributes below."""

    code_bits: int = 0
    packed_type: type = BlockScaledPacked
    quantize_op = None  # staticmethod: (x, s2, backend=, flags=) -> (codes, block_scales, s2)
    dequantize_op = None  # staticmethod: (codes, block_scales, s2, dtype, backend=) -> x

    @property
    def bits_per_value(self) -> float:
        return self.code_bits + 8.0 / BLOCK

    def attention_format(self, role: str) -> str:
        return self.name  # "nvfp4" or "ternary": the attention op decodes both block-scaled formats

    def quantize(self, x, *, role=None, head_scale=None, backend=None, flags=None):
        check_role(role)
        codes, block_scales, s2 = self.quantize_op(x, head_scale, backend=backend, flags=flags)
        return self.packed_type(codes, block_scales, s2, x.dtype)

    def dequantize(self, packed, dtype=None, *, backend=None) -> torch.Tensor:
        self._check_packed(packed, self.packed_type)
        return self.dequantize_op(packed.codes, packed.block_scales, packed.s2, dtype or packed.dtype, backend=backend)
