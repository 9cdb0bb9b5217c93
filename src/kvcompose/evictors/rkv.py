"""R-KV: keep tokens that are important and not redundant.

From "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (Cai et al.,
arXiv:2505.24133). Reasoning traces repeat themselves, and repeated text draws attention
to itself, so attention alone keeps many copies of the same thought. R-KV (§3.3-3.4)
subtracts a redundancy score computed from key similarity. Per (sequence, KV head
``h``), over the ``n`` live tokens of the layer:

- ``S = K̄ K̄ᵀ`` with ``K̄_i = K_i / (‖K_i‖ + 1e-8)``, diagonal set to 0 (Eq. 5);
- for every token ``i``, among the tokens ``j`` with ``S[i, j] > threshold`` the
  ``keep_recent_similar`` (β) most recent ones, by position, get ``S[i, j] = 0``;
- redundancy ``R_j = softmax_j( (1/n) Σ_i S[i, j] )`` (Eq. 6);
- score ``Z = lam · I − (1 − lam) · R`` (Eq. 7), ``I`` the importance of
  :class:`~kvcompose.evictors.attention.AttentionEvictor` (α=8 queries, GQA max,
  window mean, max-pool 7 by default); then the mean over KV heads.

Interpretations. The paper writes the sparing step with the index order
``S[j, i]`` and averages over the first index; taken literally that removes each
token's links *to* its newest look-alikes, which treats every member of a group of
near-duplicates alike. We follow the paper's prose and R-KV's code instead: the
link from ``i`` to its newest similar tokens no longer counts toward *their*
redundancy, so the newest copy of a repeated thought survives and older copies go
first. The code spares exactly one token (β=1) and, for a token with no similar
partner, wrongly spares slot 0; here β is a field and a token without similar
partners spares nothing. Below-threshold similarities still count in the mean, as
in Eq. 6. The paper selects per head; our store keeps one set per (sequence,
layer), so ``Z`` is averaged over KV heads.

Cost. The column sums of the edited ``S`` come from
:func:`kvcompose.ops.redundancy.redundancy_column_sums`. On CUDA with β ≤ 1 a fused
Triton kernel streams ``S`` in tiles: memory is linear in the candidate count ``L``
(no ``[B, Hkv, L, L]`` matrix), time still quadratic. β > 1, and CPU tensors, use the
dense torch reference, whose ``[B, Hkv, L, L]`` fp32 matrix grows with ``L²``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.redundancy import redundancy_column_sums
from ..registry import register
from ..validation import check_int, check_range
from .attention import AttentionEvictor, reduce_heads
from .base import EvictionContext


@register("evictor", "rkv")
@dataclass
class RKVEvictor(AttentionEvictor):
    """R-KV: lam · attention importance − (1 − lam) · key redundancy (defaults: the paper's)."""

    lam: float = 0.1  # weight of importance against redundancy (R-KV λ)
    threshold: float = 0.5  # cosine similarity above which two keys count as similar (R-KV T)
    keep_recent_similar: int = 1  # most recent similar tokens spared per token (R-KV β)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = f"{self.name} evictor"
        check_range(f"{owner}: lam", self.lam, 0.0, 1.0)
        check_range(f"{owner}: threshold", self.threshold, -1.0, 1.0)  # a cosine similarity
        check_int(f"{owner}: keep_recent_similar", self.keep_recent_similar, 0)

    def scores(self, ctx: EvictionContext) -> torch.Tensor:
        combined = self.lam * self.head_importance(ctx) - (1.0 - self.lam) * self.head_redundancy(ctx)
        return reduce_heads(combined, self.head_reduce, ctx.heads)  # both parts are zero on empty slots

    def head_redundancy(self, ctx: EvictionContext) -> torch.Tensor:
        """Redundancy per KV head, ``[B, Hkv, L]``: a softmax over each row's live tokens, zero elsewhere."""
        sums = redundancy_column_sums(ctx.keys, ctx.valid, ctx.positions, self.threshold, self.keep_recent_similar)
        live = ctx.valid.sum(dim=1).clamp(min=1).to(sums.dtype)
        mean_sim = sums / live[:, None, None]  # column mean: how much each j repeats the others
        valid_h = ctx.valid[:, None, :].expand_as(mean_sim)
        redundancy = mean_sim.masked_fill(~valid_h, float("-inf")).softmax(dim=-1)
        return torch.where(valid_h, redundancy, torch.zeros_like(redundancy))
