"""The ``ct`` (Continuous Thinking) pager: evict in place, refill holes, never compact.

ThinKV's pager, from "ThinKV: Thought-Adaptive KV Cache Compression for Efficient
Reasoning Models" (Ramachandran et al., arXiv:2510.01290), §4.2. Eviction only clears
the live bit of the evicted slots (the block's eviction mask); nothing moves and no
block is freed. The next tokens of the same class, when their group leaves the recent
buffer, are written into those holes before the row takes a new block, so a block always
holds tokens of one class (one region per class) and the gather copy of
:class:`~kvcompose.pagers.GatherPager` never happens. Attention does not care about slot
order, so the tokens of a block need not be in position order; every slot carries its
absolute position. A block whose tokens were all evicted goes back to the pool, where
any class can take it.

Refilling only within a class lets holes pile up: when the mix of classes drifts, one
class's blocks sit half empty while another takes new ones, and the cache grows for
thousands of steps although the kept tokens do not (the paper's rule, ``max_hole_blocks=None``).
By default a sequence whose holes in one class reach ``max_hole_blocks`` blocks' worth has
that class's newest tokens moved into its oldest holes and the emptied blocks returned,
so memory stays within that many blocks per (sequence, class) of the kept tokens. Tokens
move only then; otherwise none leaves its block or its offset (the pool may renumber
whole blocks when it gives free ones back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..paging.pool import empty_value
from ..paging.store import LayerStore, StoreView
from ..registry import register
from ..validation import is_int_at_least
from .base import Pager


@register("pager", "ct")
@dataclass
class ContinuousThinkingPager(Pager):
    """Mark evicted slots free in place; later tokens of the same class refill them (ThinKV's CT).

    ``max_hole_blocks``: a sequence's holes in one class that trigger moving its newest
    tokens into them, in blocks (``None``: never move a token).
    """

    max_hole_blocks: int | None = 1

    def __post_init__(self) -> None:
        m = self.max_hole_blocks
        if m is not None and not is_int_at_least(m, 1):
            raise ValueError(f"ct pager: max_hole_blocks={m!r}; accepted: an integer >= 1, or None to never move tokens")

    @property
    def static_hole_blocks(self) -> int | None:
        return self.max_hole_blocks  # holes reaching it are packed, in static mode too

    def compact(self, store: LayerStore, view: StoreView, keep: torch.Tensor) -> None:
        if keep.shape != view.valid.shape:
            raise ValueError(f"keep mask shape {tuple(keep.shape)} differs from the view's {tuple(view.valid.shape)}")
        if store.static:  # static decode: holes marked with fixed shapes and no host read
            store.compact_static(view, keep & view.valid, in_place=True, max_hole_blocks=self.max_hole_blocks)
            return
        if bool((keep & ~view.valid).any()):
            raise ValueError("keep mask selects empty slots")
        evicted = view.valid & ~keep
        if not bool(evicted.any()):
            return
        for index, region in enumerate(store.regions):
            at = evicted & (view.region == index)
            if not bool(at.any()):
                continue
            pool = region.pool
            if not pool.codec.slot_local:
                raise ValueError(f"format {pool.codec.name!r} shares scales across tokens; it cannot be evicted from")
            slots = view.phys[at]
            for name, flat in pool.flat_slots(pool.meta).items():
                flat[slots] = empty_value(name)
            region.has_holes = True
            region.release_empty_blocks()
            if self.max_hole_blocks is not None:
                region.pack_holes(self.max_hole_blocks * pool.block_size)
        cols = view.block_columns
        store.refill_buffer(store.buf_k, store.buf_v, store.buf_meta, keep[:, cols:])
        store.return_free_blocks()
        store.evictions += 1
