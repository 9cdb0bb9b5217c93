"""A region: the blocks of one token class of one layer, for every sequence of a batch.

Each sequence owns a row of the region's block table (block ids, ``-1`` for none)
and writes its tokens contiguously into those blocks, oldest first. A store has one
region per token class (one for uniform policies; R, E and T under ThinKV), each
drawing blocks from the pool of its storage format.
"""

from __future__ import annotations

import torch

from ..ops.claim_slots import claim_slots, holes_in_rows, slot_map
from .pool import BlockPool, empty_value


class Region:
    """Block table and fill level of one class."""

    def __init__(self, name: str, pool: BlockPool, batch_size: int, device: torch.device):
        self.name = name
        self.pool = pool
        self.batch_size = batch_size
        self.device = device
        self.table = torch.full((batch_size, 0), -1, dtype=torch.long, device=device)
        self.num_blocks = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)  # slots written
        # Set by pagers that evict in place (``ct``): empty slots inside the written
        # range exist and are refilled before the row grows.
        self.has_holes = False
        # Static mode: whether later evictions may leave holes (:meth:`fix_width`'s ``holes``);
        # where none can, a flush does not look for them.
        self.static_holes = True
        # Static mode (:meth:`fix_width`): every table entry holds a block from the start,
        # state changes in place, and a row that outgrows its table sets ``overflow``.
        self.static = False
        self.overflow = torch.zeros((), dtype=torch.int32, device=device)
        # Static mode, regions that share a pool: the rows' free blocks they all draw from
        # (:mod:`~kvcompose.paging.row_reserve`); the table then holds a row's blocks so far, -1 after.
        self.reserve = None

    def place(self, mask: torch.Tensor, slots: dict, groups: dict, meta: dict) -> None:
        """Write tokens into each row's blocks, in order: first into holes left by in-place eviction, then appended.

        ``mask`` ``[B, N]`` says which tokens each row writes; ``slots`` and ``meta``
        hold those tokens' per-slot tensors flattened row-major (``[M, ...]``, ``M =
        mask.sum()``); ``groups`` holds per-group tensors (``[M / group_tokens, ...]``).
        Static mode writes a group of every row at once with :meth:`claim_aligned` instead.
        """
        count = mask.sum(1)
        pool = self.pool
        bs, g = pool.block_size, pool.codec.group_tokens
        if self.reserve is not None:
            raise ValueError(f"region {self.name!r} draws blocks from a shared reserve; static mode writes it with "
                             "claim_aligned")
        if not self.static:
            if not bool(count.any()):
                return
            if g > 1 and bool(((self.length % g) != 0).any() | ((count % g) != 0).any()):
                raise ValueError(f"format {pool.codec.name!r} can only append whole groups of {g} tokens")
        rank = (mask.cumsum(1) - 1)[mask]
        rows = torch.arange(self.batch_size, device=self.device)[:, None].expand_as(mask)[mask]
        holes, n_holes = self._holes() if self._may_have_holes() else (None, torch.zeros_like(count))
        if holes is not None and holes.shape[1] == 0:
            holes = None
        appended = (count - n_holes).clamp(min=0)
        if self.static:
            self.overflow |= ((self.length + appended) > self.table.shape[1] * bs).any().to(torch.int32)
        else:
            self._ensure_blocks((self.length + appended + bs - 1) // bs)
        logical = (self.length[rows] + rank - n_holes[rows]).clamp(min=0)
        column = (logical // bs).clamp(max=self.table.shape[1] - 1)
        slot = self.table[rows, column] * bs + logical % bs
        if holes is not None:
            into_hole = rank < n_holes[rows]
            slot = torch.where(into_hole, holes[rows, rank.clamp(min=0, max=holes.shape[1] - 1)], slot)
        pool.write(slot, slots, groups, meta)
        self.length += appended
        if self.static:
            self.num_blocks.copy_((self.length + bs - 1) // bs)

    def claim_aligned(self, mask: torch.Tensor) -> torch.Tensor:
        """Static mode: the pool slots ``[B * N]`` where the ``mask``-selected tokens of ``[B, N]``
        go (row-major; :meth:`place`'s order: holes first, then appended), the pool's trash slot
        for the others, with this region's fill level advanced past them
        (:func:`~kvcompose.ops.claim_slots.claim_slots`, one launch on CUDA). Shapes do not
        depend on the mask and nothing reads the device, so a captured graph can replay it; the
        caller writes the tokens (:meth:`BlockPool.write`), together with other regions of the pool."""
        valid = self.pool.flat_slots(self.pool.meta)["valid"]
        reserve = None if self.reserve is None else (self.reserve.ids, self.reserve.count)
        return claim_slots(self.table, self.length, self.num_blocks, valid, mask, self.pool.trash_slot,
                           self.overflow, self.pool.block_size, reserve, holes=self._may_have_holes())

    def _may_have_holes(self) -> bool:
        """Whether a row's written slots may include empty ones that a write refills first."""
        return self.has_holes or (self.static and self.static_holes)

    def _holes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty slots inside each row's written range: pool slots ``[B, n]`` (in block order) and counts ``[B]``."""
        phys, hole = holes_in_rows(self.table if self.static else self.used_table(), self.length,
                                   self.pool.flat_slots(self.pool.meta)["valid"], self.pool.block_size)
        order = torch.argsort((~hole).to(torch.int8), dim=1, stable=True)
        return phys.gather(1, order), hole.sum(1)

    def _ensure_blocks(self, need: torch.Tensor) -> None:
        """Give each row at least ``need[b]`` blocks, taking ids from the pool."""
        missing = (need - self.num_blocks).clamp(min=0)
        n = int(missing.sum())
        if n == 0:
            return
        width = int(need.max())
        if width > self.table.shape[1]:
            pad = torch.full((self.batch_size, width - self.table.shape[1]), -1, dtype=torch.long, device=self.device)
            self.table = torch.cat([self.table, pad], dim=1)
        cols = torch.arange(self.table.shape[1], device=self.device)[None, :]
        fresh = (cols >= self.num_blocks[:, None]) & (cols < need[:, None])
        self.table[fresh] = self.pool.allocate(n)
        torch.maximum(self.num_blocks, need, out=self.num_blocks)

    def release_rows(self, rows: torch.Tensor) -> None:
        """Free every block of the selected rows (``[B]`` bool) and empty their tables.

        In static mode a row keeps its blocks (their slots are emptied) and writes again
        from its first block."""
        ids = self.table[rows]
        if self.static:
            ids = torch.where(ids >= 0, ids, self.pool.trash_slot // self.pool.block_size).reshape(-1)
            self.pool.meta["valid"][ids] = False
            self.pool.meta["pos"][ids] = -1
            if self.reserve is not None:  # the blocks go back to the rows' reserve
                self.reserve.push(self.table, rows[:, None] & (self.table >= 0), self.overflow)
                self.table.masked_fill_(rows[:, None], -1)
        else:
            self.pool.release(ids[ids >= 0])
            self.table[rows] = -1
        self.num_blocks.masked_fill_(rows, 0)
        self.length.masked_fill_(rows, 0)

    def release_empty_blocks(self) -> None:
        """Eager mode: give every block whose written slots were all evicted back to the pool;
        the row's later blocks move up a column. What the ``ct`` pager leaves behind when a
        whole block of a class is evicted, so that another class can take it."""
        if self.static or self.table.shape[1] == 0:
            return
        bs = self.pool.block_size
        cols = torch.arange(self.table.shape[1], device=self.device)[None, :]
        owned = cols < self.num_blocks[:, None]
        live = self.pool.meta["valid"][self.table.clamp(min=0)].any(-1)
        empty = owned & ~live
        if not bool(empty.any()):
            return
        written = (self.length[:, None] - cols * bs).clamp(min=0, max=bs)
        self.pool.release(self.table[empty])
        order = torch.argsort(empty.to(torch.int8), dim=1, stable=True)  # kept columns first, in order
        self.num_blocks -= empty.sum(1)
        self.length -= (written * empty).sum(1)
        self.table = torch.where(cols < self.num_blocks[:, None], self.table.gather(1, order), -1)

    def pack_holes(self, max_holes: int) -> None:
        """Eager mode: in every row with at least ``max_holes`` empty slots, move the tokens
        written last into the earliest holes, so the row's live tokens fill its first
        ``live`` slots, and give the blocks left empty back to the pool. The ``ct`` pager's
        bound on fragmentation: without it a class keeps every block it ever needed."""
        if self.static or self.table.shape[1] == 0:
            return
        pool = self.pool
        if pool.codec.group_tokens > 1:
            raise ValueError(f"format {pool.codec.name!r} encodes {pool.codec.group_tokens} tokens together; "
                             "its tokens cannot move one at a time")
        phys = slot_map(self.used_table(), pool.block_size)
        col = torch.arange(phys.shape[1], device=self.device)[None, :]
        written = col < self.length[:, None]
        valid = pool.flat_slots(pool.meta)["valid"][phys] & written
        live = valid.sum(1)
        rows = (self.length - live) >= max_holes
        if not bool(rows.any()):
            return
        front = rows[:, None] & (col < live[:, None])
        # Per row, the holes among the first `live` columns and the live tokens after them are
        # equally many; boolean indexing lists both row by row in column order, so a row's k-th
        # token beyond its first `live` columns goes to its k-th earliest hole.
        dst = phys[front & written & ~valid]
        src = phys[rows[:, None] & valid & (col >= live[:, None])]
        for tensors in (pool.slots, pool.meta):
            for name, flat in pool.flat_slots(tensors).items():
                flat[dst] = flat[src]
        for name, flat in pool.flat_slots(pool.meta).items():
            flat[src] = empty_value(name)
        self.release_empty_blocks()

    def fix_width(self, width: int, reserve=None, holes: bool = True) -> None:
        """Static mode: give every row ``width`` blocks now (keeping the ones it has; table
        columns beyond ``width`` that no row uses go), so that appends never allocate, and keep
        all state in these tensors from now on. With a ``reserve`` (a
        :class:`~kvcompose.paging.row_reserve.RowReserve` the pool's regions share), the table
        is only ``width`` wide: rows take blocks from the reserve as they need them. ``holes``:
        whether evictions may leave empty slots among a row's written ones (False: nothing
        evicts, or evictions compact), which flushes then refill first."""
        width = self.fixed_width(width)
        if width < self.table.shape[1]:
            self.table = self.table[:, :width].contiguous()  # columns the prefill emptied (eviction)
        if width > self.table.shape[1]:
            pad = torch.full((self.batch_size, width - self.table.shape[1]), -1, dtype=torch.long, device=self.device)
            self.table = torch.cat([self.table, pad], dim=1)
        self.reserve = reserve
        self.static_holes = holes
        if reserve is None:
            missing = self.table < 0
            self.table[missing] = self.pool.allocate(int(missing.sum()))
        self.static = True

    def width_to_come(self, width: int, incoming: int | None) -> int:
        """``width`` blocks per row, or fewer where the row that has written the most slots
        plus ``incoming`` more tokens (None: no bound) fits in fewer: a row writes its tokens
        contiguously, refilling holes first, so it never needs a block past that (one host read)."""
        if incoming is None or self.batch_size == 0:
            return width
        most = int(self.length.max()) + incoming
        return min(width, -(-most // self.pool.block_size))

    def fixed_width(self, width: int) -> int:
        """The table width :meth:`fix_width` gives for ``width``: that many columns, or the
        current ones where a row still has a block beyond it (one host read)."""
        beyond = self.table[:, width:]
        return self.table.shape[1] if beyond.numel() and bool((beyond >= 0).any()) else width

    def used_table(self) -> torch.Tensor:
        """The block-table columns in use by at least one row (``[B, W]``)."""
        width = int(self.num_blocks.max()) if self.batch_size else 0
        return self.table[:, :width]

    def live_tokens(self) -> torch.Tensor:
        """Live tokens per row (``[B]``)."""
        table = self.used_table()
        if table.shape[1] == 0:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        per_block = self.pool.meta["valid"][table.clamp(min=0)].sum(-1) * (table >= 0)
        return per_block.sum(1)

    def blocks_written(self) -> torch.Tensor:
        """Blocks holding at least one written slot, summed over rows (a 0-d tensor; what
        the eager path allocates, so memory accounting is the same in static mode). A block
        that several entries of a row share (share pager) counts once."""
        written = ((self.length + self.pool.block_size - 1) // self.pool.block_size).sum()
        return written if self.pool.refs is None else written - self.shared_entries().sum()

    def shared_entries(self) -> torch.Tensor:
        """Per row, the table entries that reference a block an other entry of the row also
        references, beyond the first (``[B]``; 0 without the share pager)."""
        if self.pool.refs is None or self.table.shape[1] < 2:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        ids = torch.sort(self.table, dim=1).values
        return ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).sum(1)

    @property
    def table_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()
