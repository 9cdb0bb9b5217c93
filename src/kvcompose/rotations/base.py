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

import torch


class Rotation(ABC):
    """Base class of the ``rotation`` components (registered dataclasses)."""

    @abstractmethod
    def matrices(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
        """``[H, D, D]`` fp32 orthogonal matrices of one layer (row vectors are multiplied on
        the right), or None for no rotation."""


def rotate(x: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, Hx, L, D]`` times the matrix of its KV head (``Hx`` a multiple of the ``H``
    matrices: query heads in groups, as GQA lays them out). One batched product in ``x``'s
    dtype (the matrices are cast to it once per call; fp32 accumulation): a decode step runs
    four of these per layer, and casts around them would double its kernels."""
    H = matrices.shape[0]
    B, Hx, L, D = x.shape
    grouped = x.reshape(B, H, (Hx // H) * L, D)
    return torch.matmul(grouped, matrices.to(x.dtype)).reshape(B, Hx, L, D)


def unrotate(x: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate` (the transposed matrices)."""
    return rotate(x, matrices.transpose(-1, -2))
