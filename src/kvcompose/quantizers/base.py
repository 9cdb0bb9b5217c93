"""The quantizer contract: ``quantize(x) -> packed`` and ``dequantize(packed) -> x``.

Input is one layer's keys or values as ``[N, H, D]`` (tokens, KV heads, head dim),
float16/bfloat16/float32. A packed result is a small frozen dataclass of tensors
whose leading dim is the token (codes, per-token scales) plus, for some formats, a
per-head scale shared by every token quantized with it.

Slot locality: a quantizer is *slot-local* when each token's codes and scales
depend only on that token (and a per-head scale the store keeps per layer and
head), so a store can move or overwrite one token's slot without touching others.
INT with the KIVI layout is not: its key scales span a group of tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

ROLES = ("key", "value")


@dataclass(frozen=True)
class Packed:
    """Base of the packed results: byte accounting shared by every format."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (what a store has to keep)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors whose dim 0 is the token: what moves with a token's slot."""
        head = self.head_scale
        shared = head is not None and head.dim() == 1
        return {k: t for k, t in self.tensors().items() if not (shared and t is head)}

    @property
    def head_scale(self) -> torch.Tensor | None:
        """The fp32 second-level scale: ``[H]``, shared by all tokens quantized with it, or
        ``[N, H]``, one per token and head (None if the format has none)."""
        return None

    @property
    def shape(self) -> tuple[int, int, int]:  # pragma: no cover - interface
        """``(N, H, D)`` of the tensor that was quantized."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held, per-head scales included."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def bits_per_value(self) -> float:
        """Actual bits per quantized value, every stored tensor counted."""
        n, h, d = self.shape
        return 8.0 * self.nbytes / max(1, n * h * d)

    @property
    def slot_local(self) -> bool:
        return True


class Quantizer:
    """Base class of the registered quantizers (subclasses are dataclasses)."""

    #: Whether every token's codes and scales are independent of other tokens.
    slot_local: bool = True

    @property
    def bits_per_value(self) -> float:  # pragma: no cover - interface
        """Nominal bits per value including block scales and zero points."""
        raise NotImplementedError

    def attention_format(self, role: str) -> str:
        """How the decode-attention op reads this format's ``role`` tensors in place
        (a key of :data:`kvcompose.ops.paged_attention.FORMATS`); every registered quantizer says."""
        raise TypeError(f"quantizer {type(self).__name__} does not define attention_format, so the fused decode "
                        "attention cannot read it; implement it, or make caches with fused_attention=False")

    def bits_per_value_for(self, head_dim: int) -> float:
        """Bits per value for a given head dim (differs from :attr:`bits_per_value` only for INT)."""
        return self.bits_per_value

    def quantize(
        self,
        x: torch.Tensor,
        *,
        role: str | None = None,
        head_scale: torch.Tensor | None = None,
        backend: str | None = None,
        flags: torch.Tensor | None = None,
    ) -> Packed:  # pragma: no cover - interface
        """Quantize ``x`` ``[N, H, D]``.

        ``role`` ("key"/"value") matters only for layouts that treat keys and values
        differently. ``head_scale`` ``[H]`` fixes the per-head scale of two-level
        formats (default: computed from ``x``). ``backend``: None (auto), "triton", "torch".
        Bad input (NaN/inf, a bad head scale) raises a ValueError at once, which costs the
        kernel path one host synchronization; pass ``flags`` (a one-element int32 tensor from
        :func:`kvcompose.ops.checks.new_flags`) to have the kernels only record errors
        there, without synchronizing (so the call can be captured in a CUDA graph), and raise
        them later with :func:`kvcompose.ops.checks.check_flags`.
        """
        raise NotImplementedError

    def dequantize(
        self, packed: Packed, dtype: torch.dtype | None = None, *, backend: str | None = None
    ) -> torch.Tensor:  # pragma: no cover - interface
        """Decode ``packed`` to ``[N, H, D]`` of ``dtype`` (default: the quantized input's dtype)."""
        raise NotImplementedError

    def _check_packed(self, packed: Packed, cls: type) -> None:
        if not isinstance(packed, cls):
            raise TypeError(f"{self.name} quantizer cannot decode a {type(packed).__name__}; expected {cls.__name__}")


def check_role(role: str | None) -> None:
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be 'key', 'value' or None, got {role!r}")
