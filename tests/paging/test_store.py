"""Paged store invariants: direct checks and a hypothesis state machine over random operations."""

import torch
from conftest import random_keep
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcompose.pagers import ContinuousThinkingPager, GatherPager
from kvcompose.paging import BlockPool, DenseCodec, LayerStore

H, D = 2, 4


def _tokens(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def test_pool_reuses_freed_blocks_before_growing():
    pool = BlockPool(DenseCodec(torch.float32), 4, H, D, torch.device("cpu"))
    a = pool.allocate(3)
    assert pool.capacity == 3
    pool.release(a[:2])
    b = pool.allocate(2)
    assert sorted(b.tolist()) == sorted(a[:2].tolist()) and pool.capacity == 3
    pool.allocate(2)
    assert pool.capacity > 3 and pool.blocks_in_use == 5


def test_append_skips_padding_and_groups_into_blocks():
    store = LayerStore(2, H, D, torch.float32, torch.device("cpu"), block_size=4, group_size=4)
    k, v = _tokens(2, 7, 0)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[0, :3] = False
    positions = store.append(k, v, real)
    assert positions.tolist()[0] == list(range(7))
    assert store.regions[0].length.tolist() == [4, 4] and store.buf_len.tolist() == [0, 3]
    view = store.view()
    for b in range(2):
        live = view.valid[b]
        expected = torch.arange(7)[real[b]]
        assert view.positions[b][live].tolist() == expected.tolist()
        torch.testing.assert_close(view.keys[b][:, live], k[b][:, real[b]], rtol=0, atol=0)
    assert store.live_tokens().tolist() == [4, 7]
    assert store.columns_seen == 7 and store.tokens_seen.tolist() == [4, 7]


def test_dtype_and_shape_mismatches_are_named():
    store = LayerStore(1, H, D, torch.float32, torch.device("cpu"))
    k, v = _tokens(1, 2, 0)
    import pytest

    with pytest.raises(ValueError, match="cache dtype torch.float32"):
        store.append(k.half(), v.half())
    with pytest.raises(ValueError, match="2 KV heads, head dim 4"):
        store.append(k[:, :1], v[:, :1])


class StoreMachine(RuleBasedStateMachine):
    """Random appends (with padding) and evictions; the store must match a plain dict model."""

    @initialize(
        batch=st.integers(1, 3), block=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 4, 5]),
        residual=st.sampled_from([0, 3]), classes=st.integers(1, 3),
        pager=st.sampled_from(["gather", "ct in place", "ct", "ct 2"]),
    )
    def setup(self, batch, block, group, residual, classes, pager):
        self.B = batch
        self.ct = pager.startswith("ct")
        # ct: None never moves a token; 1 or 2 blocks' worth of holes per (row, class) move the newest in
        self.hole_blocks = {"ct in place": None, "ct": 1, "ct 2": 2}.get(pager)
        self.pager = ContinuousThinkingPager(max_hole_blocks=self.hole_blocks) if self.ct else GatherPager()
        codecs = {f"c{i}": DenseCodec(torch.float64) for i in range(classes)}
        self.store = LayerStore(batch, H, D, torch.float64, torch.device("cpu"), block_size=block, group_size=group,
                                residual=residual, codecs=codecs)
        self.classes = classes
        self.model = [dict() for _ in range(batch)]  # position -> (k, v, class)
        self.seen = [0] * batch
        self.seed = 0

    @rule(T=st.integers(1, 9), data=st.data())
    def append(self, T, data):
        self.seed += 1
        k, v = _tokens(self.B, T, self.seed)
        k, v = k.double(), v.double()
        bits = data.draw(st.lists(st.booleans(), min_size=self.B * T, max_size=self.B * T))
        real = torch.tensor(bits, dtype=torch.bool).view(self.B, T)
        classes = data.draw(st.lists(st.integers(0, self.classes - 1), min_size=self.B * T, max_size=self.B * T))
        cls = torch.tensor(classes, dtype=torch.long).view(self.B, T)
        start = self.store.columns_seen
        blocks_before = [r.num_blocks.clone() for r in self.store.regions]
        self.store.append(k, v, real, cls)
        for region, before in zip(self.store.regions, blocks_before):
            grew = region.num_blocks > before
            if region.has_holes and bool(grew.any()):
                _, n_holes = region._holes()
                assert bool((n_holes[grew] == 0).all()), "a new block was taken while holes were left"
        for b in range(self.B):
            for t in range(T):
                if real[b, t]:
                    self.model[b][start + t] = (k[b, :, t].clone(), v[b, :, t].clone(), int(cls[b, t]))
                    self.seen[b] += 1

    @rule(data=st.data())
    def evict(self, data):
        view = self.store.view()
        keep = random_keep(data, view)
        for b in range(self.B):
            for pos in view.positions[b][view.valid[b] & ~keep[b]].tolist():
                del self.model[b][pos]
        in_blocks = view.valid & keep & (view.phys >= 0)
        where_before = {(b, p): s for b, p, s in zip(in_blocks.nonzero()[:, 0].tolist(),
                                                     view.positions[in_blocks].tolist(), view.phys[in_blocks].tolist())}
        used_before = self.store.regions[0].pool.blocks_in_use
        bs = self.store.regions[0].pool.block_size
        emptied = {s // bs for s in view.phys[view.valid & ~keep & (view.phys >= 0)].tolist()}
        emptied -= {s // bs for s in where_before.values()}
        self.pager.compact(self.store, view, keep)
        if self.ct and self.hole_blocks is None:  # no token leaves its block or offset; emptied blocks are freed
            after = self.store.view()
            live = after.valid & (after.phys >= 0)
            where_after = {(b, p): s for b, p, s in zip(live.nonzero()[:, 0].tolist(),
                                                        after.positions[live].tolist(), after.phys[live].tolist())}
            assert all(where_after[key] % bs == slot % bs for key, slot in where_before.items())
            block_after = {}  # a block may move as a whole when the pool gives back free blocks
            for key, slot in where_before.items():
                assert block_after.setdefault(slot // bs, where_after[key] // bs) == where_after[key] // bs
            assert self.store.regions[0].pool.blocks_in_use == used_before - len(emptied)

    @invariant()
    def kept_tokens_are_exactly_the_model(self):
        if not hasattr(self, "store"):
            return
        view = self.store.view()
        for b in range(self.B):
            live = view.valid[b]
            pos = view.positions[b][live].tolist()
            assert sorted(pos) == sorted(self.model[b]), "kept tokens lost or invented"
            for j, p in enumerate(pos):
                mk, mv, mc = self.model[b][p]
                assert torch.equal(view.keys[b][:, live][:, j], mk)
                assert torch.equal(view.values[b][:, live][:, j], mv)
                region = int(view.region[b][live][j])
                assert region in (-1, mc), "token stored in another class's blocks"
            for index in range(-1, 0 if self.ct else self.classes):  # ct refills holes out of order
                part = view.positions[b][live & (view.region[b] == index)].tolist()
                assert part == sorted(part), "tokens of one region are out of position order"
            assert bool((view.classes[b][live] == torch.tensor([self.model[b][p][2] for p in pos],
                                                                dtype=torch.long)).all())

    @invariant()
    def ct_holes_stay_below_the_limit(self):
        if not hasattr(self, "store") or self.hole_blocks is None:
            return
        for region in self.store.regions:
            holes = region.length - region.live_tokens()
            assert bool((holes < self.hole_blocks * region.pool.block_size).all()), f"holes {holes.tolist()}"

    @invariant()
    def no_slot_holds_two_tokens_and_blocks_are_owned_once(self):
        if not hasattr(self, "store"):
            return
        s = self.store
        pool = s.regions[0].pool  # dense codecs of one dtype share one pool
        assert all(r.pool is pool for r in s.regions)
        ids = torch.cat([r.table[r.table >= 0] for r in s.regions])
        assert ids.unique().numel() == ids.numel(), "a block is in two table entries"
        free = pool._free[: pool.num_free]
        assert not set(free.tolist()) & set(ids.tolist()), "a block is both free and in use"
        assert ids.numel() + free.numel() == pool.capacity
        view = s.view()
        phys = view.phys[view.valid & (view.phys >= 0)]
        assert phys.unique().numel() == phys.numel(), "a slot holds two live tokens"
        assert int(pool.meta["valid"].sum()) == int((view.valid & (view.phys >= 0)).sum())

    @invariant()
    def accounting_adds_up(self):
        if not hasattr(self, "store"):
            return
        s = self.store
        mem = s.memory()
        assert mem["in_use"] == mem["payload"] + mem["metadata"] + mem["buffer"]
        assert mem["in_use"] <= mem["allocated"] <= mem["in_use"] + sum(
            s.batch_size * r.pool.bytes_per_block for r in s.regions), "more than one free block per row and region"
        assert s.live_tokens().tolist() == [len(m) for m in self.model]
        assert s.tokens_seen.tolist() == self.seen
        assert mem["full"] == sum(self.seen) * 2 * H * D * 8
        assert bool((s.buf_len < s.residual + s.group_size).all())
        bs = s.regions[0].pool.block_size
        assert s.regions[0].pool.blocks_in_use == sum(int(((r.length + bs - 1) // bs).sum()) for r in s.regions)
        for r in s.regions:  # the written range of every row holds exactly its live block tokens plus holes
            if r.has_holes:
                _, n_holes = r._holes()
                assert (r.live_tokens() + n_holes).tolist() == r.length.tolist()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)
