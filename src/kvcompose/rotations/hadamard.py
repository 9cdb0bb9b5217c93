"""``hadamard``: the normalized Walsh-Hadamard transform of the head dim, with random signs.

Rotating keys and values by a Hadamard matrix before quantizing them spreads outlier
channels over all channels, so per-token and per-group scales fit the values better.
This is how QuaRot (Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs",
arXiv:2404.00456) makes 4-bit KV caches work, and the rotation vLLM's and SGLang's
rotated 4-bit KV formats apply. ``H diag(s)`` with signs ``s`` drawn per (layer, KV head)
from ``seed`` is still orthogonal, and it decorrelates the heads' rotations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from ..validation import check_int
from .base import Rotation


@register("rotation", "hadamard")
@dataclass
class HadamardRotation(Rotation):
    """Normalized Walsh-Hadamard rotation of the head dim (a power of two), with fixed random
    signs per layer and KV head (``random_signs``, drawn from ``seed``)."""

    random_signs: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.random_signs, bool):
            raise ValueError(f"hadamard rotation: random_signs={self.random_signs!r}; accepted: true or false")
        check_int("hadamard rotation: seed", self.seed, 0, noun="an integer")

    def matrices(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        if head_dim < 1 or head_dim & (head_dim - 1):
            raise ValueError(f"hadamard rotation: head dim {head_dim} is not a power of two; accepted: 1, 2, 4, ..., "
                             f"128, 256 (or rotation 'none')")
        h = hadamard_matrix(head_dim)
        if not self.random_signs:
            return h.expand(num_kv_heads, head_dim, head_dim).clone()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + layer_idx)
        signs = torch.randint(0, 2, (num_kv_heads, head_dim), generator=g).float() * 2 - 1
        return signs[:, :, None] * h  # diag(s) H: row i of H times s_i


def hadamard_matrix(n: int) -> torch.Tensor:
    """The ``n x n`` Walsh-Hadamard matrix (Sylvester's construction) divided by ``sqrt(n)``: orthogonal."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5
