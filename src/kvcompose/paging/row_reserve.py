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

from ..ops.pack_blocks import pack_plan, push_to_stacks, release_blocks
from ..ops.scatter_slots import pack_slots
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
        push_to_stacks(self.ids, self.count, blocks, mask, overflow)


def release_empty_blocks(region: Region) -> None:
    """Static mode: the blocks of ``region`` without a live slot go back to their rows' reserve and
    the row's later blocks move up a column (the eager :meth:`Region.release_empty_blocks`, with
    fixed shapes, in one launch: :func:`~kvcompose.ops.pack_blocks.release_blocks`). The table
    keeps its invariant: a row's first ``num_blocks`` entries are its blocks, the rest -1."""
    if region.table.shape[1] == 0:
        return
    pool, reserve = region.pool, region.reserve
    release_blocks(region.table, region.length, region.num_blocks, pool.flat_slots(pool.meta)["valid"],
                   pool.block_size, reserve.ids, reserve.count, region.overflow)


def pack_holes(region: Region, max_holes: int) -> None:
    """Static mode: in every row whose holes in ``region`` reach ``max_holes``, the tokens written
    last move into the earliest holes, so the row's live tokens fill its first slots (the eager
    :meth:`Region.pack_holes`: the k-th token past the live count goes to the k-th hole), with
    fixed shapes (the plan in one launch, :func:`~kvcompose.ops.pack_blocks.pack_plan`; the
    moves by :func:`~kvcompose.ops.scatter_slots.pack_slots`); then every block without a live
    token goes back (:func:`release_empty_blocks`). Blocks that were empty before count as given
    back already (the eager pager releases them first), so one release does both."""
    pool, table = region.pool, region.table
    if table.shape[1] == 0:
        return
    trash = pool.trash_slot
    phys, target, moving = pack_plan(table, region.length, pool.flat_slots(pool.meta)["valid"], pool.block_size,
                                     trash, max_holes)
    meta = pool.flat_slots(pool.meta)
    flats = [*pool.flat_slots(pool.slots).values(), *meta.values()]
    clear = [None] * len(pool.slots) + [empty_value(name) for name in meta]
    pack_slots(flats, phys, target, moving, trash, clear)  # one launch: every tensor moves, the sources empty
    release_empty_blocks(region)
