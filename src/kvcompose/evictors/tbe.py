"""TBE, ThinKV's thought-based eviction: segments step down a retention schedule.

From "ThinKV: Thought-Adaptive KV Cache Compression for Efficient Reasoning Models"
(Ramachandran et al., arXiv:2510.01290), §3.3.

Generated tokens form segments of ``ctx.segment`` tokens (ThinKV's τ = 128), each of
one thought class. Called when a segment completes (``segment_end`` trigger), this
evictor decides a target size for every completed segment and then keeps, inside
each shrinking segment, the tokens nearest the K-means centroids of its post-RoPE
keys (:func:`kvcompose.ops.kmeans.kmeans_select`):

- Case 1: the segment that just ended is a transition (class ``transition``): every
  earlier segment steps down to the next retention value below its size, from
  ``retention`` = (64, 32, 16, 8, 4); a segment at the last value stays.
- Case 2: while a row holds more than its budget (``ctx.keep``), its least important
  segment (``importance`` order, most important first), oldest first among equals,
  steps down one level.

Segment levels are not stored: a segment's size says where it is on the schedule,
since every step-down sets it to a schedule value. Prompt tokens and the open segment
are never evicted here; tokens of completed segments are, wherever they sit (a
just-completed segment may still be partly in the recent buffer). Tokens the policy
protects (``sinks``, ``protect_recent``, ``protect_prompt``) always survive, so a
shrunk segment can keep more than its target. With no segment left to shrink a row
may stay above the budget; the schedule's floor is deliberate (ThinKV keeps at least
4 tokens of every thought).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compiled import fused
from ..device_constants import device_constant
from ..ops.kmeans import kmeans_select
from ..registry import register
from .base import EvictionContext, Evictor


@register("evictor", "tbe")
@dataclass
class ThoughtEvictor(Evictor):
    """ThinKV TBE: segment step-downs on transitions and over budget, K-means keeps representatives."""

    retention: tuple[int, ...] = (64, 32, 16, 8, 4)  # per-segment sizes, descending (ThinKV R)
    transition: str = "T"  # the class whose completion steps every earlier segment down
    importance: tuple[str, ...] = ("R", "E", "T")  # most important first (ThinKV: R > E > T)
    kmeans_iters: int = 10  # fixed Lloyd rounds

    graph_safe = True  # fixed shapes once static decode sets ctx.columns_limit; no host reads
    reads_keys_by_column = True  # K-means reads the generated segments' keys only

    def __post_init__(self) -> None:
        self.retention = tuple(self.retention)
        self.importance = tuple(self.importance)
        r = self.retention
        if not r or any(not isinstance(x, int) or x < 1 for x in r) or list(r) != sorted(set(r), reverse=True):
            raise ValueError(f"tbe evictor: retention must be strictly decreasing positive ints, got {list(r)!r}")
        if not isinstance(self.kmeans_iters, int) or self.kmeans_iters < 0:
            raise ValueError(f"tbe evictor: kmeans_iters must be an int >= 0, got {self.kmeans_iters!r}")

    def min_kept(self, prompt_columns: int, new_tokens: int, segment: int) -> int:
        """The prompt is never evicted and a completed segment never shrinks below the last
        retention value, so a long run keeps more than a small budget."""
        return prompt_columns + (new_tokens // max(segment, 1)) * min(segment, self.retention[-1])

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The retention values ascending after ``R`` copies of the floor (so a step past the
        floor reads the floor), and the offsets ``R - 1, ..., 0`` of the values 1..R steps down."""
        R, ascending = len(self.retention), tuple(sorted(self.retention))
        return (device_constant((ascending[0],) * R + ascending, device),
                device_constant(tuple(range(R - 1, -1, -1)), device))

    def _next(self, size: torch.Tensor) -> torch.Tensor:
        """The next retention value below ``size`` (``size`` itself at or under the floor)."""
        return steps_down(size, *self._tables(size.device), 1)[..., 0]

    def _levels(self, size: torch.Tensor) -> torch.Tensor:
        """``[..., R + 1]``: ``size``, then the next retention value below, again and again (the
        floor is reached within ``R`` steps; a size at or under it stays)."""
        return levels(size, *self._tables(size.device))

    def select(self, ctx: EvictionContext) -> torch.Tensor:
        if ctx.segment < 1 or ctx.classes is None or not ctx.class_names:
            raise ValueError("tbe evictor needs token classes and the policy's refresh period (segment size)")
        tau, B = ctx.segment, ctx.valid.shape[0]
        S = self._segment_columns(ctx)
        if S == 0:
            return ctx.valid.clone()
        names = list(ctx.class_names)
        # the order segments step down in: by importance rank (n + 1 - rank at class + 1; an empty segment,
        # class -1, reads the first entry, n + 2), then oldest first
        rank = [self.importance.index(n) if n in self.importance else len(self.importance) for n in names]
        by_class = device_constant((len(names) + 2,) + tuple(len(names) + 1 - r for r in rank), ctx.valid.device)
        transition = names.index(self.transition) if self.transition in names else -1
        cols, live, goal, shrinks, rows = plan_segments(
            ctx.valid, ctx.positions, ctx.classes, ctx.keep, *self._tables(ctx.valid.device), by_class,
            ctx.prompt_columns, tau, S, transition)
        # K-means keeps each shrinking segment's representatives
        if ctx.keys is not None:  # a view with its keys decoded: read them in place
            keys, slots = ctx.keys, (rows, cols.view(B * S, tau))
        else:  # only the segments' columns decoded
            keys, slots = ctx.keys_at(rows, cols.view(B * S, tau)), None
        chosen = kmeans_select(keys, live.view(B * S, tau), goal.view(-1), iters=self.kmeans_iters,
                               max_k=max(self.retention), validate=False, slots=slots, heads=ctx.heads)
        return kept_tokens(ctx.valid, ctx.protected, cols, live, chosen.view(B, S, tau), shrinks)

    @staticmethod
    def _segment_columns(ctx: EvictionContext) -> int:
        """How many segments the per-segment tensors hold: all the run can complete when static
        decode says how long it is (fixed shapes, no host read), else those completed so far."""
        if ctx.columns_limit is not None:
            return max(0, ctx.columns_limit - ctx.prompt_columns) // ctx.segment
        done = completed_segments(ctx.valid, ctx.positions, ctx.prompt_columns, ctx.segment)[2]
        return int(done.max()) if done.numel() else 0


