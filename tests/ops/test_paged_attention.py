"""The fused paged decode attention: kernel vs torch reference, store integration, end-to-end parity."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import greedy, left_padded, tiny_model
from kvcompose import Policy, registry
from kvcompose.ops.paged_attention import (
    EXACT_FORMATS,
    KVOperand,
    PagedSource,
    bytes_read,
    head_major,
    kernels,
    launch,
    paged_decode_attention,
    paged_decode_attention_torch,
)
from kvcompose.ops.paged_attention.launch import fewest_waves

FORMATS = ["dense", "fp8", "nvfp4", "ternary", "int", "int_channel"]
TWO_WARP_SHAPE = (64, 2)  # a launch shape other than the default (tokens per tile, warps)
UNIT = {"fp8": 1 / 448, "nvfp4": 1 / (6 * 448), "ternary": 1 / 448}  # per-head scale of amax 1


def block_table(lengths, bs, holes, g):
    """A shuffled block table for rows of the given lengths, and the per-slot validity."""
    B, W = len(lengths), max(1, max(-(-n // bs) for n in lengths))
    perm = torch.randperm(B * W, generator=g)
    table = torch.full((B, W), -1, dtype=torch.long)
    valid = torch.zeros(B * W * bs, dtype=torch.bool)
    row_of = torch.zeros(B * W * bs, dtype=torch.long)
    for b, n in enumerate(lengths):
        used = -(-n // bs)
        table[b, :used] = perm[b * W: b * W + used]
        t = torch.arange(n)
        slots = table[b, t // bs] * bs + t % bs
        valid[slots] = True
        if holes:  # the ct pager's in-place evictions: every third token gone
            valid[slots[::3]] = False
        for blk in table[b, :used]:
            row_of[blk * bs: (blk + 1) * bs] = b
    return table, valid, row_of


def operand(fmt, x, row_of, B, role, g):
    """``x`` ``[slots, H, D]`` in storage format ``fmt``, with a random per-row head scale where it has one.

    Quantized by the torch references (as on a GPU run, where these CPU tensors never reach the
    quantize kernels): the interpreted kernels took most of these tests' time, and test_quant_*
    checks that they agree with the references."""
    H = x.shape[1]
    if fmt == "dense":
        return KVOperand("dense", x)
    if fmt in UNIT:
        hs = (torch.rand(B, H, generator=g) * 4 + 2) * UNIT[fmt]
        p = registry.build("quantizer", fmt).quantize(x, head_scale=hs[row_of], backend="torch")
        return KVOperand(fmt, p.codes, scale=getattr(p, "block_scales", None), head_scale=hs)
    if fmt.startswith("kivi"):  # "kivi2", "kivi4": keys per channel over 32 slots, values per token over the head
        bits = int(fmt[-1])
        spec = {"name": "int", "bits": bits, "layout": "kivi", "token_group": 32}
        p = registry.build("quantizer", spec).quantize(x, role=role, backend="torch")
        if role == "key":
            return KVOperand("int_channel", p.codes, p.scale, p.minimum, bits=bits, token_group=32)
        return KVOperand("int", p.codes, p.scale, p.minimum, bits=bits)
    if fmt in ("int", "int2") or role == "value":  # "int": INT4, "int2": INT2, both in groups of 32 channels
        bits = 2 if fmt == "int2" else 4
        p = registry.build("quantizer", {"name": "int", "bits": bits, "group_size": 32}).quantize(x, backend="torch")
        return KVOperand("int", p.codes, p.scale, p.minimum, bits=bits)
    p = registry.build("quantizer", {"name": "int", "bits": 2, "layout": "kivi", "token_group": 16}).quantize(
        x, role="key", backend="torch")
    return KVOperand("int_channel", p.codes, p.scale, p.minimum, bits=2, token_group=16)


def make_source(fmt, lengths, H, D, dtype=torch.bfloat16, bs=None, holes=False, seed=0, device="cpu"):
    """A pool of ``fmt`` keys and values in ``bs``-slot blocks (16; KIVI: 32-slot blocks, one token group
    each, head-major as the store keeps them)."""
    kivi = fmt.startswith("kivi")
    bs = bs or (32 if kivi else 16)
    g = torch.Generator().manual_seed(seed)
    table, valid, row_of = block_table(lengths, bs, holes, g)
    n = valid.numel()
    k = torch.randn(n, H, D, generator=g).to(dtype)
    v = torch.randn(n, H, D, generator=g).to(dtype)
    src = PagedSource(operand(fmt, k, row_of, len(lengths), "key", g),
                      operand(fmt, v, row_of, len(lengths), "value", g), table, bs, valid)
    return to_device(head_major(src) if kivi else src, device)


def to_device(src, device):
    def op(o):
        move = (lambda t: None if t is None else t.to(device))
        return KVOperand(o.fmt, move(o.codes), move(o.scale), move(o.minimum), move(o.head_scale), o.bits,
                         o.token_group)
    return PagedSource(op(src.key), op(src.value), src.table.to(device), src.block_size, src.valid.to(device))


def check_close(query, sources, backend="triton", scaling=0.1):
    out, probs = paged_decode_attention(query, sources, scaling, probs=True, backend=backend)
    ref, ref_probs = paged_decode_attention_torch(query, sources, scaling, return_probs=True)
    assert out.dtype == query.dtype and out.shape == query.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[query.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # the reference rounds each decoded key to the query dtype, the kernel may not (EXACT_FORMATS)
    torch.testing.assert_close(probs, ref_probs, atol=tol / 16, rtol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128)])
def test_kernel_matches_reference_every_format(fmt, group, head_dim):
    H = 2
    src = make_source(fmt, [37, 0, 70], H, head_dim, seed=group)  # rows of different lengths, one empty
    query = torch.randn(3, H * group, 1, head_dim).to(torch.bfloat16)
    check_close(query, [src])


def with_extent(src, extent):
    return PagedSource(src.key, src.value, src.table, src.block_size, src.valid,
                       extent=torch.as_tensor(extent, device=src.table.device))


def check_extent(query, sources, lengths, scaling=0.1, backend="triton"):
    """With each row's extent, the kernel gives the reference's output; with the last 5 columns
    of the longest row cut off by its extent, the reference's output without those slots."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[query.dtype]
    bounded = [with_extent(sources[0], lengths)] + sources[1:]
    out = paged_decode_attention(query, bounded, scaling, backend=backend)
    torch.testing.assert_close(out.float(), paged_decode_attention_torch(query, sources, scaling).float(),
                               atol=tol, rtol=tol)
    row = max(range(len(lengths)), key=lambda b: lengths[b])
    cut = list(lengths)
    cut[row] -= 5
    src = sources[0]
    slots = src.slots()[row, cut[row]:lengths[row]]
    valid = src.valid.clone()
    valid[slots] = False
    without = PagedSource(src.key, src.value, src.table, src.block_size, valid)
    out = paged_decode_attention(query, [with_extent(src, cut)] + sources[1:], scaling, backend=backend)
    ref = paged_decode_attention_torch(query, [without] + sources[1:], scaling)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "int_channel"])
