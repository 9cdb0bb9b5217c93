"""H2O: keep the heavy hitters, the tokens that have received the most attention so far.

From "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (Zhang et al., arXiv:2306.14048). The attention every token has received since
it arrived lives in a slot channel that the store carries along with the token, so the
evictor holds no per-sequence state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .base import EvictionContext, Evictor


@register("evictor", "h2o")
@dataclass
class H2OEvictor(Evictor):
    """Heavy hitters (H2O): keep the tokens that have received the most attention so far.

    Each step's probabilities are summed over the step's queries and averaged over
    query heads; the store adds that to the token's ``acc`` slot channel, which
    starts at zero when the token arrives and moves with it.
    """

    needs_probs = True
    slot_channels = ("acc",)
    mass_channel = "acc"  # observe() adds exactly the step's head-averaged attention
    reads_keys = False
    score_source = "acc"

    def observe(self, attn_probs: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        if attn_probs.dim() != 4 or attn_probs.shape[0] != valid.shape[0] or attn_probs.shape[-1] != valid.shape[1]:
            raise ValueError(
                f"h2o: attn_probs must be [B, Hq, Lq, L] matching valid {tuple(valid.shape)}, "
                f"got {tuple(attn_probs.shape)}"
            )
        received = attn_probs.float().sum(dim=2).mean(dim=1)
        return {"acc": torch.where(valid, received, torch.zeros_like(received))}

    def scores(self, ctx: EvictionContext) -> torch.Tensor:
        acc = ctx.state.get("acc")
        if acc is None:
            raise ValueError("h2o: ctx.state has no 'acc' channel; the store must keep the evictor's slot_channels")
        if acc.shape != ctx.valid.shape:
            raise ValueError(f"h2o: state['acc'] has shape {tuple(acc.shape)}, expected {tuple(ctx.valid.shape)}")
        return torch.where(ctx.valid, acc.float(), torch.zeros_like(acc, dtype=torch.float32))
