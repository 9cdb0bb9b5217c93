"""The ``share`` pager: several block-table entries of a sequence on one physical block.

ReasonCache's zero-copy sharing, from "ReasonCache: Accelerating Large Reasoning Model
Serving through KV Cache Sharing" (Chen et al., arXiv:2507.21433), §IV-B. A block is
*sealed* once all its slots are written; from then on nothing writes into it.
:meth:`SharePager.share` points a row's sealed logical block at another sealed physical
block of the same row and layer: the target's reference count goes up, the replaced
block's goes down, and a block returns to its pool only when no entry references it any
more. Memory accounting counts a physical block once (:meth:`Region.blocks_written`),
while attention and evictors read every logical entry, so the tokens of a shared entry
are the target's keys and values (with the target's positions: those keys carry the
target's rotary positions).

Eviction composes with sharing by working on logical entries: a full block whose tokens
are all kept stays where it is (shared or not, nothing is copied); the kept tokens of
every other block of an affected row are copied into fresh blocks after those, and the
old entries drop their reference. So evicting from a shared block never touches the data
that another entry still reads. A region's tokens are then no longer in position order;
every slot carries its position, which is what attention and evictors read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..paging.region import Region
from ..paging.store import LayerStore
from ..registry import register
from .gather import GatherPager


@register("pager", "share")
@dataclass
class SharePager(GatherPager):
    """Map near-duplicate sealed blocks of a sequence onto one physical block, with reference counts."""

    shares_blocks = True  # LayerStores built for this pager count references per block

    def check_store(self, store: LayerStore) -> None:
        """Refuse stores this pager cannot serve, naming what would be accepted."""
        if store.static:
            raise ValueError("share pager: static decode (fixed capacity) is not supported; decode with fast=False")
        if len(store.regions) != 1:
            raise ValueError(f"share pager: the store has {len(store.regions)} token classes "
                             f"{store.class_names}; sharing works on one class (one precision format)")
        if store.regions[0].pool.refs is None:
            raise ValueError("share pager: the store's pool does not count references; build it with "
                             "Policy.make_store (LayerStore(..., refcounted=True))")
        if not store.regions[0].pool.codec.slot_local:
            raise ValueError(f"share pager: format {store.regions[0].pool.codec.name!r} shares scales across "
                             "tokens; sharing needs a slot-local format (bf16/fp16/fp32, fp8, nvfp4, ternary, int "
                             "per_token)")

    def share(self, store: LayerStore, rows: torch.Tensor, targets: torch.Tensor, sources: torch.Tensor,
              check: bool = True) -> None:
        """Point entry ``targets[i]`` of row ``rows[i]`` at the physical block of entry
        ``sources[i]`` of the same row (all ``[N]`` int64 block-table columns). Both entries
        must be sealed; a target may appear once and may not be a source of the same call.
        ``check=False`` skips verifying that, and takes each target's block to have no other
        reference (it is freed without reading the counts back): for callers that chose the
        entries from the block tables themselves, as the sharing tracker does with the own
        blocks of a step it has not decided yet."""
        self.check_store(store)
        region = store.regions[0]
        if rows.numel() == 0:
            return
        if check:
            self._check_pairs(region, rows, targets, sources)
        new = region.table[rows, sources]
        old = region.table[rows, targets]
        region.pool.add_refs(new)
        region.table[rows, targets] = new
        region.pool.release(old, last=not check)

    @staticmethod
    def _check_pairs(region: Region, rows, targets, sources) -> None:
        if not (rows.shape == targets.shape == sources.shape) or rows.dim() != 1:
            raise ValueError(f"share: rows, targets and sources must be 1-d of one length, got shapes "
                             f"{tuple(rows.shape)}, {tuple(targets.shape)}, {tuple(sources.shape)}")
        if bool(((rows < 0) | (rows >= region.batch_size)).any()):
            raise ValueError(f"share: rows {rows.tolist()} must lie in [0, {region.batch_size})")
        sealed = region.length[rows] // region.pool.block_size
        for name, cols in (("targets", targets), ("sources", sources)):
            if bool(((cols < 0) | (cols >= sealed)).any()):
                raise ValueError(f"share: {name} {cols.tolist()} must be sealed (full) blocks of their rows, i.e. "
                                 f"columns below {sealed.tolist()}")
        keys_t = rows * region.table.shape[1] + targets
        keys_s = rows * region.table.shape[1] + sources
        if torch.unique(keys_t).numel() != keys_t.numel() or bool(torch.isin(keys_t, keys_s).any()):
            raise ValueError("share: a target entry appears twice or is also a source in one call")

    def rewrite_rows(self, region: Region, phys: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows that lost tokens keep their full, untouched blocks where they are (shared ones
        included); the kept tokens of their other blocks move into fresh blocks after those."""
        bs = region.pool.block_size
        table = region.used_table()
        B, W = table.shape
        width = W * bs
        valid = region.pool.flat_slots(region.pool.meta)["valid"][phys[:, :width].clamp(min=0)] & (phys[:, :width] >= 0)
        k = (kept[:, :width] & valid).view(B, W, bs)
        owned = torch.arange(W, device=table.device)[None, :] < region.num_blocks[:, None]
        stay = owned & (valid.view(B, W, bs).all(-1) & k.all(-1) | ~rows[:, None])
        moving = (k & ~stay[:, :, None]).view(B, width)
        src = phys[:, :width][moving]
        slots = {n: t[src] for n, t in region.pool.flat_slots(region.pool.slots).items()}
        meta = {n: t[src] for n, t in region.pool.flat_slots(region.pool.meta).items()}
        region.pool.release(table[owned & ~stay])
        order = torch.argsort((~stay).to(torch.int8), dim=1, stable=True)  # staying entries first, in order
        n_stay = stay.sum(1)
        cols = torch.arange(W, device=table.device)[None, :]
        region.table[:, :W] = torch.where(cols < n_stay[:, None], table.gather(1, order), -1)
        region.length = torch.where(rows, n_stay * bs, region.length)
        region.num_blocks = n_stay
        region.place(moving, slots, {}, meta)