def test_extent_bounds_each_rows_loop(fmt):
    """Static decode reserves capacity; the kernel reads each row only up to its live extent."""
    lengths = [37, 0, 70]
    src = make_source(fmt, lengths, 2, 64, seed=5)
    buffer = make_source("dense", [5, 0, 15], 2, 64, bs=15, seed=6)
    check_extent(torch.randn(3, 8, 1, 64).to(torch.bfloat16), [src, buffer], lengths)


# groups under both tile heights, over one of them only, and over both; a block of one group or of several
@pytest.mark.parametrize("token_group,bs", [(8, 16), (32, 128), (64, 64)])
def test_kivi_keys_with_and_without_scales_in_the_queries(token_group, bs, monkeypatch):
    """KIVI keys whose tile lies in one token group are scored with the group scale in the
    queries; tiles longer than the group decode every key. Both match the reference."""
    g = torch.Generator().manual_seed(token_group)
    lengths = [70, 0, 33, 129]
    table, valid, row_of = block_table(lengths, bs, True, g)
    k, v = torch.randn(2, valid.numel(), 2, 64, generator=g).to(torch.bfloat16)
    quantizer = {"name": "int", "bits": 2, "layout": "kivi", "token_group": token_group}
    p = registry.build("quantizer", quantizer).quantize(k, role="key", backend="torch")  # see operand()
    key = KVOperand("int_channel", p.codes, p.scale, p.minimum, bits=2, token_group=token_group)
    src = PagedSource(key, operand("int", v, row_of, len(lengths), "value", g), table, bs, valid)
    query = torch.randn(len(lengths), 8, 1, 64).to(torch.bfloat16)
    for shape in (TWO_WARP_SHAPE, launch.TILE_SHAPE):
        monkeypatch.setattr(launch, "TILE_SHAPE", shape)
        assert source_constants(query, src)["KFOLD"] == (shape[0] <= token_group)
        check_close(query, [src])
    check_close(query, [head_major(src)])  # the codes' rows by head, the group scales as they are
    assert not source_constants(query.half(), src)["KFOLD"]  # q * scale could overflow fp16


