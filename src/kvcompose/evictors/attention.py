"""Attention-based importance: keep the tokens that recent queries attend to.

:class:`AttentionEvictor` scores a token by the softmax attention it receives from
the last ``window`` recorded queries (SnapKV's observation window, R-KV's α=8
observation tokens, RPC's R=32 selector window). The pipeline, per (sequence, KV
head):

1. logits ``q·k * scaling`` of each recent query against every live slot; a query
   never sees a key newer than itself when the store passes ``query_positions``;
2. GQA: ``gqa="max"`` takes the max of the logits over the query heads of a KV group
   and applies one softmax (R-KV Eq. 3: max-pool then renormalize along the keys);
   ``gqa="mean"`` applies a softmax per query head and averages the probabilities
   (RPC's and SnapKV's per-head attention averaged over heads);
3. reduce over the window: ``mean`` (R-KV Eq. 4) or ``sum`` (RPC Eq. 2);
4. pool along the token axis in position order, ``pool_width`` wide and centered:
   ``max`` (R-KV) or ``avg`` (SnapKV, RPC). Borders are padded like the reference
   implementations' ``max_pool1d``/``avg_pool1d`` (max ignores the pad, avg divides
   by the full width);
5. reduce over KV heads (``mean``) so one keep set per (sequence, layer) follows.

Interpretations. The softmax runs over every live slot of the layer, protected ones
included, because that is the distribution the model actually computed; the
reference implementations slice the observation window (and RPC the prompt) off
first, which only rescales each query's row. R-KV's Eq. 4 max-pools each query row
before averaging; we reduce the window first and then pool, as R-KV's and SnapKV's
code and the design's preset table do. Empty slots are removed before pooling, so
a row scores its live tokens exactly as if it were alone in the batch.

Papers: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al.,
arXiv:2404.14469); "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(Cai et al., arXiv:2505.24133); "Reasoning Path Compression: Compressing Generation
Trajectories for Efficient LLM Reasoning" (Song et al., arXiv:2505.13866).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..distributed import LOCAL, HeadShards
from ..registry import register
from ..validation import check_choice, check_int
from .base import EvictionContext, Evictor

GQA_MODES = ("max", "mean")
WINDOW_REDUCTIONS = ("mean", "sum")
POOLS = ("max", "avg", "none")
HEAD_REDUCTIONS = ("mean", "max")


@register("evictor", "attention")
@dataclass
class AttentionEvictor(Evictor):
    """Score tokens by the attention the most recent queries give them (SnapKV / R-KV / RPC importance)."""

    graph_safe = True  # scoring and keep_top have fixed shapes (checked on CPU by the sync guard)

    window: int = 8  # recent queries used (R-KV α=8, RPC R=32)
    gqa: str = "max"  # how the query heads of one KV group combine: "max" (R-KV) or "mean"
    window_reduce: str = "mean"  # over the window's queries: "mean" (R-KV) or "sum" (RPC)
    pool: str = "max"  # smoothing along tokens: "max" (R-KV), "avg" (SnapKV, RPC) or "none"
    pool_width: int = 7  # odd width of the pooling window, centered on the token
    head_reduce: str = "mean"  # over KV heads, giving one score per token: "mean" or "max"

    def __post_init__(self) -> None:
        owner = f"{self.name} evictor"
        check_int(f"{owner}: window", self.window, 1)
        check_choice(f"{owner}: gqa", self.gqa, GQA_MODES)
        check_choice(f"{owner}: window_reduce", self.window_reduce, WINDOW_REDUCTIONS)
        check_choice(f"{owner}: pool", self.pool, POOLS)
        check_int(f"{owner}: pool_width", self.pool_width, 1)
        if self.pool_width % 2 == 0:
            raise ValueError(f"{owner}: pool_width must be odd (centered window), got {self.pool_width}")
        check_choice(f"{owner}: head_reduce", self.head_reduce, HEAD_REDUCTIONS)
        self.query_window = self.window

    def scores(self, ctx: EvictionContext) -> torch.Tensor:
        return reduce_heads(self.head_importance(ctx), self.head_reduce, ctx.heads)

    def head_importance(self, ctx: EvictionContext) -> torch.Tensor:
        """Pooled importance per KV head, ``[B, Hkv, L]``; zero on empty slots."""
        probs = window_attention(ctx, self.window, self.gqa)  # [B, Hkv, W, L]
        received = probs.sum(dim=2)
        if self.window_reduce == "mean":
            used = recent(ctx.query_valid, self.window).sum(dim=1).clamp(min=1)
            received = received / used[:, None, None]
        return pool_tokens(received, ctx.positions, ctx.valid, self.pool, self.pool_width)


# ---------------------------------------------------------------- shared pieces
def recent(t: torch.Tensor, window: int) -> torch.Tensor:
    """The last ``window`` entries along dim 1 (queries are stored oldest first)."""
    return t[:, -window:]


def window_attention(ctx: EvictionContext, window: int, gqa: str) -> torch.Tensor:
    """Attention probabilities of the recent queries per KV head, ``[B, Hkv, W, L]``.

    Each valid query's row sums to 1 over the slots it may see; rows of invalid
    queries (and of queries that see no live slot) are zero.
    """
    if ctx.queries is None or ctx.query_valid is None:
        raise ValueError(f"attention scoring needs the last {window} queries; the store must fill ctx.queries")
    B, Hkv, L, D = ctx.keys.shape
    q = ctx.queries[:, :, -window:]
    Hq, W = q.shape[1], q.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads cannot be grouped over {Hkv} KV heads")
    logits = window_logits(q.reshape(B, Hkv, Hq // Hkv, W, D), ctx.keys) * ctx.scaling
    sees = ctx.valid[:, None, :] & recent(ctx.query_valid, window)[:, :, None]  # [B, W, L]
    if ctx.query_positions is not None:
        sees = sees & (ctx.positions[:, None, :] <= recent(ctx.query_positions, window)[:, :, None])
    sees = sees[:, None, None]  # broadcast over heads and group
    if gqa == "max":
        logits = logits.amax(dim=2, keepdim=True)
    probs = logits.masked_fill(~sees, float("-inf")).softmax(dim=-1)
    probs = torch.where(sees, probs, torch.zeros_like(probs))  # also clears rows that saw nothing (NaN)
    return probs.mean(dim=2)


#: Whether torch writes a product of 16-bit CUDA matrices straight in fp32 (``bmm(..., out_dtype=)``).
BMM_TO_FP32 = hasattr(torch.ops.aten.bmm, "dtype")


def window_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q · k`` in fp32, ``[B, Hkv, G, W, L]``, of queries ``[B, Hkv, G, W, D]`` and keys
    ``[B, Hkv, L, D]`` (a view's keys lie token-major). Two 16-bit values multiply exactly in
    fp32, so for 16-bit CUDA inputs of one dtype the tensor cores' product with fp32 sums and an
    fp32 output gives the fp32 product's values (up to the order of the sums) without an fp32
    copy of the keys, which made a layer's scoring cost three times as much; elsewhere both
    operands go to fp32."""
    B, Hkv, G, W, D = q.shape
    L = keys.shape[2]
    if keys.is_cuda and BMM_TO_FP32 and keys.dtype in (torch.float16, torch.bfloat16) and q.dtype == keys.dtype:
        by_head = keys.contiguous().view(B * Hkv, L, D)
        out = torch.bmm(q.reshape(B * Hkv, G * W, D), by_head.transpose(1, 2), out_dtype=torch.float32)
        return out.view(B, Hkv, G, W, L)
    # fp32 in [B, Hkv, L, D] order: the einsum's batched product would copy token-major keys again
    keys = keys.to(torch.float32, memory_format=torch.contiguous_format)
    return torch.einsum("bhgwd,bhld->bhgwl", q.float(), keys)


