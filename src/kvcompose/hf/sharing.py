"""Per-cache block sharing: find reasoning steps in the token stream, let the policy's
filter decide, and apply its decisions through the ``share`` pager.

After every forward pass the tracker reads the ids that pass appended (the cache's
:class:`~kvcompose.hf.tokens.TokenStream`) and cuts each sequence's generated text into
steps at the filter's delimiter (prompt tokens are not steps). A finished step is decided
once all its tokens have left the recent buffer, so its own blocks (full blocks whose
tokens all lie inside the step) are sealed. Decisions hold for every layer: the j-th own
block of a step is the same tokens in each layer, and its distance to a candidate block
is the mean over layers (ReasonCache §IV-A2). A sequence decides one step per forward
pass, so a decision never reads a block that an earlier decision of the same pass freed.

Everything here runs on the host between decode steps; its time is reported
(:meth:`report`) against ReasonCache's budget of 13.5 ms per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..sharing.filter import Pair, RowHistory, Step
from ..sharing.lexical import make_step

#: ReasonCache's measured filter overhead per reasoning step (§V-C), the budget we hold ours to.
PAPER_BUDGET_MS = 13.5


@dataclass
class RowState:
    history: RowHistory
    start: int  # index (into the stream's ids of the row) of the current step's first token
    seen: int  # ids of the row already scanned for the delimiter
    tail: str = ""  # text since the current step began, last few characters (to find the delimiter)
    steps: list[Step] = field(default_factory=list)  # decided steps, oldest first
    pending: list[Step] = field(default_factory=list)  # finished, waiting for their tokens to reach blocks


class SharingTracker:
    """Steps, decisions and their cost for one cache."""

    def __init__(self, cache):
        self.cache = cache
        self.filter = cache.policy.filter
        self.pager = cache.policy.pager
        self.rows: list[RowState] | None = None
        self.seconds = 0.0
        self.forwards = 0
        self.steps_decided = 0
        self.shareable = 0  # own blocks of decided steps (one per step block, all layers together)
        self.decisions = 0  # blocks that had a candidate to compare with
        self.shared = 0  # blocks shared (each in every layer)
        self._norms: dict = {}
        self._epoch = -1

    # ------------------------------------------------------------ per forward
    def after_forward(self) -> bool:
        """Scan the new tokens for step ends and decide the steps whose tokens are in blocks;
        returns whether blocks were shared."""
        began = time.perf_counter()
        stream = self.cache.tokens
        if self.rows is None:  # the prefill: the prompt is not a reasoning step
            self.rows = [RowState(self.filter.new_row(ids), start=len(ids), seen=len(ids)) for ids in stream.ids]
        else:
            for b, row in enumerate(self.rows):
                self._scan(b, row)
        shared = any(row.pending for row in self.rows) and self._decide_ready()
        self.forwards += 1
        self.seconds += time.perf_counter() - began
        return shared

    def _scan(self, b: int, row: RowState) -> None:
        stream, delim = self.cache.tokens, self.filter.delimiter
        ids, positions = stream.ids[b], stream.positions[b]
        for i in range(row.seen, len(ids)):
            row.tail = row.tail[len(row.tail) - len(delim) + 1:] + stream.piece(ids[i])
            if delim in row.tail:
                step_ids = ids[row.start:i + 1]
                step = Step(positions[row.start], positions[i], make_step(step_ids, stream.decode(step_ids)))
                self.filter.prepare(step)
                row.pending.append(step)
                row.start, row.tail = i + 1, ""
        row.seen = len(ids)

    # -------------------------------------------------------------- decisions
    def _decide_ready(self) -> bool:
        stores = [layer.store for layer in self.cache.layers]
        epoch = sum(s.evictions for s in stores)
        if epoch != self._epoch:  # an eviction rewrote blocks: cached norms may be stale
            self._norms, self._epoch = {}, epoch
        buffered = self._oldest_buffered(stores)
        ready = {b: row.pending[0] for b, row in enumerate(self.rows)
                 if row.pending and row.pending[0].last < buffered[b]}
        if not ready:
            return False
        blocks = [self._own_blocks(store, ready) for store in stores]  # [layer][row] -> columns per step
        shares: list[tuple[int, int, int, int]] = []  # (row, block of the ready step, earlier step, its block)
        for b, current in ready.items():
            row = self.rows[b]
            for k, step in enumerate(row.steps + [current]):
                step.blocks = min(len(per_layer[b][k]) for per_layer in blocks)
            before = row.history.decisions
            pairs = self.filter.choose(row.history, current, row.steps,
                                       lambda pairs, b=b: self._distances(stores, blocks, b, pairs))
            self.decisions += row.history.decisions - before
            self.steps_decided += 1
            self.shareable += current.blocks
            self.shared += len(pairs)
            shares += [(b, j, k, i) for j, k, i in pairs]
            row.pending.pop(0)
            row.steps.append(current)
        if not shares:
            return False
        for layer, store in enumerate(stores):
            cols = blocks[layer]
            rows = [b for b, _, _, _ in shares]
            targets = [cols[b][len(self.rows[b].steps) - 1][j] for b, j, _, _ in shares]
            sources = [cols[b][k][i] for b, _, k, i in shares]
            rows_t, targets_t, sources_t = (torch.tensor(x, dtype=torch.long, device=store.device)
                                            for x in (rows, targets, sources))
            replaced = store.regions[0].table[rows_t, targets_t].tolist()
            self.pager.share(store, rows_t, targets_t, sources_t)
            for b, block in zip(rows, replaced):  # its id may be handed out again: forget its norms
                self._norms.pop((layer, b, block), None)
        return True

    @staticmethod
    def _oldest_buffered(stores) -> list[int]:
        """Per row, the lowest position still in the recent buffer of any layer (a huge number if none)."""
        none = torch.iinfo(torch.long).max
        per_layer = [torch.where(s.buf_meta["valid"], s.buf_meta["pos"], none).amin(1)
                     if s.buf_meta["pos"].shape[1] else torch.full((s.batch_size,), none, device=s.device)
                     for s in stores]
        return torch.stack(per_layer).amin(0).tolist()

    def _own_blocks(self, store, ready: dict[int, Step]) -> dict[int, list[list[int]]]:
        """Per ready row: for each of its decided steps and then the ready one, the block-table
        columns of its own blocks in this layer (full, every token inside the step), in order."""
        region = store.regions[0]
        table = region.used_table()
        ids = table.clamp(min=0)
        pos, valid = region.pool.meta["pos"][ids], region.pool.meta["valid"][ids] & (table >= 0)[:, :, None]
        lo = torch.where(valid.all(-1), pos.amin(-1), -1).cpu().numpy()
        hi = pos.amax(-1).cpu().numpy()
        out = {}
        for b, current in ready.items():
            steps = self.rows[b].steps + [current]
            firsts = np.array([s.first for s in steps])
            lasts = np.array([s.last for s in steps])
            k = np.searchsorted(firsts, lo[b], side="right") - 1  # the step a block's first token is in
            own = (lo[b] >= 0) & (k >= 0) & (hi[b] <= lasts[k.clip(min=0)])
            cols: list[list[int]] = [[] for _ in steps]
            for c, step in zip(np.nonzero(own)[0].tolist(), k[own].tolist()):
                cols[step].append(c)
            out[b] = cols
        return out

    def _distances(self, stores, blocks, b: int, pairs: list[Pair]) -> list[float]:
        """ReasonCache's block distance for each pair, averaged over layers: per layer
        (|K_a - K_b| + |V_a - V_b|) / (2 * block_size * kv_heads), norms cached per block."""
        row = self.rows[b]
        current = len(row.steps)  # the ready step's index in blocks[layer][b]
        total = torch.zeros(len(pairs), dtype=torch.float64)
        for layer, store in enumerate(stores):
            cols = blocks[layer][b]
            a_cols = [cols[current][j] for j, _, _ in pairs]
            b_cols = [cols[k][i] for _, k, i in pairs]
            table = store.regions[0].table[b]
            ka, va = self._decode(store, b, table[torch.tensor(a_cols, device=store.device)])
            kb, vb = self._decode(store, b, table[torch.tensor(b_cols, device=store.device)])
            na = self._cached_norms(layer, b, store, a_cols, ka, va)
            nb = self._cached_norms(layer, b, store, b_cols, kb, vb)
            dot = torch.stack([(ka * kb).sum(-1), (va * vb).sum(-1)], -1)
            dist = (na + nb - 2 * dot).clamp(min=0).sqrt().sum(-1)
            total += dist.cpu().double() / (2 * store.regions[0].pool.block_size * store.num_kv_heads)
        return (total / len(stores)).tolist()

    @staticmethod
    def _decode(store, b: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks, flattened per block (``[n, block_size * H * D]`` fp32)."""
        pool = store.regions[0].pool
        slots = {n: t[ids] for n, t in pool.slots.items()}
        groups = {n: t[ids] for n, t in pool.blocks.items()}
        scales = {n: t[b].expand(ids.numel(), *t.shape[1:]) for n, t in store.row_scales[pool.codec.name].items()}
        k, v = pool.codec.decode(slots, groups, scales, torch.float32)
        return k.reshape(ids.numel(), -1).float(), v.reshape(ids.numel(), -1).float()

    def _cached_norms(self, layer, b, store, cols, k, v) -> torch.Tensor:
        """Squared norms ``[n, 2]`` (keys, values) of blocks, computed once per block: a sealed
        block never changes (the cache is dropped when an eviction rewrites blocks)."""
        keys = [(layer, b, int(store.regions[0].table[b, c])) for c in cols]
        missing = [i for i, key in enumerate(keys) if key not in self._norms]
        if missing:
            fresh = torch.stack([k[missing].square().sum(-1), v[missing].square().sum(-1)], -1)
            for i, n in zip(missing, fresh):
                self._norms[keys[i]] = n
        return torch.stack([self._norms[key] for key in keys])

    # ----------------------------------------------------------------- report
    def report(self) -> dict:
        """Steps decided, blocks shared, the share rate and the host time per step."""
        stores = [layer.store for layer in self.cache.layers if layer.store is not None]
        entries = sum(int(s.regions[0].shared_entries().sum()) for s in stores)
        return {
            "steps": self.steps_decided,
            "shareable_blocks": self.shareable,
            "decisions": self.decisions,
            "shared_blocks": self.shared,
            "shared_entries": entries,
            "share_rate": self.shared / self.shareable if self.shareable else 0.0,
            "filter_ms_per_step": 1000 * self.seconds / self.steps_decided if self.steps_decided else 0.0,
            "filter_ms_per_forward": 1000 * self.seconds / self.forwards if self.forwards else 0.0,
            "budget_ms_per_step": PAPER_BUDGET_MS,
        }
