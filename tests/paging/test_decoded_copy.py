"""The decoded copy of quantized pools (CPU): the torch decode attention reads it instead of
decoding every slot at every step, and must give exactly what decoding the codes gives,
whatever moved the codes (flushes, eviction, compaction, static steps, deep copies)."""

import copy

import pytest
import torch

from kvcompose import Policy
from kvcompose.ops.paged_attention import decode_operand_torch, paged_decode_attention, paged_decode_attention_torch
from kvcompose.pagers import ContinuousThinkingPager, GatherPager
from kvcompose.paging import LayerStore
from kvcompose.paging.pool import DECODED
from kvcompose.quantizers.codec import QuantCodec

H, D, B = 2, 64, 3
KIVI = {"name": "int", "bits": 2, "layout": "kivi", "token_group": 16}
PRECISIONS = {
    "fp8": {"all": {"name": "fp8"}},
    "nvfp4": {"all": {"name": "nvfp4"}},
    "ternary": {"all": {"name": "ternary"}},
    "int4": {"all": {"name": "int", "bits": 4, "group_size": 32}},
    "int2": {"all": {"name": "int", "bits": 2}},
    "kivi2": {"all": KIVI},
    "kivi4": {"all": dict(KIVI, bits=4)},
    "thinkv": {"R": {"name": "nvfp4"}, "E": {"name": "nvfp4"}, "T": {"name": "ternary"}},
}
SLOT_LOCAL = [n for n in PRECISIONS if not n.startswith("kivi")]  # the formats whose tokens can move


@pytest.fixture(autouse=True)
def torch_encoders(monkeypatch):
    """Encode with the formats' torch references (bit for bit the kernels' codes; the kernels
    in Triton's CPU interpreter take seconds per call)."""
    from kvcompose.ops import dispatch, quant_fp8, quant_int, quant_int_channel

    original = dispatch.use_triton

    def torch_only(x, kernel, backend):
        return original(x, kernel, "torch" if backend is None else backend)

    for module in (dispatch, quant_fp8, quant_int, quant_int_channel):
        monkeypatch.setattr(module, "use_triton", torch_only)


def make_store(name, dtype=torch.float32, decoded_copy=None, residual=4):
    policy = Policy(precision=PRECISIONS[name], group_size=16, residual=residual)
    codecs = {c: QuantCodec(q, H, D, "cpu") for c, q in policy.precision.items()}
    return LayerStore(B, H, D, dtype, torch.device("cpu"), group_size=16, residual=residual, codecs=codecs,
                      decoded_copy=decoded_copy)


def append(store, n, seed, real=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, n, D, generator=g).to(store.dtype)
    cls = torch.randint(0, len(store.regions), (B, n), generator=g)
    store.append(k, k * 0.5 + 0.1, real, cls)


def assert_copy_is_fresh(store):
    """Every live slot holds in the copy what decoding its codes for its row gives (a dead
    slot's copy only needs to be finite: attention gives it probability 0), and the torch
    attention over the copy equals the reference over the codes, bit for bit."""
    sources = store.attention_sources()
    assert any(s.decoded is not None for s in sources)
    for src in sources:
        if src.decoded is None:
            continue
        slots = src.slots()
        named = slots >= 0
        live = (named & src.valid[slots.clamp(min=0)]).reshape(-1)
        flat = slots.reshape(-1)[live]
        rows = torch.arange(B).repeat_interleave(slots.shape[1])[live]
        for op, copied in zip((src.key, src.value), src.decoded):
            fresh = decode_operand_torch(op, flat, rows, store.dtype)
            assert torch.equal(copied[flat], fresh), "the decoded copy went stale"
            assert bool(copied[slots[named]].isfinite().all())
    g = torch.Generator().manual_seed(7)
    query = torch.randn(B, 2 * H, 1, D, generator=g).to(store.dtype)
    out, probs = paged_decode_attention(query, sources, 0.125, probs=True, backend="torch")
    ref, ref_probs = paged_decode_attention_torch(query, sources, 0.125, return_probs=True)  # decodes the codes
    assert torch.equal(out, ref) and torch.equal(probs, ref_probs)


