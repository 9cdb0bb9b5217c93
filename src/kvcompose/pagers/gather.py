"""The ``gather`` pager: compaction after eviction.

Evicted tokens leave holes; this pager copies each affected row's kept tokens into
fresh blocks of the same region (in position order, payload copied as stored, never
re-encoded), returns the old blocks to their pool, and packs the recent buffer. A pool
left with more than one free block per row and region gives the rest back
(:meth:`LayerStore.return_free_blocks`), so allocation follows the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..paging.region import Region
from ..paging.store import LayerStore, StoreView
from ..registry import register
from .base import Pager

@register("pager", "gather")
@dataclass
class GatherPager(Pager):
    """Copy kept tokens into fresh blocks and free the old ones (vLLM-style compaction)."""

    static_hole_blocks = 0  # compaction leaves no holes

    def compact(self, store: LayerStore, view: StoreView, keep: torch.Tensor) -> None:
        if keep.shape != view.valid.shape:
            raise ValueError(f"keep mask shape {tuple(keep.shape)} differs from the view's {tuple(view.valid.shape)}")
        if store.static:  # static decode: the same result with fixed shapes and no host read
            store.compact_static(view, keep & view.valid, in_place=False)
            return
        if bool((keep & ~view.valid).any()):
            raise ValueError("keep mask selects empty slots")
        rows = (view.valid & ~keep).any(1)
        if not bool(rows.any()):
            return
        for index, region in enumerate(store.regions):
            at = view.region == index
            region_rows = (at & view.valid & ~keep).any(1)
            if not bool(region_rows.any()):
                continue
            if not region.pool.codec.slot_local:
                raise ValueError(
                    f"format {region.pool.codec.name!r} shares scales across tokens, so its blocks cannot be compacted "
                    "without re-quantizing; use it without eviction"
                )
            self.rewrite_rows(region, view.phys, keep & at, region_rows)
        cols = view.block_columns
        store.refill_buffer(store.buf_k, store.buf_v, store.buf_meta, keep[:, cols:])
        store.return_free_blocks()
        store.evictions += 1

    def rewrite_rows(self, region: Region, phys: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> None:
        """Rewrite the ``rows`` (``[B]`` bool) of one region that lost tokens: their ``kept``
        tokens (columns of the view, ``phys`` their pool slots) go, in column order, into
        fresh blocks, and the old blocks go back to the pool."""
        pool = region.pool
        src = phys[kept & rows[:, None]]
        # Read the kept payload first: the blocks it lives in are about to be reused.
        slots = {n: t[src] for n, t in pool.flat_slots(pool.slots).items()}
        meta = {n: t[src] for n, t in pool.flat_slots(pool.meta).items()}
        region.release_rows(rows)
        region.place(kept & rows[:, None], slots, {}, meta)
