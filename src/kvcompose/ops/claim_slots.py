"""Where a flushed group of every row goes in a region's blocks, in one launch.

When a static decode step flushes the recent buffer, each region (a token class's blocks)
takes the group's tokens of its class: first into the holes an in-place eviction left in the
row's written slots, in block order, then appended after the row's last written slot. Rows
and tokens that write nothing get the pool's trash slot, so shapes never depend on what is
written. In torch ops that is about fifty small kernels per region and flush (a running count
of the holes over each row's slots, then the slot arithmetic); :func:`claim_slots` does it in
one program per row, which scans the row's written slots once.

:func:`claim_slots_torch` is the plain-torch reference (and the CPU path).
"""

from __future__ import annotations

import torch

from .dispatch import step_kernel_runs
from .triton_shim import jit, next_pow2, tl

SCAN = 1024  # slots a program reads per iteration of its scan for holes


@jit
def _claim_slots_kernel(table_ptr, length_ptr, blocks_ptr, valid_ptr, mask_ptr, out_ptr, holes_ptr, overflow_ptr,
                        free_ptr, free_count_ptr, W, S1, trash, N: tl.constexpr, N_P: tl.constexpr,
                        BS: tl.constexpr, SCAN: tl.constexpr, RESERVE: tl.constexpr, NEW_P: tl.constexpr,
                        HOLES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    length = tl.load(length_ptr + b)
    n_holes = tl.zeros((), dtype=tl.int32)
    if HOLES:  # the row's first N holes, in block order, to its scratch row
        for start in range(0, W * BS, SCAN):
            col = start + tl.arange(0, SCAN)
            written = (col < length) & (col < W * BS)
            block = tl.maximum(tl.load(table_ptr + b * W + col // BS, mask=written, other=0), 0)
            phys = block * BS + col % BS
            hole = written & (tl.load(valid_ptr + phys, mask=written, other=1) == 0)
            rank = n_holes + tl.cumsum(hole.to(tl.int32), 0) - 1
            tl.store(holes_ptr + b * N + rank, phys, mask=hole & (rank < N))
            n_holes += tl.sum(hole.to(tl.int32), 0)
        tl.debug_barrier()  # the scratch row is read back below, by other threads than wrote it
    j = tl.arange(0, N_P)
    inside = j < N
    take = (tl.load(mask_ptr + b * N + j, mask=inside, other=0) != 0) & inside
    rank = tl.cumsum(take.to(tl.int32), 0) - 1
    end = length + tl.maximum(tl.sum(take.to(tl.int32), 0) - n_holes, 0)
    logical = tl.maximum(length - n_holes + rank, 0)
    column = tl.minimum(logical // BS, W - 1)
    slot = tl.load(table_ptr + b * W + column, mask=inside, other=0) * BS + logical % BS
    tl.atomic_or(overflow_ptr, 1, mask=end > W * BS)
    if RESERVE:  # blocks past the row's last come off its stack of free blocks, newest first
        owned = (length + BS - 1) // BS
        grow = (end + BS - 1) // BS - owned
        free = tl.load(free_count_ptr + b)
        tl.atomic_or(overflow_ptr, 1, mask=grow > free)
        fresh = tl.arange(0, NEW_P)
        new = (fresh < grow) & (fresh < free) & (owned + fresh < W)
        tl.store(table_ptr + b * W + owned + fresh, tl.load(free_ptr + b * S1 + free - 1 - fresh, mask=new, other=0),
                 mask=new)
        taken = logical // BS - owned  # >= 0: the token's block is the row's taken-th fresh one
        got = (taken < free) & (logical // BS < W)
        fresh_id = tl.load(free_ptr + b * S1 + tl.maximum(free - 1 - taken, 0), mask=inside & (taken >= 0) & got,
                           other=0)
        slot = tl.where(taken >= 0, tl.where(got, fresh_id * BS + logical % BS, trash), slot)
        tl.debug_barrier()  # every thread has read the count before it changes
        tl.store(free_count_ptr + b, free - tl.minimum(tl.minimum(tl.maximum(grow, 0), free), W - owned))
    into_hole = rank < n_holes
    hole_slot = tl.load(holes_ptr + b * N + tl.maximum(rank, 0), mask=take & into_hole, other=0)
    slot = tl.where(take, tl.where(into_hole, hole_slot, slot), trash)
    tl.store(out_ptr + b * N + j, slot, mask=inside)
    tl.store(length_ptr + b, end)
    tl.store(blocks_ptr + b, (end + BS - 1) // BS)


def claim_slots(table: torch.Tensor, length: torch.Tensor, num_blocks: torch.Tensor, valid: torch.Tensor,
                mask: torch.Tensor, trash: int, overflow: torch.Tensor, block_size: int,
                reserve: tuple[torch.Tensor, torch.Tensor] | None = None, backend: str | None = None,
                holes: bool = True) -> torch.Tensor:
    """The pool slots ``[B * N]`` (row-major) where the ``mask``-selected tokens of ``[B, N]`` go
    in a region whose rows own the blocks of ``table`` ``[B, W]`` and have written
    ``length`` ``[B]`` slots, ``valid`` being the pool's flat live bits: each row's earliest
    holes (written slots no longer valid) first, then the slots after its last written one;
    ``trash`` for tokens not selected. ``length`` and ``num_blocks`` advance in place; a row
    that outgrows its table sets ``overflow`` (its tokens land in its last block).

    ``reserve``: ``(ids [B, S + 1], count [B])``, each row's stack of free blocks
    (:class:`~kvcompose.paging.row_reserve.RowReserve`) when the table holds only the row's
    blocks so far (-1 after them): a row that needs more takes them off its stack, newest first,
    into its table; a row whose stack runs out sets ``overflow`` and sends what does not fit to
    ``trash``. Nothing is read on the host. ``backend`` as the other per-step ops
    (:func:`~kvcompose.ops.dispatch.step_kernel_runs`).

    ``holes=False``: the region can have none (nothing evicts it in place), so the scan of each
    row's written slots is left out. That scan is most of the launch at long rows: 48 µs a call
    at batch 16 and 8,192-token rows on an H200 (``profile_decode_gpu.json``, fullkv)."""
    B, N = mask.shape
    if table.dtype != torch.long or length.dtype != torch.long or mask.dtype != torch.bool:
        raise ValueError(f"claim_slots: table and length must be int64 and mask bool, got {table.dtype}, "
                         f"{length.dtype}, {mask.dtype}")
    if table.shape[0] != B or table.shape[1] < 1:
        raise ValueError(f"claim_slots: table {tuple(table.shape)} must have mask's {B} rows and a block or more")
    if not table.is_contiguous():
        raise ValueError("claim_slots: the table must be contiguous (new blocks are written into it)")
    if not step_kernel_runs(mask, _claim_slots_kernel, backend):
        return claim_slots_torch(table, length, num_blocks, valid, mask, trash, overflow, block_size, reserve, holes)
    out = torch.empty(B, N, dtype=torch.long, device=mask.device)
    scratch = torch.empty(B, N, dtype=torch.long, device=mask.device)  # each row's first holes
    free, count = reserve if reserve is not None else (table, length)  # unread without a reserve
    _claim_slots_kernel[(B,)](table, length, num_blocks, valid.view(torch.uint8), mask.contiguous(),
                              out, scratch, overflow, free, count, table.shape[1], free.shape[1], trash, N=N,
                              N_P=next_pow2(N), BS=block_size, SCAN=SCAN, RESERVE=reserve is not None,
                              NEW_P=next_pow2(-(-N // block_size) + 1), HOLES=holes, num_warps=4)
    return out.reshape(-1)


def claim_slots_torch(table, length, num_blocks, valid, mask, trash: int, overflow, block_size: int,
                      reserve: tuple[torch.Tensor, torch.Tensor] | None = None, holes: bool = True) -> torch.Tensor:
    """Reference of :func:`claim_slots` in torch ops."""
    bs, n = block_size, mask.shape[1]
    width = table.shape[1]
    phys, hole = holes_in_rows(table, length, valid, bs)
    if not holes:
        hole = torch.zeros_like(hole)
    hole_rank = hole.cumsum(1) - 1
    into = torch.where(hole & (hole_rank < n), hole_rank, n)  # column n collects the rest
    holes = phys.new_zeros(phys.shape[0], n + 1).scatter_(1, into, phys)[:, :n]
    n_holes = hole.sum(1)
    rank = mask.cumsum(1) - 1
    end = length + (mask.sum(1) - n_holes).clamp(min=0)
    overflow |= (end > width * bs).any().to(overflow.dtype)
    logical = ((length - n_holes)[:, None] + rank).clamp(min=0)
    block = logical // bs
    slot = table.gather(1, block.clamp(max=width - 1)) * bs + logical % bs
    if reserve is not None:
        slot = _take_from_reserve(table, length, end, block, logical % bs, slot, reserve, trash, overflow, bs)
    slot = torch.where(rank < n_holes[:, None], holes.gather(1, rank.clamp(min=0)), slot)
    length.copy_(end)
    num_blocks.copy_((end + bs - 1) // bs)
    return torch.where(mask, slot, trash).reshape(-1)


def _take_from_reserve(table, length, end, block, offset, slot, reserve, trash: int, overflow, bs: int):
    """:func:`claim_slots_torch`'s blocks past each row's last: taken off its stack into its table."""
    ids, count = reserve
    width = table.shape[1]
    owned = (length + bs - 1) // bs
    grow = (end + bs - 1) // bs - owned
    overflow |= (grow > count).any().to(overflow.dtype)
    cols = torch.arange(width, device=table.device)[None, :]
    fresh = cols - owned[:, None]  # the table column's place among the row's new blocks
    new = (fresh >= 0) & (fresh < grow[:, None]) & (fresh < count[:, None])
    stack = (count[:, None] - 1 - fresh).clamp(min=0, max=ids.shape[1] - 1)
    table.copy_(torch.where(new, ids.gather(1, stack), table))
    taken = block - owned[:, None]
    got = (taken < count[:, None]) & (block < width)
    fresh_id = ids.gather(1, (count[:, None] - 1 - taken).clamp(min=0, max=ids.shape[1] - 1))
    count.sub_(torch.minimum(torch.minimum(grow.clamp(min=0), count), width - owned))  # the blocks put in the table
    return torch.where(taken >= 0, torch.where(got, fresh_id * bs + offset, trash), slot)


def holes_in_rows(table: torch.Tensor, length: torch.Tensor, valid: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pool slots in column order (:func:`slot_map`) and which of them are holes: empty
    slots (``valid`` false) before the row's written ``length``; both ``[B, W * block_size]``."""
    phys = slot_map(table, block_size)
    written = torch.arange(phys.shape[1], device=table.device)[None, :] < length[:, None]
    return phys, written & ~valid[phys]


def slot_map(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slot of every column of a block table ``[B, W]``: ``[B, W * block_size]``
    (empty entries read as block 0)."""
    B, W = table.shape
    offsets = torch.arange(block_size, device=table.device)
    return (table.clamp(min=0)[:, :, None] * block_size + offsets).reshape(B, W * block_size)
