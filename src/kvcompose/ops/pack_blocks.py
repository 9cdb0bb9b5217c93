"""The bookkeeping of a static eviction's packing and block release, one launch each.

After an in-place eviction, a region whose rows share a reserve of blocks
(:mod:`kvcompose.paging.row_reserve`, ThinKV's R and E) moves each row's newest tokens into
its holes once they pile up, and gives every block without a live token back to the row's
stack of free blocks. Both are decided row by row from the row's block table, written
length and the pool's live bits. In torch ops each is about forty small kernels per region
(running counts over every slot, masks, a scatter and a gather, a stable sort of the
table), all launch time at decode batch sizes. :func:`pack_plan` and
:func:`release_blocks` do each in one program per row.

:func:`pack_plan_torch` and :func:`release_blocks_torch` are the plain-torch references (and
the CPU path).
"""

from __future__ import annotations

import torch

from .claim_slots import slot_map
from .dispatch import step_kernel_runs
from .triton_shim import jit, next_pow2, tl


@jit
def _pack_plan_kernel(table_ptr, length_ptr, valid_ptr, phys_ptr, target_ptr, moving_ptr, scratch_ptr,
                      W, trash, max_holes, BS: tl.constexpr, N_P: tl.constexpr):
    """Row ``b``'s plan over its ``W * BS`` columns (padded to ``N_P``): see :func:`pack_plan_torch`."""
    b = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, N_P)
    inside = col < W * BS
    block = tl.load(table_ptr + b * W + col // BS, mask=inside, other=-1)
    phys = tl.where(block >= 0, block * BS + col % BS, trash)
    written = inside & (col < tl.load(length_ptr + b))
    valid = written & (tl.load(valid_ptr + phys, mask=inside, other=0) != 0)
    block_live = tl.max(tl.reshape(valid.to(tl.int32), [N_P // BS, BS]), 1)
    present = written & (tl.reshape(tl.broadcast_to(block_live[:, None], [N_P // BS, BS]), [N_P]) != 0)
    rank = tl.cumsum(present.to(tl.int32), 0) - 1
    live = tl.sum(valid.to(tl.int32), 0)
    packs = (rank * 0 + tl.sum(present.to(tl.int32), 0) - live) >= max_holes  # per column: the row packs
    hole = packs & present & (rank < live) & (valid == 0)
    moving = packs & valid & (rank >= live)
    tl.store(scratch_ptr + b * N_P + tl.cumsum(hole.to(tl.int32), 0) - 1, phys, mask=hole)
    tl.debug_barrier()  # the scratch row is read back below, by other threads than wrote it
    into = tl.maximum(tl.cumsum(moving.to(tl.int32), 0) - 1, 0)
    target = tl.load(scratch_ptr + b * N_P + into, mask=moving, other=trash)
    tl.store(phys_ptr + b * W * BS + col, phys, mask=inside)
    tl.store(target_ptr + b * W * BS + col, tl.where(moving, target, trash), mask=inside)
    tl.store(moving_ptr + b * W * BS + col, moving.to(tl.int8), mask=inside)


def pack_plan(table: torch.Tensor, length: torch.Tensor, valid: torch.Tensor, block_size: int, trash: int,
              max_holes: int, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which tokens of a region move into which holes: ``(phys, target, moving)``, each
    ``[B, W * block_size]`` over the rows' block tables ``table`` ``[B, W]`` (-1 past a row's
    blocks), ``length`` ``[B]`` written slots and the pool's flat live bits ``valid``.

    ``phys`` is each column's pool slot (``trash`` past the row's blocks). In a row whose
    holes (dead written slots in blocks that still hold a live token) reach ``max_holes``, the
    live tokens past the row's live count are ``moving``, the k-th of them to the k-th hole
    (``target``, ``trash`` elsewhere): the row's live tokens then fill its first slots.
    ``backend`` as the other per-step ops (:func:`~kvcompose.ops.dispatch.step_kernel_runs`)."""
    _check(table, length, valid)
    if not step_kernel_runs(table, _pack_plan_kernel, backend):
        return pack_plan_torch(table, length, valid, block_size, trash, max_holes)
    B, W = table.shape
    n_p = next_pow2(max(W * block_size, block_size))
    phys = torch.empty(B, W * block_size, dtype=torch.long, device=table.device)
    target, moving = torch.empty_like(phys), torch.empty(B, W * block_size, dtype=torch.int8, device=table.device)
    scratch = torch.empty(B, n_p, dtype=torch.long, device=table.device)  # each row's holes by rank
    _pack_plan_kernel[(B,)](table, length, valid.view(torch.uint8), phys, target, moving, scratch, W, trash,
                            max_holes, BS=block_size, N_P=n_p, num_warps=4)
    return phys, target, moving.bool()


def pack_plan_torch(table, length, valid, block_size: int, trash: int, max_holes: int):
    """Reference of :func:`pack_plan` in torch ops."""
    bs = block_size
    phys = torch.where((table >= 0).repeat_interleave(bs, 1), slot_map(table, bs), trash)
    col = torch.arange(phys.shape[1], device=phys.device)[None, :]
    written = col < length[:, None]
    live_slot = valid[phys] & written
    # the written slots of blocks that hold a live token, and their columns once the others are gone
    present = written & live_slot.view(*table.shape, bs).any(-1).repeat_interleave(bs, 1)
    rank = present.cumsum(1) - 1
    live = live_slot.sum(1)
    rows = (present.sum(1) - live) >= max_holes
    hole = rows[:, None] & present & (rank < live[:, None]) & ~live_slot
    moving = rows[:, None] & live_slot & (rank >= live[:, None])
    n = phys.shape[1]
    by_rank = torch.full((phys.shape[0], n + 1), trash, dtype=torch.long, device=phys.device)
    by_rank.scatter_(1, torch.where(hole, hole.cumsum(1) - 1, n), torch.where(hole, phys, trash))
    target = by_rank.gather(1, (moving.cumsum(1) - 1).clamp(min=0))
    return phys, torch.where(moving, target, trash), moving


@jit
def _release_kernel(table_ptr, length_ptr, num_blocks_ptr, valid_ptr, ids_ptr, count_ptr, overflow_ptr,
                    W, S, BS: tl.constexpr, W_P: tl.constexpr):
    """Row ``b``'s release over its ``W`` table columns (padded to ``W_P``): see :func:`release_blocks_torch`."""
    b = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, W_P)
    block = tl.load(table_ptr + b * W + w, mask=w < W, other=-1)
    owned = block >= 0
    slot = block[:, None] * BS + tl.arange(0, BS)[None, :]
    live = tl.max(tl.load(valid_ptr + slot, mask=owned[:, None], other=0).to(tl.int32), 1)
    empty = owned & (live == 0)
    kept = owned & (live != 0)
    length = tl.load(length_ptr + b)
    written = tl.minimum(tl.maximum(length - w * BS, 0), BS)
    count = tl.load(count_ptr + b)
    pushed = tl.sum(empty.to(tl.int32), 0)
    tl.atomic_or(overflow_ptr, 1, mask=count + pushed > S)
    column = count + tl.cumsum(empty.to(tl.int32), 0) - 1
    tl.store(ids_ptr + b * (S + 1) + column, block, mask=empty & (column < S))
    tl.debug_barrier()  # every thread has read the row's table and counts before they change
    tl.store(count_ptr + b, count + pushed)
    tl.store(length_ptr + b, length - tl.sum(tl.where(empty, written, 0), 0))
    n_kept = tl.sum(kept.to(tl.int32), 0)
    tl.store(num_blocks_ptr + b, n_kept.to(tl.int64))
    to = tl.cumsum(kept.to(tl.int32), 0) - 1  # kept blocks move up, in order; -1 after them
    tl.store(table_ptr + b * W + to, block, mask=kept)
    tl.store(table_ptr + b * W + w, tl.full([W_P], -1, tl.int64), mask=(w < W) & (w >= n_kept))


def release_blocks(table: torch.Tensor, length: torch.Tensor, num_blocks: torch.Tensor, valid: torch.Tensor,
                   block_size: int, ids: torch.Tensor, count: torch.Tensor, overflow: torch.Tensor,
                   backend: str | None = None) -> None:
    """Give each row's blocks without a live slot back to its stack of free blocks, in place.

    ``table`` ``[B, W]`` holds each row's blocks first (-1 after them), ``length`` ``[B]`` its
    written slots and ``num_blocks`` ``[B]`` its blocks; ``valid`` is the pool's flat live bits;
    ``ids`` ``[B, S + 1]`` and ``count`` ``[B]`` are the rows' stacks (the last column a sink).
    An emptied block goes onto the stack, its written slots leave ``length``, and the row's later
    blocks move up a column. A stack that would outgrow ``S`` sets ``overflow``.
    ``backend`` as :func:`pack_plan`."""
    _check(table, length, valid)
    if not table.is_contiguous() or not ids.is_contiguous():
        raise ValueError("release_blocks: the table and the stacks must be contiguous (they are written in place)")
    if not step_kernel_runs(table, _release_kernel, backend):
        release_blocks_torch(table, length, num_blocks, valid, block_size, ids, count, overflow)
        return
    B, W = table.shape
    _release_kernel[(B,)](table, length, num_blocks, valid.view(torch.uint8), ids, count, overflow, W,
                          ids.shape[1] - 1, BS=block_size, W_P=next_pow2(W), num_warps=4)


def release_blocks_torch(table, length, num_blocks, valid, block_size: int, ids, count, overflow) -> None:
    """Reference of :func:`release_blocks` in torch ops."""
    bs = block_size
    owned = table >= 0
    live = valid[slot_map(table, bs)].view(*table.shape, bs).any(-1)
    empty = owned & ~live
    cols = torch.arange(table.shape[1], device=table.device)[None, :]
    written = (length[:, None] - cols * bs).clamp(min=0, max=bs)
    push_to_stacks(ids, count, table, empty, overflow)
    length -= (written * empty).sum(1)
    num_blocks.copy_((owned & ~empty).sum(1))
    order = torch.argsort(empty.to(torch.int8), dim=1, stable=True)  # kept blocks first, in order
    table.copy_(torch.where(cols < num_blocks[:, None], table.gather(1, order), -1))


def push_to_stacks(ids: torch.Tensor, count: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor,
                   overflow: torch.Tensor) -> None:
    """Put the ``mask``-selected ids of ``blocks`` ``[B, W]`` on their rows' stacks ``ids``
    ``[B, S + 1]`` holding ``count`` ``[B]`` ids (the last column a sink for masked-out writes);
    a row that would hold more than ``S`` sets ``overflow``."""
    width = ids.shape[1] - 1
    pushed = mask.sum(1)
    overflow |= (count + pushed > width).any().to(overflow.dtype)
    rank = mask.cumsum(1) - 1
    column = torch.where(mask, count[:, None] + rank, width).clamp(max=width)
    ids.scatter_(1, column, torch.where(mask, blocks, -1))
    ids[:, width] = -1
    count += pushed


def _check(table: torch.Tensor, length: torch.Tensor, valid: torch.Tensor) -> None:
    if table.dtype != torch.long or length.dtype != torch.long or valid.dtype != torch.bool:
        raise ValueError(f"block tables and lengths must be int64 and the live bits bool; got {table.dtype}, "
                         f"{length.dtype} and {valid.dtype}")
    if table.dim() != 2 or length.shape != table.shape[:1] or valid.dim() != 1:
        raise ValueError(f"expected a table [B, W], lengths [B] and flat live bits [S]; got {tuple(table.shape)}, "
                         f"{tuple(length.shape)} and {tuple(valid.shape)}")
