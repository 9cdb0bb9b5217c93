"""The share pager: reference counts under random appends, shares and evictions (hypothesis),
and sharing composed with eviction and with a quantized format."""

from collections import Counter

import pytest
import torch
from conftest import random_keep
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcompose import Policy
from kvcompose.ops.paged_attention import paged_decode_attention
from kvcompose.pagers import SharePager
from kvcompose.paging import DenseCodec, LayerStore

H, D = 2, 4


def _store(B=1, block=4, group=4, residual=0, codecs=None, refcounted=True, head_major=False):
    return LayerStore(B, H, D, torch.float64, torch.device("cpu"), block_size=block, group_size=group,
                      residual=residual, codecs=codecs or {"all": DenseCodec(torch.float64)}, refcounted=refcounted,
                      head_major=head_major)


def _kv(position: int):
    """Keys and values that name their position, so any misplaced slot shows."""
    g = torch.Generator().manual_seed(position)
    return torch.randn(H, D, generator=g, dtype=torch.float64), torch.randn(H, D, generator=g, dtype=torch.float64)


def _append(store, real):
    B, T = real.shape
    kv = [[_kv(store.columns_seen + t) for t in range(T)] for _ in range(B)]
    k = torch.stack([torch.stack([kv[b][t][0] for t in range(T)], 1) for b in range(B)])
    v = torch.stack([torch.stack([kv[b][t][1] for t in range(T)], 1) for b in range(B)])
    return store.append(k, v, real)


def _entry_positions(store, b, col):
    region = store.regions[0]
    return region.pool.meta["pos"][region.table[b, col]].tolist()