@pytest.mark.parametrize("value_group", [None, 32])
def test_kivi2_values_over_the_head_or_in_groups_of_32_channels(value_group):
    """KIVI-2 as the preset stores it (2-bit values, one scale and minimum over the whole head)
    and as KIVI's code groups values (32 channels): the kernel matches the reference."""
    g = torch.Generator().manual_seed(7)
    lengths = [40, 0, 75]
    table, valid, row_of = block_table(lengths, 32, False, g)
    k, v = torch.randn(2, valid.numel(), 2, 64, generator=g).to(torch.bfloat16)
    keys = registry.build("quantizer", {"name": "int", "bits": 2, "layout": "kivi", "token_group": 32})
    p = keys.quantize(k, role="key", backend="torch")  # see operand()
    key = KVOperand("int_channel", p.codes, p.scale, p.minimum, bits=2, token_group=32)
    values = registry.build("quantizer", {"name": "int", "bits": 2, "group_size": value_group})
    q = values.quantize(v, backend="torch")
    assert q.scale.shape[-1] == (1 if value_group is None else 64 // value_group)
    src = PagedSource(key, KVOperand("int", q.codes, q.scale, q.minimum, bits=2), table, 32, valid)
    check_close(torch.randn(len(lengths), 8, 1, 64).to(torch.bfloat16), [src])


def source_constants(query, src) -> dict:
    """The compile-time constants the launcher picks for one source."""
    return dict(zip(launch.SOURCE_CONSTS, launch._partial_launch(query, [src], False)[1]["CONSTS"][0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference_other_dtypes(dtype):
    src = make_source("nvfp4", [20, 45], 2, 64, dtype=dtype, holes=True)
    check_close(torch.randn(2, 4, 1, 64).to(dtype), [src])


def test_mixed_formats_holes_and_buffer_in_one_call(monkeypatch):
    """ThinKV's layout: an NVFP4 pool (R and E), a ternary pool (T) with holes, the bf16 buffer;
    all three in one partial launch (then one merge)."""
    launches = count_launches(monkeypatch, kernels._paged_partial_kernel, kernels._merge_kernel)
    lengths = [50, 3, 90]
    sources = [make_source("nvfp4", lengths, 2, 64, seed=1), make_source("ternary", lengths, 2, 64, holes=True, seed=2),
               make_source("dense", [5, 0, 15], 2, 64, bs=15, seed=3)]
    check_close(torch.randn(3, 8, 1, 64).to(torch.bfloat16), sources)
    assert launches == {"_paged_partial_kernel": 1, "_merge_kernel": 1}


def test_regions_of_one_pool_count_its_bytes_once():
    """ThinKV's R and E are regions of one pool: reading both reads the pool once."""
    src = make_source("nvfp4", [64, 48], 2, 64)
    query = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    halves = [dataclasses.replace(src, table=src.table[:, a:b].contiguous()) for a, b in ((0, 2), (2, 4))]
    assert src.table.shape[1] == 4
    assert bytes_read(halves, query) == bytes_read([src], query)
    assert bytes_read([src, src], query) == bytes_read([src], query)


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
def test_groups_wider_than_sixteen_query_heads(fmt):
    """Multi-query layouts (24 query heads on one KV head): every head of the group gets a row
    of the query tile, the dense buffer's launch included."""
    sources = [make_source(fmt, [40, 70], 1, 64, seed=4), make_source("dense", [5, 9], 1, 64, bs=15, seed=5)]
    check_close(torch.randn(2, 24, 1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16), sources)
    check_close(torch.randn(2, 24, 1, 64).to(torch.bfloat16), sources[1:])  # the buffer alone


@pytest.mark.parametrize("fmt,group,dtype", [("dense", 1, torch.bfloat16), ("int", 4, torch.float32),
                                              ("nvfp4", 7, torch.float16), ("nvfp4", 24, torch.bfloat16)])
def test_the_merge_launch_computes_the_buffer_itself(fmt, group, dtype, monkeypatch):
    """Where the long sources run in a launch of their own (the CUDA kernel's), the merge launch
    computes the short ones (the recent buffer, its extent, an empty row) before merging: the
    reference's attention, and the default path's, in one launch less. The long source's 300
    columns take two splits, so the merge pads its partial results to a power of two."""
    launches = count_launches(monkeypatch, kernels._paged_partial_kernel, kernels._merge_kernel,
                              kernels._rider_merge_kernel)
    src = make_source(fmt, [300, 0, 90], 2, 64, dtype=dtype, holes=True, seed=7)
    buffer = make_source("dense", [5, 0, 15], 2, 64, dtype=dtype, bs=15, seed=8)
    cut = with_extent(buffer, [5, 0, 10])  # the extent leaves row 2's last 5 written slots out
    valid = buffer.valid.clone()
    valid[buffer.slots()[2, 10:15]] = False
    without = PagedSource(buffer.key, buffer.value, buffer.table, buffer.block_size, valid)
    query = torch.randn(3, 2 * group, 1, 64, generator=torch.Generator().manual_seed(group)).to(dtype)
    default = paged_decode_attention(query, [src, cut], 0.1, backend="triton")
    assert launches == {"_paged_partial_kernel": 1, "_merge_kernel": 1}
    monkeypatch.setattr(launch, "RIDERS_IN_MERGE", "always")
    out = paged_decode_attention(query, [src, cut], 0.1, backend="triton")
    assert launches == {"_paged_partial_kernel": 2, "_merge_kernel": 1, "_rider_merge_kernel": 1}
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    ref = paged_decode_attention_torch(query, [src, without], 0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), default.float(), atol=tol, rtol=0)  # the merge's sum order only
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the empty row: zeros, no NaN


def test_short_sources_move_to_the_merge_only_beside_another_launch(monkeypatch):
    long, short = make_source("dense", [70], 1, 64), make_source("dense", [5], 1, 64, bs=15)
    assert launch.merge_riders([long, short], 0, False) == []  # the buffer rides on the long source's program
    assert launch.merge_riders([short], 3, False) == [0]  # beside the CUDA kernel's partials
    assert launch.merge_riders([short], 3, True) == []  # scores are written by the partial kernel only
    assert launch.merge_riders([long, short], 3, False) == []  # long Triton sources beside the CUDA kernel's
    most = launch.RIDER_MERGE_MAX_HEADS  # larger batches: the buffer gets a partial launch of its own
    assert launch.merge_riders([short], 3, False, most) == [0]
    assert launch.merge_riders([short], 3, False, most + 1) == []
    monkeypatch.setattr(launch, "RIDERS_IN_MERGE", "always")
    assert launch.merge_riders([long, short], 0, False, most + 1) == [1]  # as asked, at any size
    assert launch.merge_riders([short], 3, False, most + 1) == [0]
    assert launch.merge_riders([long, short], 0, False) == [1] and launch.merge_riders([short], 0, False) == []
    monkeypatch.setattr(launch, "RIDERS_IN_MERGE", "never")
    assert launch.merge_riders([short], 3, False) == []


@pytest.mark.parametrize("width", [64, 16])
def test_merge_by_whole_rows_or_channel_slices(width, monkeypatch):
    """The merge takes a whole row's channels per program, or slices of them: the same attention."""
    monkeypatch.setattr(launch, "merge_width", lambda pairs, D, device: width)
    src = make_source("nvfp4", [50, 3, 90], 2, 64, holes=True, seed=6)
    check_close(torch.randn(3, 8, 1, 64).to(torch.bfloat16), [src])


def test_merge_slices_only_where_few_pairs_would_idle_a_gpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert launch.merge_width(32, 128, cuda) == launch.MERGE_SLICE < 128
    assert launch.merge_width(launch.MERGE_ROWS, 128, cuda) == 128
    assert launch.merge_width(32, 128, cpu) == 128  # the interpreter pays per program
    assert launch.merge_width(32, 16, cuda) == 16


def count_launches(monkeypatch, *kernels) -> dict:
    """Launches of each interpreted kernel from now on, by name (filled in as they run)."""
    counts = {}
    for kernel in kernels:
        def run(*args, _run=kernel.run, _name=kernel.fn.__name__, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _run(*args, **kwargs)
        monkeypatch.setattr(kernel, "run", run)
    return counts


@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "int_channel"])
def test_two_warp_tiles_match_reference(fmt, monkeypatch):
    """The kernel also runs 64-token tiles on two warps (what the launch-shape sweep compares): same attention."""
    monkeypatch.setattr(launch, "TILE_SHAPE", TWO_WARP_SHAPE)
    lengths = [50, 3, 90]
    sources = [make_source(fmt, lengths, 2, 64, holes=True, seed=5), make_source("dense", [5, 0, 15], 2, 64, bs=15)]
    query = torch.randn(3, 8, 1, 64).to(torch.bfloat16)
    check_close(query, sources)
    check_mass(query, sources)


def check_mass(query, sources, backend="triton", weight=None):
    """The kernel's attention mass (added to per-slot channels) equals the reference's."""
    weight = torch.ones(query.shape[0], device=query.device) if weight is None else weight
    start = [torch.rand(s.valid.shape, generator=torch.Generator().manual_seed(i)).to(query.device)
             for i, s in enumerate(sources)]
    got, want = [c.clone() for c in start], [c.clone() for c in start]
    out = paged_decode_attention(query, sources, 0.1, mass=(got, weight), backend=backend)
    ref = paged_decode_attention_torch(query, sources, 0.1, mass=(want, weight))
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)
    for g, w, s0, src in zip(got, want, start, sources):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1.6e-2)  # as the probabilities (check_close)
        assert torch.equal(g[~src.valid], s0[~src.valid]), "an empty or evicted slot gained mass"
    return got, start


