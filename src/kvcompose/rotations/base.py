"""The rotation contract: an orthogonal transform of the stored keys and values, per layer and KV head.

Low-bit formats lose least where a vector's energy is spread evenly over its channels.
A rotation ``R`` (orthogonal, one per layer and KV head) spreads it: keys are stored as
``k R`` (after RoPE), values as ``v R``; each step's queries are rotated the same way and
the attention output is rotated back by ``R^T``. Dot products survive (``(q R)(k R)^T =
q k^T``), so attention, and every score built from query-key or key-key products, are
unchanged; only the error of the stored codes changes. The cache applies it
(:class:`~kvcompose.runtime.layer.LayerRuntime`), so every storage format, evictor and
attention path sees rotated keys and values without knowing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class Rotation(ABC):
    """Base class of the ``rotation`` components (registered dataclasses)."""

    @abstractmethod
    def matrices(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """``[H, D, D]`` fp32 orthogonal matrices of one layer (row vectors are multiplied on
        the right), or None for no rotation."""


@dataclass(frozen=True)
class SignedProduct:
    """Per-KV-head matrices that share one ``matrix`` ``[D, D]`` up to signs ``[H, D]``:
    ``diag(signs[h]) @ matrix`` (``signs_first``) or ``matrix @ diag(signs[h])``. A Hadamard
    rotation with random signs has this form, and :func:`rotate` applies it as a sign flip of
    each head's channels and one plain product over all rows: no per-head matrix is read, and
    nothing is copied (a batched per-head product broadcasts its matrices over the batch)."""

    signs: torch.Tensor
    matrix: torch.Tensor
    signs_first: bool

    def dense(self) -> torch.Tensor:
        """The ``[H, D, D]`` matrices this stands for."""
        signs = self.signs[:, :, None] if self.signs_first else self.signs[:, None, :]
        return signs * self.matrix

    def transposed(self) -> SignedProduct:
        """Each head's matrix transposed: ``(diag(s) M)^T = M^T diag(s)``."""
        return SignedProduct(self.signs, self.matrix.transpose(0, 1), not self.signs_first)


def rotate(x: torch.Tensor, matrices: torch.Tensor | SignedProduct) -> torch.Tensor:
    """``x`` ``[B, Hx, L, D]`` times the matrix of its KV head (``Hx`` a multiple of the ``H``
    matrices: query heads in groups, as GQA lays them out), in ``x``'s dtype (the matrices are
    cast to it; fp32 accumulation). A decode step runs four of these per layer, so they cost
    as few kernels as the form allows: per-head matrices ``[H, D, D]`` one product batched over
    the heads (each matrix read once), a :class:`SignedProduct` a sign flip and one product."""
    B, Hx, L, D = x.shape
    if isinstance(matrices, SignedProduct):
        H = matrices.signs.shape[0]
        grouped = x.reshape(B, H, (Hx // H) * L, D)
        signs = matrices.signs.to(x.dtype)[None, :, None, :]
        if matrices.signs_first:
            grouped = grouped * signs
        grouped = grouped @ matrices.matrix.to(x.dtype)
        if not matrices.signs_first:
            grouped = grouped * signs
        return grouped.reshape(B, Hx, L, D)
    H = matrices.shape[0]
    by_head = x.reshape(B, H, (Hx // H) * L, D).transpose(0, 1).reshape(H, -1, D)
    out = torch.bmm(by_head, matrices.to(x.dtype))
    return out.reshape(H, B, -1, D).transpose(0, 1).reshape(B, Hx, L, D)


def unrotate(x: torch.Tensor, matrices: torch.Tensor | SignedProduct) -> torch.Tensor:
    """The inverse of :func:`rotate` (the transposed matrices)."""
    if isinstance(matrices, SignedProduct):
        return rotate(x, matrices.transposed())
    return rotate(x, matrices.transpose(-1, -2))
