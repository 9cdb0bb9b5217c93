"""The paged KV store of one layer for a batch of sequences.

New tokens first land in a full-precision recent buffer. Once a row's buffer holds
more than ``residual`` tokens plus a whole group of ``group_size``, the oldest full
groups are encoded once by their class's storage format and appended to that
class's blocks (a :class:`Region`); they are never re-encoded. Everything is
vectorized over the batch: rows of different lengths are handled with masks and
cumulative sums, never with a Python loop over sequences or tokens.

The store does not decide what to evict; pagers (``kvcompose.paging.gather``) use
:meth:`Region.place`, :meth:`Region.release_rows` and
:meth:`LayerStore.refill_buffer` to rewrite rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.append_token import append_token
from ..ops.evict_one import evict_one_in_place
from ..ops.paged_attention import KVOperand, PagedSource
from .codec import DenseCodec, SlotCodec
from .pool import BlockPool, empty_value
from .region import Region


@dataclass
class StoreView:
    """Dense snapshot of one layer: what attention and evictors read.

    Columns are each region's block slots, in region order, followed by the buffer
    slots. Live tokens of the buffer, and of a region under the ``gather`` pager, are
    in position order; under ``ct`` a region's refilled holes break that order.
    ``source[b, j]`` locates column ``j``: ``(region index, pool slot)``, with region
    index ``-1`` for buffer columns.
    """

    keys: torch.Tensor  # [B, Hkv, L, D]
    values: torch.Tensor  # [B, Hkv, L, D]
    positions: torch.Tensor  # [B, L] int64, -1 where empty
    valid: torch.Tensor  # [B, L] bool
    region: torch.Tensor  # [B, L] int64 region index of the column, -1 for the buffer
    phys: torch.Tensor  # [B, L] int64 pool slot of the column, -1 for buffer or empty
    block_columns: int  # number of leading columns that map to blocks
    classes: torch.Tensor | None = None  # [B, L] int64 token class (region index; buffer tokens' own class)


class LayerStore:
    """Regions (one per token class), their pools, and the recent buffer of one layer."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = 16,
        group_size: int = 16,
        residual: int = 0,
        float_channels: tuple[str, ...] = (),
        codecs: dict[str, SlotCodec] | None = None,
        refcounted: bool = False,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if residual < 0:
            raise ValueError(f"residual must be >= 0, got {residual}")
        codecs = codecs or {"all": DenseCodec(dtype)}
        for cls_name, codec in codecs.items():
            if codec.group_tokens > 1 and group_size % codec.group_tokens:
                raise ValueError(
                    f"class {cls_name!r}: format {codec.name!r} encodes {codec.group_tokens} tokens at once; "
                    f"group_size={group_size} must be a multiple of it"
                )
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.group_size = group_size
        self.residual = residual
        pools: dict[str, BlockPool] = {}
        for codec in codecs.values():
            if codec.name not in pools:
                pools[codec.name] = BlockPool(codec, block_size, num_kv_heads, head_dim, device, float_channels,
                                              refcounted)
        self.pools = pools
        self.regions = [Region(name, pools[c.name], batch_size, device) for name, c in codecs.items()]
        self.class_names = list(codecs)
        # Per-sequence scales of formats that fix them at a sequence's first encode.
        self.row_scales = {
            name: {k: torch.zeros(batch_size, h, device=device) for k, h in p.codec.row_scale_layout(num_kv_heads).items()}
            for name, p in pools.items()
        }
        self.row_scales_set = {name: torch.zeros(batch_size, dtype=torch.bool, device=device) for name in pools}
        # The buffer's most: one slot more than it ever keeps between appends, since a
        # static-shape decode step writes its token before the oldest group leaves (see
        # append_step). The eager path grows it a block at a time as tokens arrive.
        self.buffer_capacity = residual + group_size
        self.buf_k = torch.zeros(batch_size, 0, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.buf_v = torch.zeros_like(self.buf_k)
        meta_dtypes = {"pos": torch.long, "valid": torch.bool, "cls": torch.long}
        meta_dtypes.update({name: torch.float32 for name in float_channels})
        self.buf_meta = {name: torch.zeros(batch_size, 0, dtype=d, device=device) for name, d in meta_dtypes.items()}
        self.buf_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Counters: columns seen (padding included, as transformers counts them), real tokens.
        self.columns_seen = 0
        self.prompt_columns: int | None = None
        self.tokens_seen = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.prompt_tokens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.evictions = 0
        self.evictions_on_device = torch.zeros((), dtype=torch.long, device=device)  # static decode's in-place ones
        # Non-zero once a real token's key or value was NaN/inf; read by check_errors (no sync here).
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=device)
        self.static = False  # see fix_capacity
        self.columns_limit: int | None = None  # static mode: the most columns the run appends, if known

    # ----------------------------------------------------------------- append
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        real: torch.Tensor | None = None,
        cls: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store new tokens (``[B, Hkv, T, D]``) and return their absolute positions ``[B, T]``.

        ``real[b, t]`` False marks padding, which is not stored. ``cls[b, t]`` is the
        index (into :attr:`class_names`) of each token's class (default: class 0).
        """
        B, H, T, D = keys.shape
        if self.static:
            raise ValueError("this store is in static mode (fixed capacity): append one token per row with append_step")
        self.check_input(keys, values)
        if real is None:
            real = torch.ones(B, T, dtype=torch.bool, device=self.device)
        if cls is None:
            cls = torch.zeros(B, T, dtype=torch.long, device=self.device)
        elif bool(((cls < 0) | (cls >= len(self.regions))).any()):
            raise ValueError(f"token classes must lie in [0, {len(self.regions)}) for classes {self.class_names}")
        finite = torch.isfinite(keys).all(-1).all(1) & torch.isfinite(values).all(-1).all(1)  # [B, T]
        self.nonfinite |= (real & ~finite).any().to(torch.int32)
        positions = self.columns_seen + torch.arange(T, device=self.device).expand(B, T)
        if self.prompt_columns is None:
            self.prompt_columns = T
            self.prompt_tokens = real.sum(1)
        self.columns_seen += T
        self.tokens_seen += real.sum(1)

        new_meta = {"pos": torch.where(real, positions, -1), "valid": real, "cls": cls}
        k = torch.cat([self.buf_k, keys.transpose(1, 2)], dim=1)
        v = torch.cat([self.buf_v, values.transpose(1, 2)], dim=1)
        meta = {
            name: torch.cat([t, new_meta.get(name, torch.zeros(B, T, dtype=t.dtype, device=self.device))], dim=1)
            for name, t in self.buf_meta.items()
        }
        live = meta["valid"]
        # The oldest whole groups beyond the residual window leave the buffer.
        rank = live.cumsum(1) - 1
        flushed = ((live.sum(1) - self.residual).clamp(min=0) // self.group_size) * self.group_size
        to_blocks = live & (rank < flushed[:, None])
        self.encode_and_place(k, v, meta, to_blocks)
        self.refill_buffer(k, v, meta, live & ~to_blocks)
        return positions

    def check_input(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Refuse new keys/values (``[B, Hkv, T, D]``) whose batch, heads, head dim or dtype
        differ from this store's, naming both."""
        B, H, _, D = keys.shape
        if (B, H, D) != (self.batch_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not match the cache (batch {self.batch_size}, "
                f"{self.num_kv_heads} KV heads, head dim {self.head_dim})"
            )
        if values.shape != keys.shape:
            raise ValueError(f"values shape {tuple(values.shape)} differs from keys shape {tuple(keys.shape)}")
        if keys.dtype != self.dtype or values.dtype != self.dtype:
            raise ValueError(f"keys/values dtype {keys.dtype}/{values.dtype} differ from the cache dtype {self.dtype}")

    def encode_and_place(self, k: torch.Tensor, v: torch.Tensor, meta: dict, mask: torch.Tensor,
                         aligned: bool = False) -> None:
        """Encode the ``mask``-selected buffer tokens (``[B, N, H, D]``) by class and append them to blocks.

        ``aligned=True`` (static mode) encodes all ``B * N`` tokens and lets each region
        write only its selected ones: shapes do not depend on the mask, no host sync."""
        for index, region in enumerate(self.regions):
            sel = mask & (meta["cls"] == index)
            if not aligned and not bool(sel.any()):
                continue
            codec, pool_name = region.pool.codec, region.pool.codec.name
            scales = self._row_scales_for(pool_name, codec, k, v, sel, aligned)
            pick = (lambda t: t.reshape(-1, *t.shape[2:])) if aligned else (lambda t: t[sel])
            slots, groups = codec.encode(pick(k), pick(v), scales)
            region.place(sel, slots, groups, {name: pick(meta[name]) for name in region.pool.meta}, aligned)

    def _row_scales_for(self, pool_name: str, codec: SlotCodec, k, v, sel, aligned: bool = False) -> dict:
        """Per-token view of a format's per-sequence scales, fixing them at a row's first encode."""
        store = self.row_scales[pool_name]
        if not store:
            return {}
        first = sel.any(1) & ~self.row_scales_set[pool_name]
        if aligned or bool(first.any()):
            fresh = codec.init_row_scales(k, v, sel & first[:, None])
            for name, t in fresh.items():
                store[name].copy_(torch.where(first[:, None], t, store[name]))
            self.row_scales_set[pool_name] |= first
        rows = torch.arange(self.batch_size, device=self.device)[:, None].expand_as(sel)
        if not aligned:
            return {name: t[rows[sel]] for name, t in store.items()}
        # Rows that write nothing may have no scale yet; any valid one keeps the encoder quiet.
        ready = self.row_scales_set[pool_name][:, None]
        return {name: torch.where(ready, t, 1.0)[rows.reshape(-1)] for name, t in store.items()}

    def refill_buffer(self, k, v, meta, keep: torch.Tensor) -> None:
        """Write the ``keep`` tokens of each row, in order, to the front of the buffer."""
        dest = keep.cumsum(1) - 1
        rows = torch.arange(self.batch_size, device=self.device)[:, None].expand_as(keep)
        r, d = rows[keep], dest[keep]
        # Read before clearing: ``k``/``v``/``meta`` may be the buffer itself.
        picked = [k[keep], v[keep]] + [meta[name][keep] for name in self.buf_meta]
        if not self.static:
            self._grow_buffer(int(keep.sum(1).max()) if self.batch_size else 0)
        self.buf_k.zero_()
        self.buf_v.zero_()
        self.buf_k[r, d] = picked[0]
        self.buf_v[r, d] = picked[1]
        for (name, t), vals in zip(self.buf_meta.items(), picked[2:]):
            t.fill_(empty_value(name))
            t[r, d] = vals
        self.buf_len.copy_(keep.sum(1))

    def _grow_buffer(self, tokens: int) -> None:
        """Widen the buffer, a block at a time, until every row has room for ``tokens`` (eager mode)."""
        bs = min(p.block_size for p in self.pools.values())
        width = min(-(-tokens // bs) * bs, self.buffer_capacity)
        if width < tokens:
            raise ValueError(f"the recent buffer holds at most {self.buffer_capacity} tokens per row; {tokens} were "
                             "written to it (a kvcompose bug: please report it)")
        old = self.buf_k.shape[1]
        if width <= old:
            return

        def wider(t: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((t.shape[0], width, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
            out[:, :old] = t
            return out

        self.buf_k, self.buf_v = wider(self.buf_k, 0), wider(self.buf_v, 0)
        self.buf_meta = {n: wider(t, empty_value(n)) for n, t in self.buf_meta.items()}

    # ----------------------------------------------------------- static mode
    def fix_capacity(self, tokens: int, columns_limit: int | None = None) -> None:
        """Enter static mode: every region of every row gets blocks for ``tokens`` tokens now,
        and from then on :meth:`append_step` appends one token per row with fixed shapes, in place,
        without host synchronization: what a captured CUDA graph replays. ``columns_limit``: the
        most columns the run will have appended (evictors that keep per-segment state size it
        from this instead of reading the device)."""
        if self.static:
            raise ValueError("this store is already in static mode")
        for pool in self.pools.values():
            regions = [r for r in self.regions if r.pool is pool]
            width = -(-tokens // pool.block_size)
            need = sum(max(width, r.table.shape[1]) * self.batch_size - int((r.table >= 0).sum()) for r in regions)
            pool.fix_capacity(need)
            for region in regions:
                region.fix_width(width)
        self._grow_buffer(self.buffer_capacity)
        self.column = torch.full((), self.columns_seen, dtype=torch.long, device=self.device)
        self.overflow = torch.zeros((), dtype=torch.int32, device=self.device)
        self.static = True
        self.columns_limit = columns_limit

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
        G, cap = self.group_size, self.buf_k.shape[1]
        full = self.buf_len == cap
        first_group = full[:, None] & (torch.arange(cap, device=self.device) < G)
        self.encode_and_place(self.buf_k, self.buf_v, self.buf_meta, first_group, aligned=True)
        for t, fill in self._buffer_tensors():
            shifted = torch.cat([t[:, G:], torch.full_like(t[:, :G], fill)], dim=1)
            t.copy_(torch.where(full.view(-1, *[1] * (t.dim() - 1)), shifted, t))
        self.buf_len -= full * G

    def return_free_blocks(self) -> None:
        """Shrink every pool that keeps more free blocks than one per (row, region it serves):
        the blocks in use move to the lowest ids (payload and metadata as stored, nothing is
        re-encoded) and the block tables follow. Pagers call it after evicting, so allocated
        bytes stay within one block per (row, region) of the bytes in use. Eager mode only:
        in static mode the capacity is fixed on purpose."""
        if self.static:
            return
        for pool in self.pools.values():
            regions = [r for r in self.regions if r.pool is pool]
            if pool.num_free <= self.batch_size * len(regions):
                continue
            used = torch.unique(torch.cat([r.table[r.table >= 0] for r in regions]))  # shared blocks once
            remap = pool.keep_only(used)
            for region in regions:
                region.table = torch.where(region.table >= 0, remap[region.table.clamp(min=0)], -1)

    def bytes_in_use(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`memory`'s ``in_use`` as a device scalar (no host synchronization)."""
        sizes = self._sizes(dtype)
        blocks = sum(r.blocks_written() * sum(sizes["block"][id(r.pool)]) for r in self.regions)
        return blocks + sizes["tables"] + sizes["buffer"] + sizes["buffer_meta"]

    def _sizes(self, dtype: torch.dtype | None) -> dict:
        """Bytes per block of each pool (payload, metadata) and of what does not depend on
        what is stored (block tables with row scales, the buffer's K/V, its metadata), with the
        tensors held in the model's dtype (full-precision blocks, the buffer) counted at
        ``dtype``'s width (None: as held)."""
        held = self.buf_k.element_size()
        width = held if dtype is None else torch.empty(0, dtype=dtype).element_size()

        def at_width(n: int) -> int:
            return n * width // held

        def follows_model(pool: BlockPool) -> bool:
            return isinstance(pool.codec, DenseCodec) and pool.codec.dtype == self.dtype

        block = {id(p): ((at_width(p.payload_bytes_per_block) if follows_model(p) else p.payload_bytes_per_block),
                         p.meta_bytes_per_block) for p in self.pools.values()}
        tables = sum(r.table_bytes for r in self.regions)
        tables += sum(t.numel() * t.element_size() for s in self.row_scales.values() for t in s.values())
        return {
            "block": block, "tables": tables,
            "buffer": at_width(2 * self.buf_k.numel() * held),
            "buffer_meta": sum(t.numel() * t.element_size() for t in self.buf_meta.values()),
            "full_per_token": at_width(2 * self.num_kv_heads * self.head_dim * held),
        }

    # ------------------------------------------------------------------- view
    def view(self) -> StoreView:
        """Decode every row's kept tokens into dense tensors (blocks of each region, then the buffer)."""
        B = self.batch_size
        parts = []
        for index, region in enumerate(self.regions):
            table = region.table if self.static else region.used_table()  # static: no host read of the width
            pool = region.pool
            bs, W = pool.block_size, table.shape[1]
            ids = table.clamp(min=0).reshape(-1)
            slots = {n: t[ids] for n, t in pool.slots.items()}
            groups = {n: t[ids] for n, t in pool.blocks.items()}
            rows = torch.arange(B, device=self.device).repeat_interleave(W)
            scales = {n: t[rows] for n, t in self.row_scales[pool.codec.name].items()}
            if ids.numel():
                k, v = pool.codec.decode(slots, groups, scales, self.dtype)
            else:  # no blocks yet: skip the codec (quantized formats reject empty input)
                k = v = torch.zeros(0, bs, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
            inside = (table >= 0)[:, :, None].expand(B, W, bs).reshape(B, W * bs)
            phys = torch.where(inside, (table[:, :, None] * bs + torch.arange(bs, device=self.device)).reshape(B, -1), -1)
            meta = {n: t[ids].reshape(B, W * bs) for n, t in pool.meta.items()}
            parts.append((
                k.reshape(B, W * bs, *k.shape[2:]).to(self.dtype), v.reshape(B, W * bs, *v.shape[2:]).to(self.dtype),
                torch.where(inside, meta["pos"], -1), meta["valid"] & inside,
                torch.full_like(phys, index), phys,
            ))
        cap = self.buf_k.shape[1]
        buffer = (self.buf_k, self.buf_v, self.buf_meta["pos"], self.buf_meta["valid"],
                  torch.full((B, cap), -1, dtype=torch.long, device=self.device),
                  torch.full((B, cap), -1, dtype=torch.long, device=self.device))
        cols = sum(p[0].shape[1] for p in parts)
        keys, values, positions, valid, region, phys = (torch.cat(x, dim=1) for x in zip(*parts, buffer))
        classes = torch.cat([region[:, :cols], self.buf_meta["cls"]], dim=1)
        return StoreView(keys.transpose(1, 2), values.transpose(1, 2), positions, valid, region, phys, cols, classes)

    # ------------------------------------------------------- in-place reads
    def attention_sources(self) -> list[PagedSource]:
        """The layer's tokens where they lie, for :func:`~kvcompose.ops.paged_decode_attention`:
        one source per pool (the block tables of the regions sharing it side by side), then
        the recent buffer. Nothing is copied or decoded; no host synchronization."""
        return [source for source, _, _ in self._sources()]

    def attention_sources_with(self, channel: str) -> tuple[list[PagedSource], list[torch.Tensor]]:
        """:meth:`attention_sources` and, for each, the flat per-slot tensor of one float channel
        (where the decode attention adds an evictor's attention mass)."""
        parts = self._sources()
        return [source for source, _, _ in parts], [meta[channel] for _, meta, _ in parts]

    def _sources(self) -> list[tuple[PagedSource, dict, BlockPool | None]]:
        """``(source, its flat per-slot metadata channels, its pool or None for the buffer)``
        in :meth:`attention_sources` order."""
        out = []
        for name, pool in self.pools.items():
            table = torch.cat([r.table for r in self.regions if r.pool is pool], dim=1)
            if table.shape[1] == 0:
                continue
            meta = pool.flat_slots(pool.meta)
            k, v = pool.codec.kv_operands(pool.flat_slots(pool.slots), pool.flat_groups(), self.row_scales[name])
            out.append((PagedSource(k, v, table, pool.block_size, meta["valid"]), meta, pool))
        B, cap = self.buf_k.shape[:2]
        if cap:
            flat = (B * cap, self.num_kv_heads, self.head_dim)
            rows = torch.arange(B, device=self.device)[:, None]
            meta = {n: t.view(-1) for n, t in self.buf_meta.items()}
            source = PagedSource(KVOperand("dense", self.buf_k.view(flat)), KVOperand("dense", self.buf_v.view(flat)),
                                 rows, cap, meta["valid"])
            out.append((source, meta, None))
        return out

    def slot_state(self, channels: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Positions (-1 where empty), live bits and float channels of every slot column, in
        :meth:`attention_sources` order (``[B, L]`` each): what an evictor that reads no keys
        needs, with fixed shapes."""
        pos, valid, state = [], [], {c: [] for c in channels}
        for source, meta, _ in self._sources():
            slots = source.slots()
            flat = slots.clamp(min=0)
            live = (slots >= 0) & meta["valid"][flat]
            pos.append(torch.where(live, meta["pos"][flat], -1))
            valid.append(live)
            for c in channels:
                state[c].append(torch.where(live, meta[c][flat], 0.0))
        return torch.cat(pos, 1), torch.cat(valid, 1), {c: torch.cat(t, 1) for c, t in state.items()}

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

    def compact_static(self, view: StoreView, keep: torch.Tensor, in_place: bool) -> None:
        """Static mode: what a pager does after an eviction, with fixed shapes and no host read.

        ``in_place`` (the ``ct`` pager): evicted slots become holes that later tokens of their
        region refill. Otherwise (``gather``): each row's kept tokens of each region move, in
        column order, to the row's first slots, as the eager pager's compaction leaves them.
        ``view`` must come from :meth:`view` in static mode (every region's whole table). An
        eviction that removed anything counts in ``evictions_on_device``."""
        self.evictions_on_device += (view.valid & ~keep).any()
        col = 0
        for region in self.regions:
            pool = region.pool
            if not pool.codec.slot_local:
                raise ValueError(f"format {pool.codec.name!r} shares scales across tokens; it cannot be evicted from")
            bs = pool.block_size
            width = region.table.shape[1] * bs
            phys, kept = view.phys[:, col:col + width], keep[:, col:col + width]
            col += width
            if in_place:
                target = torch.where(view.valid[:, col - width:col] & ~kept, phys, pool.trash_slot).reshape(-1)
                for name, flat in pool.flat_slots(pool.meta).items():
                    flat.index_fill_(0, target, empty_value(name))
                continue
            if pool.codec.group_tokens > 1:
                raise ValueError(f"format {pool.codec.name!r} encodes {pool.codec.group_tokens} tokens together; "
                                 "its tokens cannot be compacted one at a time")
            order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)
            source = phys.gather(1, order).reshape(-1)
            count = kept.sum(1)
            live = (torch.arange(width, device=self.device)[None, :] < count[:, None]).reshape(-1)
            dest = phys.reshape(-1)
            for tensors in (pool.slots, pool.meta):
                for name, flat in pool.flat_slots(tensors).items():
                    moved = flat[source]  # read every source before writing any destination
                    if tensors is pool.meta:
                        empty = torch.full_like(moved, empty_value(name))
                        moved = torch.where(live, moved, empty)
                    flat[dest] = moved
            region.length.copy_(count)
            region.num_blocks.copy_((count + bs - 1) // bs)
        self._repack_buffer(keep[:, col:])

    def evict_one(self, **choice) -> torch.Tensor:
        """Static mode, one region: each row over ``choice["budget"]`` drops one token where it
        lies (see :func:`~kvcompose.ops.evict_one.evict_one_in_place` for ``choice``); returns
        ``[B]`` bool. A row that would need to drop more sets the overflow flag."""
        source, meta, _ = self._sources()[0]
        buffer = {"k": self.buf_k, "v": self.buf_v, **self.buf_meta}
        return evict_one_in_place(source.table, source.block_size, meta, buffer, self.buf_len,
                                  prompt_columns=self.prompt_columns or 0, bad=self.overflow, **choice)

    def _buffer_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-slot tensor of the buffer with the value of an empty slot."""
        return [(self.buf_k, 0), (self.buf_v, 0)] + [(t, empty_value(n)) for n, t in self.buf_meta.items()]

    def _repack_buffer(self, keep: torch.Tensor) -> None:
        """Move the buffer's ``keep`` tokens, in order, to its front (fixed shapes)."""
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
        count = keep.sum(1)
        kept = torch.arange(keep.shape[1], device=self.device)[None, :] < count[:, None]
        for t, fill in self._buffer_tensors():
            index = order.view(*order.shape, *[1] * (t.dim() - 2)).expand_as(t)
            shape = (*kept.shape, *[1] * (t.dim() - 2))
            t.copy_(torch.where(kept.view(shape), t.gather(1, index), fill))
        self.buf_len.copy_(count)

    def add_to_slots(self, name: str, delta: torch.Tensor) -> None:
        """Add ``[B, L]`` increments aligned with the columns of :meth:`attention_sources` to a float channel."""
        col = 0
        for source, meta, _ in self._sources():
            slots = source.slots()
            d = delta[:, col:col + slots.shape[1]].to(torch.float32)
            ok = slots >= 0  # missing blocks add zero to slot 0: fixed shapes, no host sync
            meta[name].index_add_(0, slots.clamp(min=0).reshape(-1), torch.where(ok, d, 0.0).reshape(-1))
            col += slots.shape[1]

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Live tokens and live prompt tokens per row (``[B]`` each), read from slot metadata only."""
        positions, valid, _ = self.slot_state()
        return valid.sum(1), (valid & (positions < (self.prompt_columns or 0))).sum(1)

    def channel(self, name: str, view: StoreView) -> torch.Tensor:
        """A float metadata channel, aligned with ``view``'s columns."""
        out = torch.zeros(view.valid.shape, dtype=torch.float32, device=self.device)
        for index, region in enumerate(self.regions):
            at = view.region == index
            out[at] = region.pool.flat_slots(region.pool.meta)[name][view.phys[at].clamp(min=0)]
        out[:, view.block_columns:] = self.buf_meta[name]
        return out * view.valid

    def add_to_channel(self, name: str, view: StoreView, delta: torch.Tensor) -> None:
        """Add a view-aligned ``[B, L]`` increment to a float metadata channel."""
        delta = (delta * view.valid).to(torch.float32)
        for index, region in enumerate(self.regions):
            at = (view.region == index) & (view.phys >= 0)
            region.pool.flat_slots(region.pool.meta)[name].index_add_(0, view.phys[at], delta[at])
        self.buf_meta[name] += delta[:, view.block_columns:]

    # ------------------------------------------------------------- accounting
    def live_tokens(self) -> torch.Tensor:
        """Live tokens per row (``[B]``)."""
        return sum(r.live_tokens() for r in self.regions) + self.buf_len

    def check_errors(self, where: str = "kvcompose store") -> None:
        """Raise for bad keys/values recorded on the device since the last check: NaN/inf in a
        real token (every format, the same message, naming ``where``), a row that outgrew the
        fixed capacity of static mode, then what encoding recorded (see
        :meth:`SlotCodec.check_errors`). Each error is raised once."""
        if int(self.nonfinite.item()):
            for flag in self.error_flags():  # the codecs saw the same bad values
                flag.zero_()
            raise ValueError(
                f"{where}: the model produced NaN/inf keys or values; the cache does not store them. Typical causes: "
                "fp16 overflow (run the model in bf16 or fp32), or NaN/inf already in the inputs or weights"
            )
        overflow = self._overflow_flags()
        if overflow and int(torch.stack(overflow).amax()):
            for flag in overflow:
                flag.zero_()
            raise ValueError(
                f"{where}: a sequence outgrew the capacity fixed for static decode (the buffer or a region's blocks); "
                "tokens were lost. This is a kvcompose bug: please report it, and decode with fast=False meanwhile"
            )
        for pool in self.pools.values():
            pool.codec.check_errors()

    def _overflow_flags(self) -> list[torch.Tensor]:
        return [self.overflow] + [r.overflow for r in self.regions] if self.static else []

    def error_flags(self) -> list[torch.Tensor]:
        """The device error flags of this layer (non-finite input, static-capacity overflow,
        then its codecs'; see :meth:`SlotCodec.error_flags`), so a caller can test many with
        one synchronization."""
        return [self.nonfinite] + [f.reshape(1) for f in self._overflow_flags()] + [
            f for f in (pool.codec.error_flags() for pool in self.pools.values()) if f is not None]

    def memory(self, dtype: torch.dtype | None = None) -> dict[str, int]:
        """Bytes this layer holds, split by what they are for: ``payload`` (blocks' K/V codes and
        scales), ``buffer`` (the recent buffer's K/V), ``metadata`` (per-slot positions and live
        bits, block tables, per-sequence scales). Blocks count once they hold a written slot
        (static mode reserves more: see ``allocated``). ``full``: K/V of every real token seen.

        ``dtype``: count what is held in the model's dtype (full-precision blocks, the buffer,
        the full cache) at that dtype's width, i.e. what this cache holds when the model runs
        in ``dtype``; quantized payload and metadata do not depend on it. None: as held.
        ``saved_by_sharing``: what the block-table entries that share another's block (share
        pager) would hold in blocks of their own."""
        sizes = self._sizes(dtype)
        payload = block_meta = allocated = shared = 0
        for r in self.regions:
            blocks = int(r.blocks_written())
            per_payload, per_meta = sizes["block"][id(r.pool)]
            payload += blocks * per_payload
            block_meta += blocks * per_meta
            if r.pool.refs is not None:
                shared += int(r.shared_entries().sum()) * (per_payload + per_meta)
        for pool in self.pools.values():
            allocated += pool.capacity * sum(sizes["block"][id(pool)])
        metadata = block_meta + sizes["tables"] + sizes["buffer_meta"]
        fixed = sizes["tables"] + sizes["buffer"] + sizes["buffer_meta"]
        return {
            "payload": payload,
            "metadata": metadata,
            "buffer": sizes["buffer"],
            "in_use": payload + metadata + sizes["buffer"],
            "allocated": allocated + fixed,
            "full": int(self.tokens_seen.sum()) * sizes["full_per_token"],
            "saved_by_sharing": shared,
        }
