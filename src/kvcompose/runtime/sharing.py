"""Per-cache block sharing: find reasoning steps in the token stream, let the policy's
filter decide, and apply its decisions through the ``share`` pager.

After every forward pass the tracker reads the ids that pass appended (the cache's
:class:`~kvcompose.runtime.tokens.TokenStream`) and cuts each sequence's generated text into
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
import torch.nn.functional as F

from ..filters.base import Pair, RowHistory, Step
from ..filters.lexical import make_step
from .owner import OwningCache

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

    cache = OwningCache()  # weak: the cache owns this part

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
        # Per layer: squared norms (keys, values) of blocks by id, on the device, and on the host
        # the ids whose norms are known (a sealed block never changes; see _block_norms).
        self._norms: list[torch.Tensor] = []
        self._known: list[set[int]] = []
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
        """Decide one finished step per sequence whose tokens have all left the recent buffer:
        own blocks of every layer read at once, every sequence's block pairs measured at once
        (one host read for all distances), then the shares applied layer by layer."""
        stores = [layer.store for layer in self.cache.layers]
        epoch = sum(s.evictions for s in stores)
        if epoch != self._epoch:  # an eviction rewrote blocks: cached norms may be stale
            self._norms = [torch.zeros(0, 2, device=s.device) for s in stores]
            self._known, self._epoch = [set() for _ in stores], epoch
        # Every layer moves the same tokens out of its buffer (evictions only remove more), so
        # layer 0 says when a step's tokens are all in blocks.
        none = torch.iinfo(torch.long).max
        buf = stores[0].buf_meta
        buffered = (torch.where(buf["valid"], buf["pos"], none).amin(1).tolist() if buf["pos"].shape[1]
                    else [none] * stores[0].batch_size)
        ready = {b: row.pending[0] for b, row in enumerate(self.rows)
                 if row.pending and row.pending[0].last < buffered[b]}
        if not ready:
            return False
        blocks, ids = self._own_blocks(stores, ready)  # [layer][row]: columns per step; [layer][row]: block ids
        wanted: dict[int, list[Pair]] = {}
        for b, current in ready.items():
            row = self.rows[b]
            for k, step in enumerate(row.steps + [current]):
                step.blocks = min(len(per_layer[b][k]) for per_layer in blocks)
            wanted[b] = self.filter.pairs(current, row.steps)
        distances = self._distances(stores, blocks, ids, wanted)
        shares: list[tuple[int, int, int, int]] = []  # (row, block of the ready step, earlier step, its block)
        for b, current in ready.items():
            row = self.rows[b]
            before = row.history.decisions
            chosen = self.filter.decide(row.history, current, row.steps, wanted[b], distances[b])
            self.decisions += row.history.decisions - before
            self.steps_decided += 1
            self.shareable += current.blocks
            self.shared += len(chosen)
            shares += [(b, j, k, i) for j, k, i in chosen]
            row.pending.pop(0)
            row.steps.append(current)
        if not shares:
            return False
        rows = [b for b, _, _, _ in shares]
        for layer, store in enumerate(stores):
            cols = blocks[layer]
            targets = [cols[b][len(self.rows[b].steps) - 1][j] for b, j, _, _ in shares]
            sources = [cols[b][k][i] for b, _, k, i in shares]
            for b, c in zip(rows, targets):  # the replaced block's id may be handed out again
                self._known[layer].discard(ids[layer][b][c])
            as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=store.device)  # noqa: E731
            self.pager.share(store, as_tensor(rows), as_tensor(targets), as_tensor(sources), check=False)
        return True

    def _own_blocks(self, stores, ready: dict[int, Step]):
        """Per layer and ready row: for each of its decided steps and then the ready one, the
        block-table columns of its own blocks (full, every token inside the step), in order; and
        per layer and row the block id of every column. One host read for all layers."""
        parts = []
        for store in stores:
            region = store.regions[0]
            table = region.table  # its whole width: reading the used width would wait for the device
            phys = table.clamp(min=0)
            pos, valid = region.pool.meta["pos"][phys], region.pool.meta["valid"][phys] & (table >= 0)[:, :, None]
            parts.append(torch.stack([torch.where(valid.all(-1), pos.amin(-1), -1), pos.amax(-1), table], -1))
        width = max(p.shape[1] for p in parts)
        info = torch.stack([F.pad(p, (0, 0, 0, width - p.shape[1]), value=-1) for p in parts]).cpu().numpy()
        blocks, ids = [], []
        for lo, hi, table in (np.moveaxis(layer, -1, 0) for layer in info):  # each [B, width]
            per_row = {}
            for b, current in ready.items():
                steps = self.rows[b].steps + [current]
                firsts = np.array([s.first for s in steps])
                lasts = np.array([s.last for s in steps])
                k = np.searchsorted(firsts, lo[b], side="right") - 1  # the step a block's first token is in
                own = (lo[b] >= 0) & (k >= 0) & (hi[b] <= lasts[k.clip(min=0)])
                cols: list[list[int]] = [[] for _ in steps]
                for c, step in zip(np.nonzero(own)[0].tolist(), k[own].tolist()):
                    cols[step].append(c)
                per_row[b] = cols
            blocks.append(per_row)
            ids.append({b: table[b].tolist() for b in ready})
        return blocks, ids

    def _distances(self, stores, blocks, ids, wanted: dict[int, list[Pair]]) -> dict[int, list[float]]:
        """ReasonCache's block distance of every wanted pair, averaged over layers: per layer
        ``(|K_a - K_b| + |V_a - V_b|) / (2 * block_size * kv_heads)``, from the dot products and
        the blocks' squared norms (cached per block: a sealed block never changes)."""
        flat = [(b, pair) for b, pairs in wanted.items() for pair in pairs]
        if not flat:
            return {b: [] for b in wanted}
        total = None
        for layer, store in enumerate(stores):
            cols, table = blocks[layer], ids[layer]
            current = {b: len(self.rows[b].steps) for b in wanted}  # the ready step's index in cols[b]
            a = [table[b][cols[b][current[b]][j]] for b, (j, _, _) in flat]
            c = [table[b][cols[b][k][i]] for b, (_, k, i) in flat]
            rows = torch.tensor([b for b, _ in flat], device=store.device)
            a_ids, c_ids = torch.tensor([a, c], device=store.device)
            ka, va = self._decode(store, rows, a_ids)
            kc, vc = self._decode(store, rows, c_ids)
            na = self._block_norms(layer, a, a_ids, ka, va)
            nc = self._block_norms(layer, c, c_ids, kc, vc)
            dot = torch.stack([(ka * kc).sum(-1), (va * vc).sum(-1)], -1)
            heads = self.cache.heads  # squared distances add up over the heads of every rank
            squared = heads.all_sum((na + nc - 2 * dot).contiguous())
            dist = squared.clamp(min=0).sqrt().sum(-1) / (2 * store.regions[0].pool.block_size
                                                          * heads.total(store.num_kv_heads))
            total = dist if total is None else total + dist
        values = (total / len(stores)).tolist()
        out: dict[int, list[float]] = {b: [] for b in wanted}
        for (b, _), d in zip(flat, values):
            out[b].append(d)
        return out

    @staticmethod
    def _decode(store, rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks (of sequences ``rows``), flattened per block (fp32)."""
        pool = store.regions[0].pool
        slots = {n: t[ids] for n, t in pool.slots.items()}
        groups = {n: t[ids] for n, t in pool.blocks.items()}
        scales = {n: t[rows] for n, t in store.row_scales[pool.codec.name].items()}
        k, v = pool.codec.decode(slots, groups, scales, torch.float32)
        return k.reshape(ids.numel(), -1).float(), v.reshape(ids.numel(), -1).float()

    def _block_norms(self, layer: int, block_ids: list[int], ids: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Squared norms ``[n, 2]`` (keys, values) of blocks ``ids`` (``block_ids`` on the host):
        computed once per block and kept (the host knows which ids are kept: nothing is read back)."""
        known = self._known[layer]
        missing = [i for i, block in enumerate(block_ids) if block not in known]
        norms = self._norms[layer]
        need = max(block_ids) + 1
        if need > norms.shape[0]:
            norms = self._norms[layer] = torch.cat([norms, norms.new_zeros(need - norms.shape[0], 2)])
        if missing:
            at = torch.tensor(missing, device=k.device)
            fresh = torch.stack([k[at].square().sum(-1), v[at].square().sum(-1)], -1)
            norms.index_copy_(0, ids[at], fresh)  # a block named twice gets the same value twice
            known.update(block_ids[i] for i in missing)
        return norms[ids]

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
