"""Memory accounting of :class:`~kvcompose.paging.store.LayerStore`: what a layer holds.

The byte counts sit apart from the paths that fill the store because both paths report
them (``memory`` on the host, ``bytes_in_use`` as a device scalar inside a CUDA graph)
from one table of sizes.
"""

from __future__ import annotations

import torch

from ..device_constants import device_constant
from .codec import DenseCodec
from .pool import BlockPool


class StoreMemory:
    """Live tokens, bytes held and in use, and the return of free blocks of a layer store."""

    def live_tokens(self) -> torch.Tensor:
        """Live tokens per row (``[B]``)."""
        return sum(r.live_tokens() for r in self.regions) + self.buf_len

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

    def bytes_in_use(self, dtype: torch.dtype | None = None) -> torch.Tensor | int:
        """:meth:`memory`'s ``in_use`` as a device scalar (no host synchronization)."""
        sizes = self._sizes(dtype)
        fixed = sizes["tables"] + sizes["buffer"] + sizes["buffer_meta"]
        if not self.regions:
            return fixed
        # every region at once, a few launches per layer (not per region: this runs in eviction steps)
        device = self.regions[0].length.device
        per_block = [sum(sizes["block"][id(r.pool)]) for r in self.regions]
        bs = [r.pool.block_size for r in self.regions]
        lengths = (torch.stack([r.length for r in self.regions]) if len(self.regions) > 1
                   else self.regions[0].length[None])  # [regions, B]
        rounded = lengths + device_constant(tuple(b - 1 for b in bs), device)[:, None]
        blocks = (rounded // device_constant(tuple(bs), device)[:, None]).sum(1)  # Region.blocks_written, unshared
        total = (blocks * device_constant(tuple(per_block), device)).sum() + fixed
        for r, size in zip(self.regions, per_block):
            if r.pool.refs is not None:  # the share pager: a block several entries of a row reference counts once
                total = total - r.shared_entries().sum() * size
        return total

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
        scales = {id(t): t for d in (*self.row_scales.values(), *self.attention_scales.values()) for t in d.values()}
        tables += sum(t.numel() * t.element_size() for t in scales.values())
        return {
            "block": block, "tables": tables,
            "buffer": at_width(2 * self.buf_k.numel() * held),
            "buffer_meta": sum(t.numel() * t.element_size() for t in self.buf_meta.values()),
            "full_per_token": at_width(2 * self.num_kv_heads * self.head_dim * held),
        }

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