# ---------------------------------------------------------------- the bookkeeping, as pure functions
def completed_segments(valid, positions, prompt_columns: int, tau: int):
    """Generated tokens ``[B, L]``, each one's segment (-1: none), and the completed segments per row ``[B]``."""
    gen = valid & (positions >= prompt_columns)
    seg = torch.where(gen, (positions - prompt_columns) // tau, -1)
    newest = seg.amax(1)  # index of the newest (possibly open) segment per row
    done = torch.where(newest >= 0, (positions.amax(1) - prompt_columns + 1) // tau, 0)
    return gen, seg, done


def steps_down(size: torch.Tensor, padded: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., n]``: the retention value 1, 2, ..., ``n`` steps below ``size``, from one search of the
    table ``padded`` (:meth:`ThoughtEvictor._tables`); the minimum with ``size`` keeps a size at or
    under the floor."""
    R = offsets.shape[0]
    below = (padded[R:] < size[..., None]).sum(-1, keepdim=True)  # retention values under size (R is small)
    return torch.minimum(padded[below + offsets[:n]], size[..., None])


def levels(size: torch.Tensor, padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[..., R + 1]``: ``size``, then the values 1..R steps down the retention schedule."""
    return torch.cat([size[..., None], steps_down(size, padded, offsets, offsets.shape[0])], dim=-1)


def segment_sizes_and_classes(seg, gen, classes, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` live tokens of each segment, and its class (-1 where empty): one scatter
    over the columns each, not a ``[B, L, S]`` membership tensor. Columns outside the
    segments (prompt, empty, beyond ``S``) land in a spare last column."""
    B = seg.shape[0]
    at = torch.where(gen, seg.clamp(max=S), S)
    size = torch.zeros(B, S + 1, dtype=torch.long, device=seg.device).scatter_add_(1, at, gen.long())
    cls = torch.full((B, S + 1), -1, dtype=torch.long, device=seg.device).scatter_reduce_(
        1, at, torch.where(gen, classes, -1), reduce="amax")
    return size[:, :S], cls[:, :S]


def step_down_over_budget(target, closed, order_key, held, keep, padded, offsets) -> torch.Tensor:
    """Case 2 without a loop over rounds: while a row holds more than ``keep``, its least
    important, oldest segment that can still shrink steps down one level. That order is
    fixed (a segment goes down to its floor before the next one moves), so the moves form
    one sequence per row; a move happens while the tokens held before it exceed ``keep``,
    which makes the moves taken a prefix of it (cumulative savings). ``order_key``: ``[B, S]``,
    ascending in that order. No host reads."""
    B, S = target.shape
    chain = levels(target, padded, offsets)  # [B, S, R + 1]
    saving = (chain[..., :-1] - chain[..., 1:]) * closed[..., None]  # [B, S, R]
    order = torch.argsort(order_key, dim=1, stable=True)
    ranked = saving.gather(1, order[..., None].expand_as(saving)).reshape(B, -1)
    before = ranked.cumsum(1) - ranked
    taken = ((held[:, None] - before) > keep[:, None]) & (ranked > 0)
    moves = torch.empty_like(target).scatter_(1, order, taken.view(B, S, -1).sum(-1))
    return chain.gather(2, moves[..., None])[..., 0]


@fused
def plan_segments(valid, positions, classes, keep, padded, offsets, by_class, prompt_columns: int, tau: int,
                  S: int, transition: int):
    """Every completed segment's target size (cases 1 and 2), and what K-means needs for the
    segments that shrink: ``cols`` ``[B, S, tau]``, the columns of each segment's tokens; ``live``,
    which of them hold one; ``goal`` ``[B, S]``, the representatives to keep (0: the segment keeps
    its size, and K-means skips it); ``shrinks``; and ``rows`` ``[B * S]``, each segment's row.

    A row's slots sorted by position hold its prompt, then each segment's tokens in a run
    (a segment spans ``tau`` positions), so segment ``s`` of row ``b`` starts at the row's
    prompt tokens plus the sizes of its earlier segments (seeds and ties of K-means follow
    position order, whatever slots the tokens lie in). ``transition``: the index of the class
    whose completion steps every earlier segment down (-1: none); ``by_class``: each class's
    step-down rank at ``class + 1`` (an empty segment's first). Pure tensor work without host
    reads: one fused graph in a fused decode."""
    B, L = valid.shape
    gen, seg, done = completed_segments(valid, positions, prompt_columns, tau)
    idx = torch.arange(S, device=valid.device)
    size, cls = segment_sizes_and_classes(seg, gen, classes, S)
    target = size  # replaced, never written in place
    if transition >= 0:  # case 1: the segment that just completed is a transition -> every earlier one steps down
        last = (done - 1).clamp(min=0)
        ended_t = (done > 0) & (cls.gather(1, last[:, None])[:, 0] == transition)
        earlier = (idx[None, :] < last[:, None]) & ended_t[:, None]  # closed: last < done
        target = torch.where(earlier, steps_down(target, padded, offsets, 1)[..., 0], target)
    # case 2: over budget -> least important, oldest completed segment steps down, repeatedly
    order_key = by_class[cls + 1] * S + idx[None, :]
    target = step_down_over_budget(target, idx[None, :] < done[:, None], order_key,
                                   valid.sum(1) - (size - target).sum(1), keep, padded, offsets)
    by_position = torch.argsort(torch.where(valid, positions, torch.iinfo(torch.long).max), dim=1, stable=True)
    start = (valid & ~gen).sum(1, keepdim=True) + size.cumsum(1) - size  # [B, S]
    offset = torch.arange(tau, device=valid.device)
    live = offset < size[..., None]  # [B, S, tau]
    cols = by_position.gather(1, (start[..., None] + offset).clamp(max=L - 1).view(B, -1)).view(B, S, tau)
    cols = torch.where(live, cols, 0)  # past a segment's tokens: slot 0, whatever order the sort left empty slots in
    shrinks = target < size
    rows = torch.arange(B, device=valid.device).repeat_interleave(S)
    return cols, live, torch.where(shrinks, target, 0), shrinks, rows


@fused
def kept_tokens(valid, protected, cols, live, chosen, shrinks) -> torch.Tensor:
    """``[B, L]``: the live tokens that stay, every one outside the shrinking segments, K-means'
    choice ``chosen`` ``[B, S, tau]`` inside them, and the protected ones wherever they are."""
    B, L = valid.shape
    drop = live & ~chosen & shrinks[..., None]
    dropped = torch.zeros(B, L, dtype=torch.int32, device=valid.device).scatter_add_(
        1, cols.view(B, -1), drop.view(B, -1).to(torch.int32))
    return valid & ((dropped == 0) | protected)