def test_attention_mass_is_added_where_the_slots_lie():
    """h2o's per-slot accumulation from the kernel: mixed formats, holes, a buffer, a padding row
    (weight 0 adds nothing) and an empty row."""
    lengths = [50, 3, 90, 0]
    sources = [make_source("nvfp4", lengths, 2, 64, seed=1), make_source("dense", lengths, 2, 64, holes=True, seed=2),
               make_source("dense", [5, 0, 15, 0], 2, 64, bs=15, seed=3)]
    query = torch.randn(4, 8, 1, 64).to(torch.bfloat16)
    got, start = check_mass(query, sources, weight=torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def row_total(b):  # the mass a row gained over all its slots: its probabilities sum to one
        return float(sum((g - s0)[src.slots()[b][src.slots()[b] >= 0]].sum() for g, s0, src in zip(got, start, sources)))

    total = [row_total(b) for b in range(4)]
    assert total[0] == pytest.approx(1.0, abs=1e-4) and total[2] == pytest.approx(1.0, abs=1e-4)
    assert total[1] == 0.0 and total[3] == 0.0  # padding row, empty row


def test_attention_mass_argument_is_checked():
    src = make_source("dense", [4], 2, 64)
    query = torch.randn(1, 4, 1, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="mass: 0 channels for 1 sources"):
        paged_decode_attention(query, [src], 0.1, mass=([], torch.ones(1)))
    with pytest.raises(ValueError, match=r"mass channel 0: torch.float64 of shape \(16,\); expected float32"):
        paged_decode_attention(query, [src], 0.1, mass=([torch.zeros(16, dtype=torch.float64)], torch.ones(1)))
    with pytest.raises(ValueError, match=r"mass weight of shape \(2,\); expected \(1,\)"):
        paged_decode_attention(query, [src], 0.1, mass=([torch.zeros(16)], torch.ones(2)))


def test_empty_rows_give_zeros_and_no_nan():
    src = make_source("fp8", [0, 33], 2, 64)
    out = paged_decode_attention(torch.randn(2, 4, 1, 64).to(torch.bfloat16), [src], 0.1, backend="triton")
    assert torch.isfinite(out.float()).all() and (out[0] == 0).all()


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="unknown KV storage format 'fp6'"):
        KVOperand("fp6", torch.zeros(1, 1, 1))
    with pytest.raises(ValueError, match="nvfp4 operand needs scale, head_scale"):
        KVOperand("nvfp4", torch.zeros(1, 1, 1, dtype=torch.uint8))
    src = make_source("dense", [4], 2, 64)
    with pytest.raises(ValueError, match=r"one query per row \[B, Hq, 1, D\]"):
        paged_decode_attention(torch.randn(1, 4, 2, 64).to(torch.bfloat16), [src], 0.1)
    with pytest.raises(ValueError, match="do not fit queries of shape"):
        paged_decode_attention(torch.randn(1, 4, 1, 32).to(torch.bfloat16), [src], 0.1)
    with pytest.raises(ValueError, match="differs from the query dtype"):
        paged_decode_attention(torch.randn(1, 4, 1, 64), [src], 0.1)
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        paged_decode_attention(torch.randn(1, 4, 1, 64).to(torch.bfloat16), [src], 0.1, backend="flash")


