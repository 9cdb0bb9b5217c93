"""``none``: keys and values are stored as the model computes them (the default)."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import register
from .base import Rotation


@register("rotation", "none")
@dataclass
class NoRotation(Rotation):
    """No rotation: what a policy without ``rotation`` does; naming it makes the choice explicit."""

    def matrices(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> None:
        return None
