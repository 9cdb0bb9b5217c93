"""Static mode: one reserve of blocks per row for all regions of a pool.

Static decode reserves every row's room before the first step. A region of its own reserves
what its class could ever hold, so ThinKV's R and E, which share one NVFP4 pool, would each
reserve the whole budget, though together they never hold more than it. Regions that share a
pool therefore draw from one stack of free blocks per row instead: a flush takes a block from
the row's stack when its class needs one (:func:`~kvcompose.ops.claim_slots.claim_slots`), and
an eviction gives a class's emptied blocks back (:func:`release_empty_blocks`), after moving the
class's newest tokens into its holes where they pile up (:func:`pack_holes`), as the eager
``ct`` pager does. So a row's blocks in the pool stay within its kept tokens plus a few blocks
per class, all with fixed shapes and no host read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..ops.claim_slots import slot_map
from ..ops.scatter_slots import copy_slots, fill_slots
from .pool import empty_value

if TYPE_CHECKING:
    from .region import Region


class RowReserve:
    """Free block ids of one pool per row (a stack each): ``ids`` ``[B, S + 1]``, the last column
    a sink for masked pushes, and ``count`` ``[B]`` ids on each row's stack."""

    def __init__(self, ids: torch.Tensor, count: torch.Tensor):
        self.ids = ids
        self.count = count

    @classmethod
    def fill(cls, pool_ids: torch.Tensor, free_per_row: torch.Tensor, width: int) -> RowReserve:
        """A reserve of ``width`` entries per row holding ``free_per_row[b]`` of ``pool_ids``, row by row."""
        B = free_per_row.shape[0]
        ids = torch.full((B, width + 1), -1, dtype=torch.long, device=pool_ids.device)
        ids[torch.arange(width + 1, device=pool_ids.device)[None, :] < free_per_row[:, None]] = pool_ids
        return cls(ids, free_per_row.clone())

    @property
    def width(self) -> int:
        return self.ids.shape[1] - 1

    def push(self, blocks: torch.Tensor, mask: torch.Tensor, overflow: torch.Tensor) -> None:
        """Put the ``mask``-selected ids of ``blocks`` (``[B, W]``) on their rows' stacks; a row
        that would hold more ids than it has blocks (a kvcompose bug) sets ``overflow``."""
        pushed = mask.sum(1)
        overflow |= (self.count + pushed > self.width).any().to(overflow.dtype)
        rank = mask.cumsum(1) - 1
        column = torch.where(mask, self.count[:, None] + rank, self.width).clamp(max=self.width)
        self.ids.scatter_(1, column, torch.where(mask, blocks, -1))
        self.ids[:, self.width] = -1
        self.count += pushed


def release_empty_blocks(region: Region) -> None:
    """Static mode: the blocks of ``region`` without a live slot go back to their rows' reserve and
    the row's later blocks move up a column (the eager :meth:`Region.release_empty_blocks`, with
    fixed shapes). The table keeps its invariant: a row's first ``num_blocks`` entries are
    its blocks, the rest -1."""
    table, bs = region.table, region.pool.block_size
    if table.shape[1] == 0:
        return
    owned = table >= 0
    live = region.pool.meta["valid"][table.clamp(min=0)].any(-1)
    empty = owned & ~live
    cols = torch.arange(table.shape[1], device=table.device)[None, :]
    written = (region.length[:, None] - cols * bs).clamp(min=0, max=bs)
    region.reserve.push(table, empty, region.overflow)
    region.length -= (written * empty).sum(1)
    region.num_blocks.copy_((owned & ~empty).sum(1))
    order = torch.argsort(empty.to(torch.int8), dim=1, stable=True)  # kept blocks first, in order
    table.copy_(torch.where(cols < region.num_blocks[:, None], table.gather(1, order), -1))


def pack_holes(region: Region, max_holes: int) -> None:
    """Static mode: in every row whose holes in ``region`` reach ``max_holes``, the tokens written
    last move into the earliest holes, so the row's live tokens fill its first slots (the eager
    :meth:`Region.pack_holes`: the k-th token past the live count goes to the k-th hole), with
    fixed shapes (:func:`~kvcompose.ops.scatter_slots.copy_slots`); then every block without a
    live token goes back (:func:`release_empty_blocks`). Blocks that were empty before count
    as given back already (the eager pager releases them first), so one release does both."""
    pool, table = region.pool, region.table
    if table.shape[1] == 0:
        return
    trash, bs = pool.trash_slot, pool.block_size
    phys = torch.where((table >= 0).repeat_interleave(bs, 1), slot_map(table, bs), trash)
    col = torch.arange(phys.shape[1], device=phys.device)[None, :]
    written = col < region.length[:, None]
    valid = pool.flat_slots(pool.meta)["valid"][phys] & written
    # the written slots of blocks that hold a live token, and their columns once the others are gone
    present = written & valid.view(*table.shape, bs).any(-1).repeat_interleave(bs, 1)
    rank = present.cumsum(1) - 1
    live = valid.sum(1)
    rows = (present.sum(1) - live) >= max_holes
    hole = rows[:, None] & present & (rank < live[:, None]) & ~valid
    moving = rows[:, None] & valid & (rank >= live[:, None])
    n = phys.shape[1]
    by_rank = torch.full((phys.shape[0], n + 1), trash, dtype=torch.long, device=phys.device)
    by_rank.scatter_(1, torch.where(hole, hole.cumsum(1) - 1, n), torch.where(hole, phys, trash))
    target = by_rank.gather(1, (moving.cumsum(1) - 1).clamp(min=0))
    for tensors in (pool.slots, pool.meta):
        for flat in pool.flat_slots(tensors).values():
            copy_slots(flat, phys, target, moving, trash)
    for name, flat in pool.flat_slots(pool.meta).items():
        fill_slots(flat, phys, moving, empty_value(name), trash)
    release_empty_blocks(region)
