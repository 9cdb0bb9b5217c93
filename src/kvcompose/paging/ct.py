"""The ``ct`` (Continuous Thinking) pager: evict in place, refill holes, never compact.

ThinKV's pager (§4.2). Eviction only clears the live bit of the evicted slots (the
block's eviction mask); nothing moves and no block is freed. The next tokens of the
same class, when their group leaves the recent buffer, are written into those holes
before the row takes a new block, so a block always holds tokens of one class (one
region per class) and the gather copy of :class:`~kvcompose.paging.GatherPager` never
happens. Attention does not care about slot order, so the tokens of a block need not
be in position order; every slot carries its absolute position. A block whose tokens
were all evicted goes back to the pool, where any class can take it; no token leaves its
block or its offset (the pool may renumber whole blocks when it gives free ones back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register
from .gather import Pager
from .store import LayerStore, StoreView


@register("pager", "ct")
@dataclass
class ContinuousThinkingPager(Pager):
    """Mark evicted slots free in place; later tokens of the same class refill them (ThinKV's CT)."""

    def compact(self, store: LayerStore, view: StoreView, keep: torch.Tensor) -> None:
        if keep.shape != view.valid.shape:
            raise ValueError(f"keep mask shape {tuple(keep.shape)} differs from the view's {tuple(view.valid.shape)}")
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
                flat[slots] = -1 if name == "pos" else 0
            region.has_holes = True
            region.release_empty_blocks()
        cols = view.block_columns
        store.refill_buffer(store.buf_k, store.buf_v, store.buf_meta, keep[:, cols:])
        store.return_free_blocks()
        store.evictions += 1
