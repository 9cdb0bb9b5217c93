"""Recency evictor: keep the most recent tokens (StreamingLLM's window).

From "Efficient Streaming Language Models with Attention Sinks" (Xiao et al.,
arXiv:2309.17453): with the first tokens protected as attention sinks, a window of the
most recent tokens keeps a model stable over arbitrarily long generations.
"""

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