# ----------------------------------------------------------------- the store


@pytest.mark.parametrize("precision", [None, {"all": {"name": "fp8"}}, {"all": {"name": "int", "bits": 2,
                                                                                "layout": "kivi", "token_group": 16}},
                                       {"R": {"name": "nvfp4"}, "T": {"name": "ternary"}}])
def test_store_sources_equal_the_dense_view(precision):
    """The op over the store's sources gives what SDPA over the store's dense view gives."""
    policy = Policy(precision=precision, group_size=16, residual=4)
    store = policy.make_store(2, 2, 64, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for step, n in enumerate([40, 1, 1, 17, 1]):
        kv = torch.randn(2, 2, n, 64, generator=g).to(torch.bfloat16)
        cls = torch.full((2, n), step % len(policy.classes))
        real = torch.ones(2, n, dtype=torch.bool)
        real[1, : n // 2] = False  # padding in row 1
        store.append(kv, kv * 0.5, real, cls)
    query = torch.randn(2, 4, 1, 64, generator=g).to(torch.bfloat16)
    view = store.view()
    dense = F.scaled_dot_product_attention(query.float(), view.keys.float(), view.values.float(),
                                           attn_mask=view.valid[:, None, None, :], scale=0.1, enable_gqa=True)
    sources = store.attention_sources()
    for backend in ("torch", "triton"):
        out = paged_decode_attention(query, sources, 0.1, backend=backend)
        torch.testing.assert_close(out.float(), dense, atol=1.6e-2, rtol=1.6e-2)
    stored, _ = store.counts()
    assert stored.tolist() == view.valid.sum(1).tolist()


# ------------------------------------------------------------ end to end


PRESETS = {"fullkv": {}, "snapkv": {"budget": 48}, "h2o": {"budget": 48}, "rkv": {"budget": 48},
           "streamingllm": {"budget": 48}, "nvfp4": {}, "kivi2": {"residual": 32},
           "thinkv": {"budget": 64, "refresh": 16}}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fused_decode_gives_the_eager_tokens(llama, name):
    """Every preset: the fused decode path (CPU: its torch reference) emits the dense path's tokens."""
    policy = Policy.from_preset(name, **PRESETS[name])
    _, ids, mask = left_padded([12, 30, 21])
    fused = greedy(llama, ids, mask, 60, cache=policy.make_cache(llama))
    eager = greedy(llama, ids, mask, 60, cache=policy.make_cache(llama, fused_attention=False))
    assert torch.equal(fused, eager)


def test_h2o_accumulates_the_same_attention_through_the_kernel(llama):
    policy = Policy.from_preset("h2o", budget=40)
    _, ids, mask = left_padded([9, 17])
    caches = [policy.make_cache(llama), policy.make_cache(llama, fused_attention=False)]
    caches[0].attention_backend = "triton"  # the interpreted kernel writes the probabilities
    outs = [greedy(llama, ids, mask, 30, cache=c) for c in caches]
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*(c.views() for c in caches)):
        acc = [c.layers[0].store.channel("acc", v) for c, v in zip(caches, (a, b))]
        torch.testing.assert_close(acc[0], acc[1], atol=1e-4, rtol=1e-4)
        break


def test_interpreted_kernel_in_a_model_gives_the_eager_tokens():
    model = tiny_model(kv_heads=1, heads=4)  # GQA group 4
    policy = Policy.from_preset("thinkv", budget=64, refresh=16)
    _, ids, mask = left_padded([10, 23])
    cache = policy.make_cache(model)
    cache.attention_backend = "triton"
    fused = greedy(model, ids, mask, 24, cache=cache)
    eager = greedy(model, ids, mask, 24, cache=policy.make_cache(model, fused_attention=False))
    assert torch.equal(fused, eager)


@pytest.mark.parametrize("rows,tokens,slots,block,expected", [
    (128, 8192, 528, 64, 4),  # 16 rows x 8 KV heads on 132 SMs x 4: one full wave, not 1.2 waves
    (8, 32768, 528, 64, 64),  # batch 1: 512 of the 528 slots busy, 8 tiles each
    (512, 4096, 528, 64, 1),  # already one wave without splitting
    (2048, 1024, 528, 64, 1),
    (128, 8192, 1320, 32, 10),  # the one-warp shape: 10 programs per SM
    (64, 32768, 1584, 32, 24),  # not 99 splits in 4 waves for a 2% rounding gain
    (32, 65536, 660, 64, 20),
])
def test_splits_fill_whole_waves(rows, tokens, slots, block, expected):
    most = -(-tokens // 256)
    splits = fewest_waves(rows, tokens, slots, most, block)
    assert splits == expected

    def cost(s):
        return -(-rows * s // slots) * -(-(-(-tokens // s)) // block)
    best = min(cost(s) for s in range(1, most + 1))
    assert cost(splits) <= best * 1.05 and all(cost(s) > best * 1.05 for s in range(1, splits))


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_split_plan_reads_the_compiled_kernel(monkeypatch):
    src = make_source("nvfp4", [4096] * 2, 8, 128, device="cuda")
    query = torch.zeros(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    for shape in (TWO_WARP_SHAPE, launch.TILE_SHAPE):
        monkeypatch.setattr(launch, "TILE_SHAPE", shape)
        variant = launch._partial_launch(query, [src], False)
        resident = launch._resident(query, variant, src.tokens)
        assert 1 <= resident <= 32 and resident == launch._resident(query, variant, src.tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 128)])
def test_cuda_kernel_matches_reference(fmt, group, head_dim):
    lengths = [1, 0, 3000, 700, 16, 4097]
    src = make_source(fmt, lengths, 8 // group if group > 1 else 4, head_dim, holes=fmt == "ternary", device="cuda")
    H = src.key.codes.shape[1]
    query = torch.randn(len(lengths), H * group, 1, head_dim, device="cuda").to(torch.bfloat16)
    check_close(query, [src])
    buffer = make_source("dense", [5, 0, 15, 1, 0, 15], H, head_dim, bs=15, seed=9, device="cuda")
    check_close(query, [src, make_source("ternary", lengths, H, head_dim, holes=True, seed=4, device="cuda"), buffer])
    check_mass(query, [src, buffer])
    check_extent(query, [src, buffer], lengths)


def check_fp16_tiles(fmt, dtype, magnitude, device):
    lengths = [300, 0, 1000] if device == "cuda" else [40, 0, 70]
    src = make_source(fmt, lengths, 2, 128 if device == "cuda" else 64, dtype=dtype, seed=3, device=device)
    query = (torch.randn(len(lengths), 8, 1, src.key.head_dim(), device=device) * magnitude).to(dtype)
    check_close(query, [src], scaling=0.1 / magnitude)


QUERY_CASES = [(torch.float16, 1.0), (torch.bfloat16, 1.0e5), (torch.bfloat16, 1e-3)]


@pytest.mark.parametrize("fmt", EXACT_FORMATS)
@pytest.mark.parametrize("dtype,magnitude", QUERY_CASES)
def test_fp16_tiles_keep_any_query(fmt, dtype, magnitude):
    """The exact formats go to the tensor cores in fp16: fp16 models, and bf16 queries far
    from 1 (shifted by a power of two into fp16's range) give the reference's attention."""
    check_fp16_tiles(fmt, dtype, magnitude, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", EXACT_FORMATS)
@pytest.mark.parametrize("dtype,magnitude", QUERY_CASES)
def test_cuda_fp16_tiles_keep_any_query(fmt, dtype, magnitude):
    check_fp16_tiles(fmt, dtype, magnitude, "cuda")


def test_phase_timer_reports_the_cache_phases(llama):
    policy = Policy.from_preset("snapkv", budget=40)
    _, ids, mask = left_padded([20, 8])
    cache = policy.make_cache(llama)
    cache.time_phases()
    greedy(llama, ids, mask, 40, cache=cache)
    seconds = cache.report().time_s
    assert set(seconds) == {"attention", "eviction"} and all(v > 0 for v in seconds.values())
    untimed = policy.make_cache(llama)
    greedy(llama, ids, mask, 4, cache=untimed)
    assert untimed.report().time_s is None


def test_a_format_without_attention_support_is_named():
    from kvcompose.paging.codec import SlotCodec
    from kvcompose.quantizers.base import Quantizer

    with pytest.raises(TypeError, match="Quantizer does not define attention_format"):
        Quantizer().attention_format("key")
    with pytest.raises(TypeError, match="SlotCodec .* does not define kv_operands"):
        SlotCodec().kv_operands({}, {}, {})
