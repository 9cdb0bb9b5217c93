"""Recency evictor: keep the most recent tokens (StreamingLLM's window)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import EvictionContext, Evictor


@register("evictor", "window")
@dataclass
class WindowEvictor(Evictor):
    """Keep the most recent tokens; combined with protected sinks this is StreamingLLM."""

    reads_keys = False
    score_source = "position"

    def scores(self, ctx: EvictionContext) -> torch.Tensor:
        return ctx.positions.to(torch.float32)
