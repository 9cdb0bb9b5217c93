"""The paged KV store of one layer for a batch of sequences, and its eager path.

New tokens first land in a full-precision recent buffer. Once a row's buffer holds
more than ``residual`` tokens plus a whole group of ``group_size``, the oldest full
groups are encoded once by their class's storage format and appended to that
class's blocks (a :class:`Region`); they are never re-encoded. Everything is
vectorized over the batch: rows of different lengths are handled with masks and
cumulative sums, never with a Python loop over sequences or tokens.

This module holds the state and the eager path (append, dense view, encode and
refill); :class:`LayerStore` takes static mode, in-place reads, memory accounting
and error checks from the ``store_*`` modules beside it. The store does not decide
what to evict: pagers use :meth:`Region.place`, :meth:`Region.release_rows` and
:meth:`LayerStore.refill_buffer` to rewrite rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.scatter_slots import gather_slots_many
from .codec import DenseCodec, SlotCodec
from .pool import BlockPool, decoded_slots, empty_value
from .region import Region
from .store_checks import StoreChecks
from .store_memory import StoreMemory
from .store_sources import StoreSources
from .store_static import StoreStatic


@dataclass
class StoreView:
    """Dense snapshot of one layer: what attention and evictors read.

    Columns are each region's block slots, in region order, followed by the buffer
    slots; in static mode the regions that share a row reserve share their columns
    (:meth:`LayerStore.view_parts`). Live tokens of the buffer, and of a region under the
    ``gather`` pager, are in position order; under ``ct`` a region's refilled holes break that order.
    ``source[b, j]`` locates column ``j``: ``(region index, pool slot)``, with region
    index ``-1`` for buffer columns.
    """

    keys: torch.Tensor | None  # [B, Hkv, L, D]; None in a view of metadata alone (LayerStore.keys_at decodes)
    values: torch.Tensor | None  # [B, Hkv, L, D]; None in a keys-only view (LayerStore.view)
    positions: torch.Tensor  # [B, L] int64, -1 where empty
    valid: torch.Tensor  # [B, L] bool
    region: torch.Tensor  # [B, L] int64 region index of the column, -1 for the buffer
    phys: torch.Tensor  # [B, L] int64 pool slot of the column, -1 for buffer or empty
    block_columns: int  # number of leading columns that map to blocks
    classes: torch.Tensor | None = None  # [B, L] int64 token class (region index; buffer tokens' own class)


class LayerStore(StoreStatic, StoreSources, StoreMemory, StoreChecks):
    """Regions (one per token class), their pools, and the recent buffer of one layer.

    The one class callers use; each base holds one part of its behaviour over this state."""

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
        decoded_copy: bool | None = None,
        head_major: bool = False,
    ):
        """``decoded_copy``: whether the pools of quantized formats keep a decoded copy of their
        slots (see :mod:`~kvcompose.paging.pool`) for the plain-torch decode attention to read
        instead of decoding every kept token at every step. None: on CPU only, where that
        attention runs and where a run's memory is not its point (the memory report counts
        the compressed store either way); on CUDA the fused kernel decodes in registers.
        ``head_major``: the pools keep each head's slots together (``Policy.pool_layout="head"``)."""
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
        if decoded_copy is None:
            decoded_copy = torch.device(device).type == "cpu"
        pools: dict[str, BlockPool] = {}
        for codec in codecs.values():
            if codec.name not in pools:
                copy = decoded_copy and not isinstance(codec, DenseCodec)
                pools[codec.name] = BlockPool(codec, block_size, num_kv_heads, head_dim, device, float_channels,
                                              refcounted, dtype if copy else None, head_major)
        self.pools = pools
        self.regions = [Region(name, pools[c.name], batch_size, device) for name, c in codecs.items()]
        self.class_names = list(codecs)
        # Per-sequence scales of formats that fix them at a sequence's first encode.
        self.row_scales = {
            name: {k: torch.zeros(batch_size, h, device=device) for k, h in p.codec.row_scale_layout(num_kv_heads).items()}
            for name, p in pools.items()
        }
        self.row_scales_set = {name: torch.zeros(batch_size, dtype=torch.bool, device=device) for name in pools}
        # What the attention reads of them (SlotCodec.attention_scales), updated in place where they change.
        self.attention_scales = {name: p.codec.attention_scales(self.row_scales[name]) for name, p in pools.items()}
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

    def encode_and_place(self, k: torch.Tensor, v: torch.Tensor, meta: dict, mask: torch.Tensor) -> None:
        """Encode the ``mask``-selected buffer tokens (``[B, N, H, D]``) by class and append them to blocks."""
        for index, region in enumerate(self.regions):
            sel = mask & (meta["cls"] == index)
            if not bool(sel.any()):
                continue
            codec, pool_name = region.pool.codec, region.pool.codec.name
            scales = self._row_scales_for(pool_name, codec, k, v, sel)
            slots, groups = codec.encode(k[sel], v[sel], scales)
            if region.pool.decoded:
                slots.update(decoded_slots(codec, slots, groups, scales, self.dtype))
            region.place(sel, slots, groups, {name: meta[name][sel] for name in region.pool.meta})

    def _row_scales_for(self, pool_name: str, codec: SlotCodec, k, v, sel) -> dict:
        """Per-token view of a format's per-sequence scales, fixing them at a row's first encode."""
        store = self.row_scales[pool_name]
        if not store:
            return {}
        first = sel.any(1) & ~self.row_scales_set[pool_name]
        if bool(first.any()):
            self._fix_row_scales(pool_name, codec, k, v, sel, first)
        rows = torch.arange(self.batch_size, device=self.device)[:, None].expand_as(sel)
        return {name: t[rows[sel]] for name, t in store.items()}

    def _fix_row_scales(self, pool_name: str, codec: SlotCodec, k, v, sel, first: torch.Tensor) -> None:
        """Fix the per-sequence scales of the rows in ``first`` (``[B]`` bool) from their
        ``sel``-selected tokens (``[B, N]`` of ``k``, ``v`` ``[B, N, H, D]``), and what the
        attention reads of them; other rows keep theirs. No host read."""
        store = self.row_scales[pool_name]
        fresh = codec.init_row_scales(k, v, sel & first[:, None])
        for name, t in fresh.items():
            store[name].copy_(torch.where(first[:, None], t, store[name]))
        self.row_scales_set[pool_name] |= first
        for name, t in codec.attention_scales(store).items():
            self.attention_scales[pool_name][name].copy_(t)

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

    def view(self, values: bool = True, keys: bool = True) -> StoreView:
        """Decode every row's kept tokens into dense tensors (blocks of each region, then the buffer).

        ``values=False``: keys only (``values`` is None), for evictors and classifiers, which
        score keys: no value payload is gathered or decoded. ``keys=False`` as well: positions,
        validity and where each column lies, nothing decoded (:meth:`keys_at` decodes the
        columns an evictor asks for)."""
        if values and not keys:
            raise ValueError("a view with values has keys too (keys=False needs values=False)")
        B = self.batch_size
        parts = []
        for pool, table, owner in self.view_tables():
            bs, W = pool.block_size, table.shape[1]
            ids = table.clamp(min=0).reshape(-1)
            wanted = set(pool.slots) | set(pool.blocks)
            if not values:
                wanted = set(pool.codec.key_tensors(sorted(wanted))) if keys else set()
            inside = (table >= 0)[:, :, None].expand(B, W, bs).reshape(B, W * bs)
            slot = table[:, :, None] * bs + torch.arange(bs, device=self.device)
            phys = torch.where(inside, slot.reshape(B, -1), -1)
            # per slot, as whole rows (ops.scatter_slots): indexing a head-major pool by block moves an element a thread
            flat = pool.flat_slots(pool.slots, wanted)
            gathered = gather_slots_many(list(flat.values()), phys, inside) if flat else []  # one launch
            slots = {n: g.view(B * W, bs, *t.shape[1:]) for g, (n, t) in zip(gathered, flat.items())}
            groups = {n: t[ids] for n, t in pool.blocks.items() if n in wanted}
            rows = torch.arange(B, device=self.device).repeat_interleave(W) if keys else None
            scales = {n: t[rows] for n, t in self.row_scales[pool.codec.name].items()} if keys else {}
            if not keys:  # metadata alone: nothing above was gathered to decode
                k = v = None
            elif not ids.numel():  # no blocks yet: skip the codec (quantized formats reject empty input)
                k = torch.zeros(0, bs, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
                v = k if values else None
            elif values:
                k, v = pool.codec.decode(slots, groups, scales, self.dtype)
            else:
                k, v = pool.codec.decode_keys(slots, groups, scales, self.dtype), None
            meta = {n: t[ids].reshape(B, W * bs) for n, t in pool.meta.items()}
            parts.append((
                None if k is None else k.reshape(B, W * bs, *k.shape[2:]).to(self.dtype),
                None if v is None else v.reshape(B, W * bs, *v.shape[2:]).to(self.dtype),
                torch.where(inside, meta["pos"], -1), meta["valid"] & inside,
                torch.full_like(phys, owner) if isinstance(owner, int) else owner.repeat_interleave(bs, 1), phys,
            ))
        cap = self.buf_k.shape[1]
        buffer = (self.buf_k if keys else None, self.buf_v if values else None, self.buf_meta["pos"],
                  self.buf_meta["valid"],
                  torch.full((B, cap), -1, dtype=torch.long, device=self.device),
                  torch.full((B, cap), -1, dtype=torch.long, device=self.device))
        cols = sum(p[2].shape[1] for p in parts)  # block columns (by positions: keys may be left out)
        k, v, positions, valid, region, phys = (
            None if x[0] is None else torch.cat(x, dim=1) for x in zip(*parts, buffer))
        classes = torch.cat([region[:, :cols], self.buf_meta["cls"]], dim=1)
        return StoreView(None if k is None else k.transpose(1, 2), None if v is None else v.transpose(1, 2),
                         positions, valid, region, phys, cols, classes)

    def keys_at(self, view: StoreView, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The keys of columns ``cols`` ``[S, N]`` of rows ``rows`` ``[S]`` of ``view``, ``[S, N, Hkv * D]``:
        read from the view where it holds keys, else decoded for those columns alone (a view built with
        ``keys=False``), with fixed shapes and no host read. An evictor that reads a few columns of
        each row (ThinKV's K-means over generated segments) then decodes those, not the whole table."""
        S, N = cols.shape
        r = rows[:, None].expand(S, N)
        if view.keys is not None:
            return view.keys[r, :, cols].reshape(S, N, -1)
        H, D = self.num_kv_heads, self.head_dim
        cap = self.buf_k.shape[1]
        in_buffer = cols >= view.block_columns
        if cap:
            out = self.buf_k[r, (cols - view.block_columns).clamp(0, cap - 1)].to(self.dtype)  # [S, N, H, D]
        else:
            out = torch.zeros(S, N, H, D, dtype=self.dtype, device=self.device)
        region, phys = view.region[r, cols], view.phys[r, cols]
        rows_flat = r.reshape(-1)
        for pool in self.pools.values():
            if pool.capacity == 0:  # no blocks: no column of this pool
                continue
            here = torch.zeros_like(in_buffer)
            for index, reg in enumerate(self.regions):
                if reg.pool is pool:
                    here |= region == index
            here &= ~in_buffer & (phys >= 0)
            if pool.codec.group_tokens != 1:  # groups of tokens share their scales: decode whole blocks
                raise ValueError(f"keys_at: format {pool.codec.name!r} encodes {pool.codec.group_tokens} tokens "
                                 "together; build the view with its keys instead")
            at = torch.where(here, phys, 0)  # every asked column decoded: shapes do not depend on which
            names = pool.codec.key_tensors(sorted(set(pool.slots) | set(pool.blocks)))
            flat = pool.flat_slots(pool.slots, names)
            gathered = gather_slots_many(list(flat.values()), at, here) if flat else []  # one launch
            slots = {n: g.view(S * N, 1, *t.shape[1:]) for g, (n, t) in zip(gathered, flat.items())}
            groups = {n: t[at.reshape(-1)][:, None] for n, t in pool.flat_groups().items() if n in names}
            scales = {n: t[rows_flat] for n, t in self.row_scales[pool.codec.name].items()}
            k = pool.codec.decode_keys(slots, groups, scales, self.dtype).reshape(S, N, H, D).to(self.dtype)
            out = torch.where(here[..., None, None], k, out)
        return out.reshape(S, N, H * D)

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