class ShareMachine(RuleBasedStateMachine):
    """Random appends (with padding), shares of sealed blocks and evictions against a model of
    each row's logical tokens (a multiset of positions; a position's keys never change)."""

    @initialize(batch=st.integers(1, 3), block=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
                residual=st.sampled_from([0, 3]), head_major=st.booleans())
    def setup(self, batch, block, group, residual, head_major):
        self.B = batch
        self.store = _store(batch, block, group, residual, head_major=head_major)
        self.pager = SharePager()
        self.model = [Counter() for _ in range(batch)]

    @rule(T=st.integers(1, 6), data=st.data())
    def append(self, T, data):
        bits = data.draw(st.lists(st.booleans(), min_size=self.B * T, max_size=self.B * T))
        real = torch.tensor(bits, dtype=torch.bool).view(self.B, T)
        positions = _append(self.store, real)
        for b in range(self.B):
            self.model[b].update(positions[b][real[b]].tolist())

    @rule(data=st.data())
    def share(self, data):
        region = self.store.regions[0]
        sealed = (region.length // region.pool.block_size).tolist()
        rows = [b for b in range(self.B) if sealed[b] >= 2]
        if not rows:
            return
        b = data.draw(st.sampled_from(rows))
        target, source = data.draw(st.lists(st.integers(0, sealed[b] - 1), min_size=2, max_size=2, unique=True))
        self.model[b].subtract(_entry_positions(self.store, b, target))
        self.model[b].update(_entry_positions(self.store, b, source))
        self.model[b] = +self.model[b]
        as_t = lambda x: torch.tensor([x])  # noqa: E731
        self.pager.share(self.store, as_t(b), as_t(target), as_t(source))

    @rule(data=st.data())
    def evict(self, data):
        view = self.store.view()
        keep = random_keep(data, view)
        for b in range(self.B):
            self.model[b].subtract(view.positions[b][view.valid[b] & ~keep[b]].tolist())
            self.model[b] = +self.model[b]
        self.pager.compact(self.store, view, keep)

    @invariant()
    @precondition(lambda self: hasattr(self, "store"))
    def logical_tokens_are_the_model(self):
        view = self.store.view()
        for b in range(self.B):
            live = view.valid[b]
            assert Counter(view.positions[b][live].tolist()) == self.model[b], "logical tokens lost or invented"
            for j in live.nonzero()[:, 0].tolist():  # every entry still reads what its position wrote
                k, v = _kv(int(view.positions[b, j]))
                assert torch.equal(view.keys[b, :, j], k) and torch.equal(view.values[b, :, j], v)

    @invariant()
    @precondition(lambda self: hasattr(self, "store"))
    def reference_counts_match_the_tables(self):
        region = self.store.regions[0]
        pool = region.pool
        used = Counter(region.table[region.table >= 0].tolist())
        free = pool._free[: pool.num_free].tolist()
        assert not set(free) & set(used), "a block is both free and referenced"
        assert len(used) + len(free) == pool.capacity, "a block leaked"
        for block in range(pool.capacity):
            assert int(pool.refs[block]) == used.get(block, 0), f"block {block}: refs {int(pool.refs[block])}"

    @invariant()
    @precondition(lambda self: hasattr(self, "store"))
    def accounting_counts_physical_blocks_once(self):
        s = self.store
        region = s.regions[0]
        pool = region.pool
        entries = int(((region.length + pool.block_size - 1) // pool.block_size).sum())
        physical = pool.blocks_in_use
        mem = s.memory()
        assert mem["payload"] == physical * pool.payload_bytes_per_block
        assert mem["saved_by_sharing"] == (entries - physical) * pool.bytes_per_block
        assert int(region.shared_entries().sum()) == entries - physical
        assert mem["in_use"] == mem["payload"] + mem["metadata"] + mem["buffer"]
        assert int(s.bytes_in_use()) == mem["in_use"]  # static decode's device count agrees


TestShareMachine = ShareMachine.TestCase
TestShareMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_evicting_from_a_shared_block_leaves_the_other_entry_whole():
    store = _store(block=4, group=4)
    _append(store, torch.ones(1, 12, dtype=torch.bool))
    pager = SharePager()
    pager.share(store, torch.tensor([0]), torch.tensor([2]), torch.tensor([0]))  # entry 2 reads block of entry 0
    pool, region = store.regions[0].pool, store.regions[0]
    shared = int(region.table[0, 0])
    assert int(pool.refs[shared]) == 2 and pool.blocks_in_use == 2
    view = store.view()
    keep = view.valid.clone()
    keep[0, 8] = False  # one token of entry 2, i.e. of the shared block
    pager.compact(store, view, keep)
    after = store.view()
    # Entry 0 still reads positions 0..3 in place; entry 2's other three tokens were copied out.
    assert _entry_positions(store, 0, 0) == [0, 1, 2, 3] and int(region.table[0, 0]) == shared
    assert int(pool.refs[shared]) == 1
    assert sorted(after.positions[0][after.valid[0]].tolist()) == [0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7]


def test_share_refuses_unsealed_and_repeated_entries():
    store = _store(block=4, group=2)
    _append(store, torch.ones(1, 10, dtype=torch.bool))  # blocks: 2 sealed, 1 partial
    pager = SharePager()
    one = lambda x: torch.tensor([x])  # noqa: E731
    with pytest.raises(ValueError, match=r"targets \[2\] must be sealed \(full\) blocks of their rows, i.e. columns below \[2\]"):
        pager.share(store, one(0), one(2), one(0))
    with pytest.raises(ValueError, match="a target entry appears twice or is also a source"):
        pager.share(store, torch.tensor([0, 0]), torch.tensor([1, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="does not count references"):
        SharePager().share(_store(refcounted=False), one(0), one(1), one(0))


def test_share_pager_refuses_several_classes_and_static_stores():
    with pytest.raises(ValueError, match="pager 'share' works on one token class"):
        Policy(pager="share", precision={"R": None, "T": "ternary"})
    with pytest.raises(ValueError, match="filter 'collaborative' decides which blocks to share, which needs pager 'share'"):
        Policy(filter="collaborative")
    store = _store()
    _append(store, torch.ones(1, 8, dtype=torch.bool))
    store.fix_capacity(16)
    with pytest.raises(ValueError, match="static decode .* is not supported; decode with fast=False"):
        SharePager().share(store, torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))


@pytest.mark.parametrize("layout", ["slot", "head"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "ternary", {"name": "int", "bits": 4}])
def test_shared_quantized_blocks_read_the_same_through_the_fused_attention(fmt, layout):
    policy = Policy(pager="share", precision={"all": fmt}, block_size=16, group_size=16, pool_layout=layout)
    store = policy.make_store(2, H, 16, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    store.append(torch.randn(2, H, 70, 16, generator=g), torch.randn(2, H, 70, 16, generator=g))
    before = store.memory()["payload"]
    policy.pager.share(store, torch.tensor([0, 0, 1]), torch.tensor([3, 2, 1]), torch.tensor([0, 1, 0]))
    assert store.memory()["payload"] == before - 3 * store.regions[0].pool.payload_bytes_per_block
    view = store.view()  # entries decoded where they point: the reference
    q = torch.randn(2, 2 * H, 1, 16, generator=g)
    group = q.shape[1] // H
    k, v = view.keys.repeat_interleave(group, 1), view.values.repeat_interleave(group, 1)
    logits = (q @ k.transpose(-1, -2)) * 0.25
    ref = logits.masked_fill(~view.valid[:, None, None, :], float("-inf")).softmax(-1) @ v
    for backend in ("torch", "triton"):
        out = paged_decode_attention(q, store.attention_sources(), 0.25, backend=backend)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # The shared entries really read the source blocks' tokens.
    assert view.positions[0, 48:64].tolist() == list(range(16)) and view.positions[0, 32:48].tolist() == list(range(16, 32))
