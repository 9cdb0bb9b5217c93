"""INT-k quantizer (k = 2, 4, 8): asymmetric, a scale and a minimum per group.

The ``kivi`` layout follows "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache" (Liu et al., arXiv:2402.02750). See :mod:`kvcompose.ops.quant_int` for the
arithmetic and :mod:`kvcompose.ops.quant_int_channel` for the KIVI key layout. Layouts:

- ``per_token``: keys and values alike, groups of ``group_size`` channels of one
  token (None: the whole head dim). Slot-local.
- ``kivi``: keys per channel over groups of ``token_group`` tokens, values per
  token as in ``per_token`` (KIVI). Key scales span several tokens, so the
  layout is not slot-local; ``quantize`` needs ``role="key"`` or ``role="value"``.
  (KIVI's full-precision window of recent tokens is the store's buffer, not part
  of the quantizer.)

Scale and minimum are stored in ``scale_dtype`` (float16 by default, as in KIVI).
Bits per value: ``k + 2 * s / g``, where ``s`` is 16 or 32 (scale dtype) and ``g``
the number of values sharing one (scale, min) pair: ``group_size`` (or the head
dim) for token groups, ``token_group`` for KIVI keys. For ``kivi`` the property
reports the mean of the key and value halves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.quant_int import BITS, int_dequantize_tokens, int_quantize_tokens
from ..ops.quant_int_channel import int_dequantize_channels, int_quantize_channels
from ..registry import register
from .base import Packed, Quantizer, check_role

LAYOUTS = ("per_token", "kivi")
_SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class IntPacked(Packed):
    """Packed INT-k data.

    ``codes`` uint8 ``[N, H, D*bits/8]``; ``scale`` and ``minimum`` are
    ``[N, H, D/group]`` for ``grouping == "token"`` and ``[ceil(N/token_group), H, D]``
    for ``grouping == "channel"`` (KIVI keys).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    grouping: str
    token_group: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        n, h, nbytes = self.codes.shape
        return (n, h, nbytes * 8 // self.bits)

    @property
    def slot_local(self) -> bool:
        return self.grouping == "token"

    def token_tensors(self) -> dict[str, torch.Tensor]:
        if self.grouping == "channel":  # scale and minimum belong to token groups
            return {"codes": self.codes}
        return {"codes": self.codes, "scale": self.scale, "minimum": self.minimum}


@register("quantizer", "int")
@dataclass
class IntQuantizer(Quantizer):
    """Asymmetric INT-k (k = 2, 4, 8) with per-token groups or the KIVI key/value layout."""

    bits: int = 4
    layout: str = "per_token"
    group_size: int | None = None
    token_group: int = 32
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"int quantizer: bits={self.bits!r}; accepted: {', '.join(map(str, BITS))}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"int quantizer: layout={self.layout!r}; accepted: {', '.join(LAYOUTS)}")
        per_byte = 8 // self.bits
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % per_byte
        ):
            raise ValueError(
                f"int quantizer: group_size={self.group_size!r}; accepted: None (the head dim) or a positive "
                f"multiple of {per_byte} ({per_byte} codes of {self.bits} bits per byte)"
            )
        if not isinstance(self.token_group, int) or self.token_group <= 0:
            raise ValueError(f"int quantizer: token_group={self.token_group!r}; accepted: a positive int")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"int quantizer: scale_dtype={self.scale_dtype!r}; accepted: {', '.join(_SCALE_DTYPES)}")

    @property
    def slot_local(self) -> bool:
        """False for ``kivi``: its key scales span ``token_group`` tokens (its value half is slot-local)."""
        return self.layout == "per_token"

    @property
    def bits_per_value(self) -> float:
        if self.group_size is None:
            raise ValueError(
                "int quantizer with group_size=None groups a whole head dim, so its bits per value depend on "
                "head_dim; use bits_per_value_for(head_dim)"
            )
        return self.bits_per_value_for(self.group_size)

    def bits_per_value_for(self, head_dim: int) -> float:
        overhead = 2 * 8 * _SCALE_DTYPES[self.scale_dtype].itemsize  # scale + minimum, in bits
        token = self.bits + overhead / (self.group_size or head_dim)
        if self.layout == "per_token":
            return token
        return (self.bits + overhead / self.token_group + token) / 2

    def attention_format(self, role: str) -> str:
        return "int_channel" if self.layout == "kivi" and role == "key" else "int"

    def quantize(self, x, *, role=None, head_scale=None, backend=None, flags=None) -> IntPacked:
        check_role(role)
        if head_scale is not None:
            raise ValueError("int quantizer has no per-head scale; head_scale must be None")
        if self.layout == "kivi" and role is None:
            raise ValueError(
                "int quantizer with layout='kivi' quantizes keys and values differently; "
                "pass role='key' or role='value'"
            )
        sdt = _SCALE_DTYPES[self.scale_dtype]
        if self.layout == "kivi" and role == "key":
            codes, scale, lo = int_quantize_channels(x, self.bits, self.token_group, sdt, backend=backend, flags=flags)
            return IntPacked(codes, scale, lo, self.bits, "channel", self.token_group, x.dtype)
        codes, scale, lo = int_quantize_tokens(x, self.bits, self.group_size, sdt, backend=backend, flags=flags)
        return IntPacked(codes, scale, lo, self.bits, "token", self.token_group, x.dtype)

    def dequantize(self, packed, dtype=None, *, backend=None) -> torch.Tensor:
        self._check_packed(packed, IntPacked)
        dtype = dtype or packed.dtype
        if packed.grouping == "channel":
            return int_dequantize_channels(
                packed.codes, packed.scale, packed.minimum, packed.bits, packed.token_group, dtype, backend=backend
            )
        return int_dequantize_tokens(packed.codes, packed.scale, packed.minimum, packed.bits, dtype, backend=backend)
