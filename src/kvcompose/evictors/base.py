"""The evictor contract: score candidate tokens, keep the best per (sequence, layer).

An evictor sees one layer of a batch as dense tensors (an :class:`EvictionContext`)
and returns a boolean keep mask. Scoring is vectorized over the batch; selection is
shared by every evictor (:func:`keep_top`) so protection, padding and per-row budgets
are handled once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..distributed import LOCAL, HeadShards


@dataclass
class EvictionContext:
    """One layer of a batch, as an evictor sees it.

    Shapes: ``B`` sequences, ``L`` candidate slots, ``Hkv`` KV heads, ``Hq`` query
    heads, ``W`` recorded recent queries, ``D`` head dim.
    """

    keys: torch.Tensor | None  # [B, Hkv, L, D] post-RoPE keys of the candidates; None: ask keys_at
    positions: torch.Tensor  # [B, L] absolute position of each slot (-1: empty)
    valid: torch.Tensor  # [B, L] bool: slot holds a live token
    keep: torch.Tensor  # [B] int64: how many tokens each row keeps
    protected: torch.Tensor  # [B, L] bool: tokens that must survive (sinks, recent, prompt)
    queries: torch.Tensor | None = None  # [B, Hq, W, D] recent queries, oldest first
    query_valid: torch.Tensor | None = None  # [B, W] bool
    query_positions: torch.Tensor | None = None  # [B, W] absolute position of each query; None: no causal mask
    scaling: float = 1.0  # softmax scale of the model's attention
    state: dict = field(default_factory=dict)  # {channel: [B, L] float}: the evictor's slot channels
    classes: torch.Tensor | None = None  # [B, L] int64 token class (index into class_names)
    class_names: tuple[str, ...] = ()  # the policy's token classes, e.g. ("R", "E", "T")
    prompt_columns: int = 0  # columns of the prefill: generated tokens have positions >= this
    segment: int = 0  # tokens per thought segment (the policy's refresh period), 0 if unused
    columns_limit: int | None = None  # static decode: columns the whole run appends (sizes per-segment tensors)
    check: bool = True  # test scores for NaN/inf (a host synchronization; static decode skips it)
    heads: HeadShards = LOCAL  # the ranks holding the layer's other KV heads: reduce over heads with it
    # (rows [S], cols [S, N]) -> [S, N, Hkv * D]: the keys of those columns (decoded for them alone where
    # ``keys`` is None: evictors with ``reads_keys_by_column``)
    keys_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def keep_top(scores: torch.Tensor, ctx: EvictionContext, check: bool | None = None) -> torch.Tensor:
    """Keep the ``ctx.keep[b]`` highest-scoring live tokens of each row; protected tokens first.

    Ties break toward the more recent token. Returns a ``[B, L]`` bool mask that
    is a subset of ``ctx.valid``. ``check`` (default ``ctx.check``): test the scores for
    NaN/inf, a host synchronization that static decode runs without (non-finite keys are
    flagged by the store there).
    """
    if scores.shape != ctx.valid.shape:
        raise ValueError(f"scores have shape {tuple(scores.shape)}, expected {tuple(ctx.valid.shape)}")
    if (ctx.check if check is None else check) and not torch.isfinite(torch.where(ctx.valid, scores, 0.0)).all():
        raise ValueError("evictor produced NaN/inf scores for live tokens")
    scores = torch.nan_to_num(scores, nan=float("-inf"))  # unchecked NaN never outranks a protected token
    s = torch.where(ctx.protected & ctx.valid, torch.full_like(scores, float("inf")), scores)
    s = torch.where(ctx.valid, s, torch.full_like(s, float("-inf")))
    # Two stable sorts: by position first, then by score, so ties go to the newer token.
    by_recency = torch.argsort(ctx.positions, dim=1, descending=True, stable=True)
    by_score = torch.argsort(s.gather(1, by_recency), dim=1, descending=True, stable=True)
    order = by_recency.gather(1, by_score)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(s.shape[1], device=s.device).expand_as(order))
    return (rank < ctx.keep.unsqueeze(1)) & ctx.valid


class Evictor:
    """Base class: subclasses implement :meth:`scores` (higher = more worth keeping).

    An evictor that accumulates something per token over many steps (H2O's
    attention received) names it in :attr:`slot_channels`. The store keeps one
    float per slot for each name, zero when a token arrives, moved with the token
    when slots are compacted and dropped with it on eviction, and passes the
    current values as ``ctx.state[name]`` aligned with the slots. So the evictor
    itself holds no per-sequence state and nothing can drift out of alignment.
    """

    #: How many recent queries the evictor needs the attention function to record.
    query_window: int = 0
    #: Whether the attention function must compute probabilities and call :meth:`observe`.
    needs_probs: bool = False
    #: Names of the per-slot float channels the store must keep for this evictor.
    slot_channels: tuple[str, ...] = ()
    #: A slot channel that only accumulates each step's attention probability averaged over
    #: the query heads (what :meth:`observe` adds on a decode step): the fused decode attention
    #: then adds it on the device and no probabilities are materialized. None: decode steps
    #: call :meth:`observe` with the probabilities. A subclass that overrides :meth:`observe`
    #: with anything else must set this back to None.
    mass_channel: str | None = None
    #: Whether :meth:`scores` reads keys or queries (False: positions and slot channels only,
    #: which static decode can evict from inside a captured step).
    reads_keys: bool = True
    #: Whether :meth:`select` reads keys only through ``ctx.keys_at``, for a few columns of each row
    #: (ThinKV's K-means over generated segments): the context then holds no decoded keys
    #: (``ctx.keys`` is None), and only the columns asked for are decoded.
    reads_keys_by_column: bool = False
    #: What :meth:`scores` returns for an evictor that reads no keys: ``"position"`` or the
    #: name of one slot channel (static decode then drops one token per step without sorting,
    #: see :mod:`kvcompose.ops.evict_one`); None: only :meth:`scores` knows.
    score_source: str | None = None
    #: Whether :meth:`select` keeps fixed shapes and reads nothing on the host when
    #: ``ctx.check`` is False: static decode then replays its eviction steps as a CUDA graph
    #: (False: they run eagerly, outside the graphs).
    graph_safe: bool = False

    def min_kept(self, prompt_columns: int, new_tokens: int, segment: int) -> int:
        """The fewest tokens per row this evictor can leave after ``new_tokens`` decode steps,
        whatever the budget (0: it can go down to the budget). Static decode sizes its
        capacity from the larger of the two."""
        return 0

    def scores(self, ctx: EvictionContext) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def select(self, ctx: EvictionContext) -> torch.Tensor:
        """Return the ``[B, L]`` keep mask for this layer."""
        return keep_top(self.scores(ctx), ctx)

    def observe(self, attn_probs: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Turn one step's attention into per-slot increments of the slot channels.

        Called after every attention of a layer (prefill included) when
        :attr:`needs_probs` is set. ``attn_probs`` is ``[B, Hq, Lq, L]``, the softmax
        of the step's queries over the layer's slots in view order; rows of padding
        queries must be zero (the attention function zeroes them), or padding would
        count as attention received. ``valid`` is ``[B, L]``. Returns
        ``{channel: [B, L] increment}`` for the store to add. The increments must add up
        over queries: a long prefill's queries come in chunks (so that its probabilities
        never exist whole) and the store adds the chunks' sum. They must be means over the
        heads: under tensor parallelism each rank sees its own heads, and the cache averages
        the ranks' increments into the mean over all of them.
        """
        return None
