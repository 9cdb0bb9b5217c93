"""Static mode of :class:`~kvcompose.paging.store.LayerStore`: what CUDA-graph decode replays.

Once :meth:`StoreStatic.fix_capacity` reserves every row's blocks, a decode step appends,
flushes and evicts with fixed shapes, in place, and never reads the device from the
host, so one captured graph can replay every step. Overflow is flagged on the device and
raised later by ``check_errors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..ops.append_token import append_token
from ..ops.compact_rows import compact_rows_
from ..ops.evict_one import evict_one_in_place
from ..ops.scatter_slots import move_slots_many
from .pool import decoded_slots, empty_value
from .row_reserve import RowReserve, pack_holes, release_empty_blocks

if TYPE_CHECKING:
    from .store import StoreView


class StoreStatic:
    """Fixed-capacity append, flush and eviction of a :class:`~kvcompose.paging.store.LayerStore`."""

    def fix_capacity(self, tokens: int, columns_limit: int | None = None, hole_blocks: int | None = None) -> None:
        """Enter static mode: every region of every row gets blocks for ``tokens`` tokens now,
        and from then on :meth:`append_step` appends one token per row with fixed shapes, in place,
        without host synchronization: what a captured CUDA graph replays. ``columns_limit``: the
        most columns the run will have appended (evictors that keep per-segment state size it
        from this instead of reading the device); it also bounds what each region can still
        receive, so a region that holds little of a long prompt (ThinKV's classes) reserves
        what it holds plus the tokens still to come, not ``tokens``.

        ``hole_blocks``: the most blocks beyond its live tokens that a class of a row keeps after
        an eviction (the pager's bound: 0 when nothing is evicted or evictions compact, None when
        holes are not bounded). Given, regions that share a pool draw from one reserve per row
        (:mod:`~kvcompose.paging.row_reserve`) of ``tokens`` plus ``hole_blocks + 1`` blocks per
        region, instead of ``tokens`` each."""
        if self.static:
            raise ValueError("this store is already in static mode")
        incoming = None if columns_limit is None else columns_limit - self.columns_seen + self.buffer_capacity
        for pool in self.pools.values():
            pool.codec.prepare(self.device)
            regions = [r for r in self.regions if r.pool is pool]
            width = -(-tokens // pool.block_size)
            widths = [r.fixed_width(r.width_to_come(width, incoming)) for r in regions]
            if len(regions) > 1 and hole_blocks is not None and pool.refs is None:
                reserve = self._row_reserve(pool, regions, min(sum(widths), width + len(regions) * (hole_blocks + 1)))
            else:
                reserve = None
                pool.fix_capacity(sum(w * self.batch_size - int((r.table[:, :w] >= 0).sum())
                                      for w, r in zip(widths, regions)))
            for region, w in zip(regions, widths):
                region.fix_width(w, reserve, holes=hole_blocks != 0)
        self._grow_buffer(self.buffer_capacity)
        # each row's next column (equal across rows): the append kernel advances them itself
        self.column = torch.full((self.batch_size,), self.columns_seen, dtype=torch.long, device=self.device)
        self.overflow = torch.zeros((), dtype=torch.int32, device=self.device)
        # the buffer columns a flush moves out: its oldest group (made here, never inside a captured step)
        self.oldest_group = torch.arange(self.buffer_capacity, device=self.device) < self.group_size
        self.static = True
        self.columns_limit = columns_limit
        # pools in which some row has not fixed its scales yet (one host read): only their
        # flushes look for a row's first encode
        self.scales_pending = {name: bool(scales) and not bool(self.row_scales_set[name].all())
                               for name, scales in self.row_scales.items()}

    def _row_reserve(self, pool, regions: list, blocks: int) -> RowReserve:
        """The reserve of ``blocks`` blocks per row (or what a row already holds, if more) that
        the ``regions`` of ``pool`` share: each row's free ones, taken from the pool now."""
        held = sum((r.table >= 0).sum(1) for r in regions)
        blocks = max(blocks, int(held.max()))
        free = blocks - held
        pool.fix_capacity(int(free.sum()))
        return RowReserve.fill(pool.allocate(int(free.sum())), free, blocks)

    def append_step(self, keys: torch.Tensor, values: torch.Tensor, cls: torch.Tensor, flush: bool,
                    query_ring: tuple | None = None) -> torch.Tensor:
        """Static mode: append one real token per row (``[B, Hkv, 1, D]``, classes ``[B]``) and
        return its positions ``[B, 1]``. ``flush``: the caller knows that some row's buffer
        fills this step, so its oldest group is encoded into blocks (rows whose buffer is not
        full write nothing). ``query_ring``: the caller's ring of recent queries, written in
        the same launch (see :func:`~kvcompose.ops.append_token.append_token`). Host counters
        (``columns_seen``) are the caller's to advance."""
        positions = append_token(keys, values, self.buf_k, self.buf_v, self.buf_meta, self.buf_len, self.tokens_seen,
                                 self.column, cls, self.overflow, self.nonfinite, ring=query_ring)
        if flush:
            self._flush_full_rows()
        return positions

    def _flush_full_rows(self) -> None:
        """Rows whose buffer holds ``residual + group_size`` tokens move their oldest group to
        blocks and shift the rest to the front (what :meth:`append` does, with fixed shapes)."""
        full = self.buf_len == self.buf_k.shape[1]
        self._encode_oldest_group(full)
        leaving = full[:, None] & self.oldest_group[None, :]
        for t, fill in self._buffer_tensors():  # one launch per tensor: the full rows shift left by G
            compact_rows_(t, ~leaving, fill)
        self.buf_len -= full * self.group_size

    def _encode_oldest_group(self, full: torch.Tensor) -> None:
        """Encode the buffer's oldest group in every row, once per pool for all rows and
        classes, and write the tokens of the ``full`` rows (``[B]``) to their class's region;
        the rest go to the pool's trash slot, so shapes do not depend on which rows flush.

        Only the first G columns are encoded: formats whose scales span several tokens (KIVI's
        keys) group them from row starts G apart, a multiple of their token group, so no group
        ever mixes two rows."""
        G = self.group_size
        k, v = self.buf_k[:, :G], self.buf_v[:, :G]
        classes = self.buf_meta["cls"][:, :G]
        meta = {name: t[:, :G].reshape(-1) for name, t in self.buf_meta.items()}
        for pool in self.pools.values():
            members = [(r, full[:, None] & (classes == i)) for i, r in enumerate(self.regions) if r.pool is pool]
            name = pool.codec.name
            if self.scales_pending[name]:  # a row's first encode in this format fixes its scales
                for _, sel in members:
                    self._fix_row_scales(name, pool.codec, k, v, sel, sel.any(1) & ~self.row_scales_set[name])
            scales = self._group_row_scales(name, G)
            slots, groups = pool.codec.encode(k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), scales)
            if pool.decoded:
                slots.update(decoded_slots(pool.codec, slots, groups, scales, self.dtype))
            slot = None
            for region, sel in members:
                claimed = region.claim_aligned(sel)
                slot = claimed if slot is None else torch.where(sel.reshape(-1), claimed, slot)
            pool.write(slot, slots, groups, {n: meta[n] for n in pool.meta})

    def _group_row_scales(self, pool_name: str, group: int) -> dict:
        """The per-sequence scales of a pool for each of ``group`` tokens of every row,
        row-major (``[B * group, H]``). A row without scales yet writes nothing; any valid
        scale keeps the encoder quiet."""
        store = self.row_scales[pool_name]
        if self.scales_pending[pool_name]:
            ready = self.row_scales_set[pool_name][:, None]
            store = {name: torch.where(ready, t, 1.0) for name, t in store.items()}
        return {name: t.repeat_interleave(group, 0) for name, t in store.items()}

    def evict_in_place(self, evicted: torch.Tensor) -> None:
        """Static mode: drop the ``evicted`` columns of :meth:`slot_state` with fixed shapes.
        Block slots become holes that later groups of the same region refill first (so a
        sliding window turns into a ring); the buffer's survivors move to its front."""
        col = 0
        for source, meta, pool in self._sources():
            slots = source.slots()
            ev = evicted[:, col:col + slots.shape[1]]
            col += slots.shape[1]
            if pool is None:
                self._repack_buffer(self.buf_meta["valid"] & ~ev)
                continue
            target = torch.where(ev & (slots >= 0), slots, pool.trash_slot).reshape(-1)  # the rest hit the trash
            meta["valid"].index_fill_(0, target, False)
            meta["pos"].index_fill_(0, target, -1)

    def compact_static(self, view: StoreView, keep: torch.Tensor, in_place: bool,
                       max_hole_blocks: int | None = None) -> None:
        """Static mode: what a pager does after an eviction, with fixed shapes and no host read.

        ``in_place`` (the ``ct`` pager): evicted slots become holes that later tokens of their
        region refill. Otherwise (``gather``): each row's kept tokens of each region move, in
        column order, to the row's first slots, as the eager pager's compaction leaves them.
        Regions that share a row reserve then give their emptied blocks back, after packing the
        rows whose holes reach ``max_hole_blocks`` blocks (in place; None: never), as the eager
        ``ct`` pager does. ``view`` must come from :meth:`view` in static mode (the parts of
        :meth:`view_parts`). An eviction that removed anything counts in ``evictions_on_device``."""
        evicted = view.valid & ~keep  # once for every part (each operator is a launch of a captured step)
        self.evictions_on_device += evicted.any()
        col = 0
        for blocks, members in self.view_parts():
            pool = members[0].pool
            if not pool.codec.slot_local:
                raise ValueError(f"format {pool.codec.name!r} shares scales across tokens; it cannot be evicted from")
            bs = pool.block_size
            width = blocks * bs
            phys, kept = view.phys[:, col:col + width], keep[:, col:col + width]
            gone = evicted[:, col:col + width]
            col += width
            if in_place:  # one value per slot: through the trash slot is faster than fill_slots (compaction_gpu.json)
                target = torch.where(gone, phys, pool.trash_slot).reshape(-1)
                for name, flat in pool.flat_slots(pool.meta).items():
                    flat.index_fill_(0, target, empty_value(name))
            else:
                for region, (own_phys, own_kept) in zip(members, self._own_columns(members, phys, kept)):
                    self._compact_region(region, own_phys, own_kept)
            for region in members:
                if region.reserve is None:
                    continue
                if in_place and max_hole_blocks is not None:
                    pack_holes(region, max_hole_blocks * bs)  # gives every empty block back too
                else:
                    release_empty_blocks(region)
        self._repack_buffer(keep[:, col:])

    def view_parts(self) -> list[tuple[int, list]]:
        """How :meth:`view` lays out its block columns, part by part: ``(blocks per row, regions)``.
        Each region is a part of its table's width, but in static mode the regions that share a
        row reserve make one part of the reserve's width, which bounds what a row holds of them
        (one table each would span that width once per region: ThinKV's R and E, twice the keys
        an eviction decodes and copies). Known on the host: no tensor is read."""
        if not self.static:
            return [(r.used_table().shape[1], [r]) for r in self.regions]
        parts, shared = [], {}
        for region in self.regions:
            if region.reserve is None:
                parts.append((region.table.shape[1], [region]))
            elif id(region.reserve) in shared:
                shared[id(region.reserve)][1].append(region)
            else:
                shared[id(region.reserve)] = (region.reserve.width, [region])
                parts.append(shared[id(region.reserve)])
        return parts

    def view_tables(self) -> list[tuple]:
        """The block tables of :meth:`view_parts`: ``(pool, table [B, W], region index of each
        block: an int for a region's own table, ``[B, W]`` for a shared part)``. A shared part
        holds each row's blocks of its regions in region order."""
        if not self.static:  # eager: each region's used columns (one host read each)
            return [(r.pool, r.used_table(), i) for i, r in enumerate(self.regions)]
        index = {id(r): i for i, r in enumerate(self.regions)}
        out = []
        for width, members in self.view_parts():
            first = members[0]
            if len(members) == 1:
                out.append((first.pool, first.table, index[id(first)]))
                continue
            tables = torch.cat([r.table for r in members], 1)
            owners = torch.cat([torch.full_like(r.table, index[id(r)]) for r in members], 1)
            owned = tables >= 0  # a row's first blocks of each region (the static table's invariant)
            # a row's blocks come from its reserve of `width` ids, so they fit; the rest go to a sink column
            column = torch.where(owned, owned.cumsum(1) - 1, width)
            table = torch.full((self.batch_size, width + 1), -1, dtype=tables.dtype, device=self.device)
            owner = torch.full_like(table, index[id(first)])
            table.scatter_(1, column, torch.where(owned, tables, -1))
            owner.scatter_(1, column, torch.where(owned, owners, index[id(first)]))
            out.append((first.pool, table[:, :width], owner[:, :width]))
        return out

    def _own_columns(self, regions: list, phys: torch.Tensor, kept: torch.Tensor) -> list[tuple]:
        """``(phys, kept)`` of each of ``regions`` in its own table's columns, from those of their
        :meth:`view_parts` part (the same tensors for a region alone): the blocks of a shared
        part are the regions' blocks in region order. Computed before any region changes."""
        if len(regions) == 1:
            return [(phys, kept)]
        bs = regions[0].pool.block_size
        out, start = [], torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        for region in regions:
            held = (region.table >= 0).sum(1)
            col = torch.arange(region.table.shape[1] * bs, device=self.device)
            inside = (col // bs)[None, :] < held[:, None]
            source = (start[:, None] * bs + col[None, :]).clamp(max=phys.shape[1] - 1)
            out.append((torch.where(inside, phys.gather(1, source), -1), kept.gather(1, source) & inside))
            start = start + held
        return out

    def _compact_region(self, region, phys: torch.Tensor, kept: torch.Tensor) -> None:
        """:meth:`compact_static` without ``in_place``: the region's kept tokens of each row move,
        in column order, to the row's first slots (``phys``: the view's pool slots, -1 for none)."""
        pool, bs, width = region.pool, region.pool.block_size, phys.shape[1]
        if pool.codec.group_tokens > 1:
            raise ValueError(f"format {pool.codec.name!r} encodes {pool.codec.group_tokens} tokens together; "
                             "its tokens cannot be compacted one at a time")
        phys = torch.where(phys >= 0, phys, pool.trash_slot)  # a reserve's rows hold no block past their last
        order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)
        source = phys.gather(1, order)
        count = kept.sum(1)
        live = torch.arange(width, device=self.device)[None, :] < count[:, None]
        # the payload of the kept tokens that change slots (a row's tokens before its first eviction
        # stay); the slots past a row's kept tokens are empty now, whatever their payload
        move_slots_many(list(pool.flat_slots(pool.slots).values()), source, phys, live & (source != phys),
                        pool.trash_slot)
        # every slot of the row's columns is written: its kept token's metadata, or empty past them
        meta = pool.flat_slots(pool.meta)
        move_slots_many(list(meta.values()), source, phys, live, pool.trash_slot, fill=[empty_value(n) for n in meta])
        region.length.copy_(count)
        region.num_blocks.copy_((count + bs - 1) // bs)

    def evict_one(self, **choice) -> torch.Tensor:
        """Static mode, one region: each row over ``choice["budget"]`` drops one token where it
        lies (see :func:`~kvcompose.ops.evict_one.evict_one_in_place` for ``choice``); returns
        ``[B]`` bool. A row that would need to drop more sets the overflow flag."""
        source, meta, _ = self._sources()[0]
        buffer = {"k": self.buf_k, "v": self.buf_v, **self.buf_meta}
        return evict_one_in_place(source.table, source.block_size, meta, buffer, self.buf_len,
                                  prompt_columns=self.prompt_columns or 0, bad=self.overflow, **choice)

    def static_layout(self) -> tuple:
        """Static mode: what the kernels of a decode step are specialized on (every fixed
        shape and dtype, the trash slots, the pools whose flushes still fix scales, the column counts): two stores with equal layouts
        run the same compiled kernels."""
        tensors = [self.buf_k, *self.buf_meta.values()] + [r.table for r in self.regions]
        tensors += [r.reserve.ids for r in self.regions if r.reserve is not None]
        for pool in self.pools.values():
            tensors += [*pool.slots.values(), *pool.blocks.values(), *pool.meta.values()]
        shapes = tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)  # strides: the pools' row layout
        trash = tuple(pool.trash_slot for pool in self.pools.values())
        pending = tuple(sorted(self.scales_pending.items()))
        return shapes, trash, pending, self.columns_seen, self.columns_limit, self.prompt_columns

    def _buffer_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-slot tensor of the buffer with the value of an empty slot."""
        return [(self.buf_k, 0), (self.buf_v, 0)] + [(t, empty_value(n)) for n, t in self.buf_meta.items()]

    def _repack_buffer(self, keep: torch.Tensor) -> None:
        """Move the buffer's ``keep`` tokens, in order, to its front (fixed shapes): one launch per tensor."""
        for t, fill in self._buffer_tensors():
            compact_rows_(t, keep, fill)
        self.buf_len.copy_(keep.sum(1))
