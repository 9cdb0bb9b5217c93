"""In-place reads of :class:`~kvcompose.paging.store.LayerStore`: tokens where they lie.

The decode attention and the key-free evictors read the pools and the recent buffer
directly, as paged sources, instead of a decoded dense view: nothing is copied and the
shapes stay fixed for static decode.
"""

from __future__ import annotations

import torch

from ..device_constants import device_constant
from ..ops.paged_attention import KVOperand, PagedSource
from .pool import DECODED, BlockPool


class StoreSources:
    """Paged attention sources, per-slot state and channel updates of a layer store."""

    def attention_sources(self) -> list[PagedSource]:
        """The layer's tokens where they lie, for :func:`~kvcompose.ops.paged_decode_attention`:
        one source per region (regions may share a pool), then the recent buffer, each with its
        pool's decoded copy where it keeps one. Nothing is copied or decoded; no host
        synchronization."""
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
            # Each region is a source of its own, bounded by the columns its rows have written:
            # regions side by side in one table would be read over their whole reservation
            # (ThinKV's R and E share one NVFP4 pool, and each reserves room for the prompt).
            regions = [r for r in self.regions if r.pool is pool and r.table.shape[1]]
            if not regions:
                continue
            meta = pool.flat_slots(pool.meta)
            slots = pool.flat_slots(pool.slots)
            k, v = pool.codec.kv_operands(slots, pool.flat_groups(), self.attention_scales[name])
            decoded = (slots[DECODED[0]], slots[DECODED[1]]) if pool.decoded else None
            out += [(PagedSource(k, v, r.table, pool.block_size, meta["valid"], decoded, r.length), meta, pool)
                    for r in regions]
        B, cap = self.buf_k.shape[:2]
        if cap:
            flat = (B * cap, self.num_kv_heads, self.head_dim)
            rows = device_constant(tuple(range(B)), self.device, torch.long)[:, None]  # no arange per step
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