@pytest.mark.parametrize("name", sorted(PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_gives_the_reference_through_flushes_and_padding(name, dtype):
    store = make_store(name, dtype)
    real = torch.ones(B, 40, dtype=torch.bool)
    real[1, :13] = False  # a left-padded row
    append(store, 40, 0, real)
    assert_copy_is_fresh(store)
    for step in range(40):  # one token per step: the buffer flushes a group every 16 steps
        append(store, 1, step + 1)
    assert_copy_is_fresh(store)


@pytest.mark.parametrize("name", SLOT_LOCAL)
@pytest.mark.parametrize("pager", ["gather", "ct", "ct packing"])
def test_copy_follows_eviction_and_compaction(name, pager):
    store = make_store(name)
    pager = GatherPager() if pager == "gather" else ContinuousThinkingPager(max_hole_blocks=1 if pager == "ct packing"
                                                                            else None)
    g = torch.Generator().manual_seed(1)
    append(store, 50, 0)
    for step in range(6):
        view = store.view()
        keep = view.valid & (torch.rand(view.valid.shape, generator=g) < 0.6)
        pager.compact(store, view, keep)
        assert_copy_is_fresh(store)
        append(store, 9, step + 1)  # refills holes (ct) and flushes groups into moved blocks
        assert_copy_is_fresh(store)


@pytest.mark.parametrize("name", ["nvfp4", "thinkv", "kivi2"])
def test_copy_follows_static_steps_flushes_and_compaction(name):
    store = make_store(name, residual=16)  # a buffer of whole token groups (KIVI's static flush needs it)
    append(store, 37, 0)
    store.fix_capacity(37 + 48)
    g = torch.Generator().manual_seed(2)
    for step in range(48):
        k = torch.randn(B, H, 1, D, generator=g)
        flush = bool((store.buf_len + 1 == store.buf_k.shape[1]).any())
        store.append_step(k, -k, torch.randint(0, len(store.regions), (B,), generator=g), flush)
        if step % 12 == 11 and name != "kivi2":  # KIVI key scales span token groups: no eviction
            view = store.view()
            keep = view.valid & (torch.rand(view.valid.shape, generator=g) < 0.7)
            store.compact_static(view, keep, in_place=step % 24 == 11)
        assert_copy_is_fresh(store)


@pytest.mark.parametrize("name", ["fp8", "kivi2", "thinkv"])
def test_static_steps_keep_the_copy_without_reading_the_device(name, monkeypatch):
    """What a static step adds for the copy (decoding a flushed group, reading the copy in the
    attention) has fixed shapes and no host synchronization, as graph capture needs. (The
    encoders' torch references used here do synchronize; the kernels do not.)"""
    from sync_guard import no_host_sync

    from kvcompose.paging import store_static as static_module

    decode = static_module.decoded_slots
    calls = []

    def guarded(*args):
        calls.append(1)
        with no_host_sync():
            return decode(*args)

    monkeypatch.setattr(static_module, "decoded_slots", guarded)
    store = make_store(name, residual=16)
    append(store, 37, 0)
    store.fix_capacity(37 + 20)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(B, 2 * H, 1, D, generator=g)
    calls.clear()
    for step in range(20):
        k = torch.randn(B, H, 1, D, generator=g)
        flush = bool((store.buf_len + 1 == store.buf_k.shape[1]).any())
        store.append_step(k, -k, torch.randint(0, len(store.regions), (B,), generator=g), flush)
        with no_host_sync():
            paged_decode_attention(query, store.attention_sources(), 0.125)
    assert calls  # some step flushed
    assert_copy_is_fresh(store)


def test_a_deep_copy_keeps_its_own_fresh_copy():
    store = make_store("nvfp4")
    append(store, 40, 0)
    twin = copy.deepcopy(store)
    view = store.view()
    GatherPager().compact(store, view, view.valid & (torch.arange(view.valid.shape[1]) % 3 > 0))
    append(store, 20, 1)
    assert_copy_is_fresh(store)
    assert_copy_is_fresh(twin)


def test_a_stale_copy_is_caught():
    """The freshness check above fails when codes change behind the copy's back."""
    store = make_store("nvfp4")
    append(store, 40, 0)
    pool = store.regions[0].pool
    pool.slots["k.codes"][0, 0] ^= 0x11  # the first slot's keys change, its decoded copy does not
    with pytest.raises(AssertionError, match="went stale"):
        assert_copy_is_fresh(store)


def test_the_copy_is_scratch_and_off_on_request():
    """The memory report counts the compressed store only; without the copy the torch path
    decodes the codes and gives the same output."""
    stores = [make_store("thinkv", decoded_copy=on) for on in (True, False)]
    for store in stores:
        append(store, 45, 0)
    on, off = stores
    assert all(p.decoded and p.decoded_bytes_per_block > 0 for p in on.pools.values())
    assert not any(p.decoded or set(DECODED) & set(p.slots) for p in off.pools.values())
    assert on.memory() == off.memory()
    pool = next(iter(on.pools.values()))
    assert pool.decoded_bytes_per_block == pool.block_size * 2 * H * D * 4  # keys and values in the model dtype
    query = torch.randn(B, 2 * H, 1, D)
    outs = [paged_decode_attention(query, s.attention_sources(), 0.125, backend="torch") for s in stores]
    assert torch.equal(outs[0], outs[1])


def test_full_precision_pools_and_other_query_dtypes_decode_as_before():
    store = make_store("nvfp4", dtype=torch.float32)
    append(store, 40, 0)
    dense = LayerStore(B, H, D, torch.float32, torch.device("cpu"))
    assert not any(p.decoded for p in dense.pools.values())
    source = store.attention_sources()[0]
    assert source.with_decoded(torch.float32).key.fmt == "dense"
    assert source.with_decoded(torch.bfloat16) is source  # a copy in another dtype is not the reference's values


def test_regions_sharing_a_pool_are_sources_of_their_own_bounded_by_what_they_wrote():
    """ThinKV's R and E share one NVFP4 pool. Each stays a source with its own table and its
    written length as the kernels' loop bound, so neither is read over its whole reservation;
    the kernel (interpreted) over those sources gives the reference's output."""
    store = make_store("thinkv")
    append(store, 40, seed=3)
    shared = [r for r in store.regions if r.pool is store.regions[0].pool]
    assert len(shared) == 2, "R and E should share the NVFP4 pool"
    sources = store.attention_sources()
    tables = [s.table for s in sources]
    for region in shared:
        at = [i for i, t in enumerate(tables) if t is region.table]
        assert len(at) == 1, "every region of a shared pool is one source of its own"
        assert torch.equal(sources[at[0]].extent, region.length)
    assert all(s.extent is not None for s in sources[:-1])  # the pools' sources; the buffer is last
    g = torch.Generator().manual_seed(5)
    query = torch.randn(B, 2 * H, 1, D, generator=g)
    ref = paged_decode_attention(query, sources, 0.125, backend="torch")
    out = paged_decode_attention(query, sources, 0.125, backend="triton")
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_the_attention_reads_second_level_scales_kept_up_to_date_not_computed_per_step():
    """A decode step computes no head scale: the sources carry the store's own tensors (the same
    objects at every call), which change in place when a row first encodes into a pool, and hold
    its row scale times the format's unit scale."""
    store = make_store("thinkv")
    kept = {id(t) for d in store.attention_scales.values() for t in d.values()}
    for seed in range(3):  # classes drawn at random: rows reach each pool at different appends
        append(store, 40, seed=seed)
        sources = [s for s in store.attention_sources() if s.key.head_scale is not None]
        assert sources and {id(s.key.head_scale) for s in sources} | {id(s.value.head_scale) for s in sources} <= kept
        for name, pool in store.pools.items():
            unit = {p: next(v for k, v in pool.codec.layout[role].values() if k == "head")
                    for role, p in (("key", "k"), ("value", "v"))}
            for prefix, scales in store.attention_scales[name].items():
                torch.testing.assert_close(scales, store.row_scales[name][prefix] * unit[prefix])
    assert all(bool(t.gt(0).all()) for d in store.attention_scales.values() for t in d.values())


@pytest.mark.parametrize("name", [*PRECISIONS, "dense"])
@pytest.mark.parametrize("tokens", [3, 40])  # all in the buffer (no region has blocks yet), then in blocks
def test_a_keys_only_view_is_the_full_views_keys_without_reading_values(name, tokens, monkeypatch):
    """What evictors and classifiers read (``view(values=False)``): the same keys and slot
    state as the full view, no values, and no value payload gathered or decoded."""
    store = LayerStore(B, H, D, torch.float32, torch.device("cpu"), group_size=16, residual=4) if name == "dense" \
        else make_store(name)
    append(store, tokens, seed=3)
    full = store.view()
    for region in store.regions:  # any read of a value tensor now fails
        pool = region.pool
        for tensors in (pool.slots, pool.blocks):
            for key in [k for k in tensors if k not in pool.codec.key_tensors(list(tensors))]:
                monkeypatch.setitem(tensors, key, None)
    keys_only = store.view(values=False)
    assert keys_only.values is None
    for field in ("keys", "positions", "valid", "region", "phys", "classes"):
        assert torch.equal(getattr(keys_only, field), getattr(full, field)), field
    assert keys_only.block_columns == full.block_columns