def pool_tokens(
    scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, pool: str, width: int
) -> torch.Tensor:
    """Pool ``[B, H, L]`` scores along the live tokens in position order; zero on empty slots.

    Live tokens are sorted to the front by position and empty slots to the back, so
    a pooling window only ever spans live neighbours and border padding.
    """
    valid_h = valid[:, None, :].expand_as(scores)
    B, H, L = scores.shape
    if pool == "none" or width == 1 or L == 0:
        return torch.where(valid_h, scores, torch.zeros_like(scores))
    last = torch.iinfo(positions.dtype).max
    order = torch.argsort(torch.where(valid, positions, last), dim=1, stable=True)[:, None, :].expand(B, H, L)
    s = scores.gather(2, order)
    live = valid_h.gather(2, order)
    flat = s.reshape(B * H, 1, L)
    if pool == "max":
        flat = flat.masked_fill(~live.reshape(B * H, 1, L), float("-inf"))
        pooled = F.max_pool1d(flat, width, stride=1, padding=width // 2)
    else:
        flat = flat.masked_fill(~live.reshape(B * H, 1, L), 0.0)
        pooled = F.avg_pool1d(flat, width, stride=1, padding=width // 2, count_include_pad=True)
    out = torch.empty_like(scores).scatter_(2, order, pooled.view(B, H, L))
    return torch.where(valid_h, out, torch.zeros_like(out))


def reduce_heads(per_head: torch.Tensor, how: str, heads: HeadShards = LOCAL) -> torch.Tensor:
    """``[B, H, L]`` -> ``[B, L]``: one score per token, hence one keep set per (sequence, layer);
    over the heads of every tensor-parallel rank, so that all ranks keep the same tokens."""
    return heads.mean(per_head, dim=1) if how == "mean" else heads.amax(per_head, dim=1)
