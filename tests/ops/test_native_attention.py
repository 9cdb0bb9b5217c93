"""The CUDA decode kernel of NVFP4, ternary, INT4, INT2 and KIVI pools (ops.paged_attention.native): when it
runs, and that it agrees with the reference."""

import dataclasses
import logging

import pytest
import torch

from kvcompose.ops.paged_attention import head_major, native, paged_decode_attention, paged_decode_attention_torch
from kvcompose import Policy, registry
from kvcompose.ops.paged_attention import KVOperand, PagedSource
from kvcompose.ops.paged_attention.formats import to_head_major
from kvcompose.ops.paged_attention.launch import _native_plans, native_groups

from test_paged_attention import block_table, check_extent, make_source, operand, to_device


#: test format ("int": INT4 in groups of 32) -> (the kernel's name for it, head dims it takes, another format)
KERNEL_FORMATS = {"nvfp4": ("nvfp4", (64, 128), "ternary"), "ternary": ("ternary", (128,), "nvfp4"),
                  "int": ("int4", (64, 128), "int2"), "int2": ("int2", (128,), "int"),
                  "kivi4": ("kivi4", (64, 128), "kivi2"), "kivi2": ("kivi2", (128,), "kivi4")}


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_native_kernel_takes_each_format_at_its_head_dims_for_keys_and_values_alike(fmt):
    name, dims, other = KERNEL_FORMATS[fmt]
    for D in (64, 128):  # 64: a ternary or INT2 value eighth would be half a code word
        query = torch.zeros(2, 8, 1, D, dtype=torch.bfloat16)
        src = make_source(fmt, [20, 3], 2, D)
        assert native.kernel_format(src) == name and native.fits(query, src) == (D in dims)
    mixed = make_source(fmt, [20, 3], 2, 128)
    mixed.value = make_source(other, [20, 3], 2, 128).value
    assert not native.fits(torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16), mixed)  # keys and values of one format


def test_native_kernel_takes_only_the_pools_it_was_written_for():
    query = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
    assert not native.fits(query, make_source("fp8", [20, 3], 2, 128))
    assert not native.fits(query.float(), make_source("nvfp4", [20, 3], 2, 128))
    assert not native.fits(torch.zeros(2, 8, 1, 32, dtype=torch.bfloat16), make_source("nvfp4", [20, 3], 2, 32))
    assert not native.fits(torch.zeros(2, 32, 1, 128, dtype=torch.bfloat16), make_source("nvfp4", [20, 3], 2, 128))
    assert native.fits(query, make_source("nvfp4", [20, 3], 2, 128, bs=32))
    assert not native.fits(query, make_source("nvfp4", [20, 3], 2, 128, bs=12))  # the kernel shifts by the block size
    assert native.fits(query, head_major(make_source("nvfp4", [20, 3], 2, 128)))
    odd = make_source("nvfp4", [20, 3], 2, 128)
    odd.key.codes = to_head_major(odd.key.codes)  # keys head-major, values not
    assert not native.fits(query, odd)


def int_source(bits, group_size=32, scale_dtype="float16", D=128, kivi_keys=False):
    """A pool of INT-k keys and values (KIVI: keys per channel)."""
    src = make_source("int", [20, 3], 2, D)
    x = torch.randn(src.valid.numel(), 2, D)
    spec = {"name": "int", "bits": bits, "group_size": group_size, "scale_dtype": scale_dtype}
    p = registry.build("quantizer", spec).quantize(x, backend="torch")
    src.key = src.value = KVOperand("int", p.codes, p.scale, p.minimum, bits=bits)
    if kivi_keys:
        src.key = make_source("int_channel", [20, 3], 2, D).key
    return src


def test_native_kernel_takes_int4_and_int2_in_groups_of_32_with_fp16_scales():
    query = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
    assert native.fits(query, head_major(make_source("int2", [20, 3], 2, 128)))
    assert native.kernel_format(int_source(4)) == "int4" and native.kernel_format(int_source(2)) == "int2"
    assert native.fits(query, int_source(4)) and native.fits(query, int_source(2))
    assert not native.fits(query, int_source(8))  # INT8: not compiled
    assert not native.fits(query, int_source(4, group_size=64))  # one scale per 32 channels only
    assert not native.fits(query, int_source(4, group_size=None))
    assert not native.fits(query, int_source(4, scale_dtype="float32"))
    assert not native.fits(query, int_source(2, kivi_keys=True))  # KIVI keys: scales per channel


def test_native_kernel_takes_kivi_pools_whose_tiles_are_one_token_group():
    query = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
    src = make_source("kivi2", [40, 3], 2, 128)
    assert native.fits(query, src)
    assert native.fits(query, make_source("kivi2", [40, 3], 2, 128, bs=64))
    assert not native.fits(query, dataclasses.replace(src, block_size=16))  # a tile would span two blocks
    slot_major = make_source("int_channel", [40, 3], 2, 128)  # keys in token groups of 16
    assert native.kernel_format(slot_major) is None
    rows = dataclasses.replace(src, value=dataclasses.replace(src.value, scale=src.value.scale.contiguous(),
                                                              minimum=src.value.minimum.contiguous()))
    assert native.kernel_format(rows) == "kivi2" and not native.fits(query, rows)  # value scales 2 slots apart
    wide = dataclasses.replace(src, key=dataclasses.replace(src.key, scale=src.key.scale.float()))
    assert native.kernel_format(wide) is None  # fp32 key scales
    short = dataclasses.replace(src, key=dataclasses.replace(src.key, scale=src.key.scale[:1],
                                                             minimum=src.key.minimum[:1]))
    assert not native.fits(query, short)  # fewer key scale rows than the pool's token groups


@pytest.mark.parametrize("preset,fmt", [("kivi2", "kivi2"), ("kivi4", "kivi4"), ("thinkv-int", "int4")])
def test_preset_stores_keep_pools_the_cuda_kernel_takes(preset, fmt):
    """The pools a preset's store gives the attention are the layouts the kernel was written for."""
    policy = Policy.from_preset(preset)
    store = policy.make_store(2, 2, 128, torch.bfloat16, torch.device("cpu"))
    n = 300
    kv = torch.randn(2, 2, n, 128).to(torch.bfloat16)
    store.append(kv, kv, torch.ones(2, n, dtype=torch.bool), torch.zeros(2, n, dtype=torch.long))
    pools = [s for s in store.attention_sources() if s.key.fmt != "dense"]
    query = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
    assert pools and all(native.kernel_format(s) == fmt and native.fits(query, s) for s in pools)


def test_cpu_steps_never_plan_the_native_kernel():
    query = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
    assert _native_plans(query, [make_source("nvfp4", [20, 3], 2, 128)], False, "auto") == (None, {}, 0)


def regions(src, cuts, extents=None):
    """``src``'s block table cut at the given columns into regions of one pool (as ThinKV's R and
    E regions share one): together they hold exactly ``src``'s tokens."""
    edges = [0, *cuts, src.table.shape[1]]
    out = []
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        extent = None if extents is None else torch.as_tensor(extents[i], device=src.table.device)
        out.append(PagedSource(src.key, src.value, src.table[:, a:b].contiguous(), src.block_size, src.valid,
                               extent=extent))
    return out


def test_regions_of_one_pool_share_a_launch_and_other_pools_do_not():
    src = make_source("nvfp4", [300, 40, 129], 2, 128)
    other = make_source("nvfp4", [30, 4, 12], 2, 128, seed=2)
    parts = regions(src, [2, 4, 6, 8, 10])  # six regions: a launch takes four
    sources = [parts[0], other, *parts[1:]]
    plans = {i: (10 * i, 32, 2) for i in range(len(sources))}
    groups = native_groups(plans, sources)
    index_of = {id(s): i for i, s in enumerate(sources)}
    assert [[index_of[id(s)] for s, *_ in g] for g in groups] == [[0, 2, 3, 4], [5, 6], [1]]
    assert groups[0][1][0] is sources[2] and groups[0][1][1:] == (20, 32, 2)


def test_backend_cuda_says_why_it_cannot_run():
    src = make_source("nvfp4", [20, 3], 2, 128)
    query = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend='cuda' needs CUDA tensors"):
        paged_decode_attention(query, [src], 0.1, backend="cuda")
    with pytest.raises(ValueError, match="accepted: None .*'cuda'"):
        paged_decode_attention(query, [src], 0.1, backend="cudnn")


def test_disabled_native_kernel_is_reported_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(native, "ENABLED", False)
    monkeypatch.setattr(native, "_STATE", {})
    with caplog.at_level(logging.INFO, logger="kvcompose"):
        assert native.module(torch.device("cuda", 0)) is None
    assert "KVCOMPOSE_NATIVE_ATTENTION=0" in caplog.text
    assert native._STATE[0] == (None, "KVCOMPOSE_NATIVE_ATTENTION=0")


# ------------------------------------------------------------------- GPU


def check_native(query, sources, tol=1.6e-2):
    out = paged_decode_attention(query, sources, 0.1, backend="cuda")
    ref = paged_decode_attention_torch(query, sources, 0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


NVFP4_SHAPES = [(1, 64, 4), (4, 128, 2), (8, 128, 1), (4, 64, 2), (8, 64, 1), (1, 128, 4), (4, 128, 8), (4, 64, 8),
                (2, 128, 6)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group,head_dim,H", [("nvfp4", *shape) for shape in NVFP4_SHAPES]
                         + [("int", *shape) for shape in NVFP4_SHAPES]
                         + [("kivi4", *shape) for shape in NVFP4_SHAPES]
                         + [(fmt, *shape) for fmt in ("ternary", "int2", "kivi2") for shape in NVFP4_SHAPES
                            if shape[1] == 128])
def test_cuda_native_kernel_matches_reference(fmt, group, head_dim, H):
    """Every GQA group (1, 2, 4, 8) and head dim (64, 128; ternary, INT2 and KIVI-2: 128; "int" is INT4), with
    1 to 8 KV heads; holes, the recent buffer, empty rows, extents, and another format's pool beside it."""
    lengths = [1, 0, 3000, 700, 16, 4097, 33]
    src = make_source(fmt, lengths, H, head_dim, device="cuda")
    query = torch.randn(len(lengths), H * group, 1, head_dim, device="cuda").to(torch.bfloat16)
    plans = _native_plans(query, [src], False, "cuda")[1]
    assert list(plans) == [0]  # the CUDA kernel runs this source
    assert list(_native_plans(query, [src], False, "auto")[1]) == ([0] if head_dim in native.AUTO_HEAD_DIMS else [])
    assert _native_plans(query, [src], True, "cuda")[1] == {}  # scores requested: the Triton kernel writes them
    check_native(query, [src])
    holes = make_source(fmt, lengths, H, head_dim, holes=True, seed=5, device="cuda")
    buffer = make_source("dense", [5, 0, 15, 1, 0, 15, 3], H, head_dim, bs=15, seed=9, device="cuda")
    check_native(query, [holes, buffer])
    other = "nvfp4" if fmt == "ternary" else "ternary"  # ThinKV's stores: ternary beside NVFP4 or INT4
    check_native(query, [src, make_source(other, lengths, H, head_dim, holes=True, seed=4, device="cuda"), buffer])
    check_extent(query, [src, buffer], lengths, backend="cuda")
    moved = head_major(holes)  # each head's rows together
    assert list(_native_plans(query, [moved, buffer], False, "cuda")[1]) == [0]
    check_native(query, [moved, buffer])
    check_extent(query, [head_major(src), buffer], lengths, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_cuda_native_kernel_ignores_what_empty_slots_hold(fmt):
    """Slots that take no part (holes, the rest of a row's last block) may hold anything in a pool a
    caller built: NaN scales and minimums there leave the output as it is with finite ones."""
    lengths = [1, 0, 3000, 700, 16, 4097, 33]
    src = make_source(fmt, lengths, 2, 128, holes=True, seed=3, device="cuda")
    query = torch.randn(len(lengths), 8, 1, 128, device="cuda").to(torch.bfloat16)
    ref = paged_decode_attention_torch(query, [src], 0.1)
    empty = ~src.valid
    assert int(empty.sum()) > 0
    nan = {torch.uint8: 0x7F, torch.float16: float("nan")}  # E4M3's NaN byte, fp16's
    operands = [src.value] + ([] if fmt.startswith("kivi") else [src.key])  # KIVI keys: scales per token group
    for op in operands:
        for t in (op.scale, op.minimum):
            if t is not None:
                t[empty] = nan[t.dtype]
    out = paged_decode_attention(query, [src], 0.1, backend="cuda")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("most_heads", [0, 10 ** 6], ids=["own-launch", "in-merge"])
def test_the_buffer_beside_the_cuda_kernel_in_the_merge_or_in_its_own_launch(most_heads, monkeypatch):
    """Large batches compute the recent buffer in a partial launch of its own and merge plainly
    (``RIDER_MERGE_MAX_HEADS``); small ones in the merge launch. Both agree with the reference."""
    from kvcompose.ops.paged_attention import launch

    monkeypatch.setattr(launch, "RIDER_MERGE_MAX_HEADS", most_heads)
    lengths = [700, 0, 33, 1500]
    src = make_source("nvfp4", lengths, 2, 128, holes=True, device="cuda")
    buffer = make_source("dense", [5, 0, 15, 1], 2, 128, bs=15, seed=9, device="cuda")
    query = torch.randn(len(lengths), 8, 1, 128, device="cuda").to(torch.bfloat16)
    check_native(query, [src, buffer])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "ternary", "int", "int2", "kivi2", "kivi4"])
@pytest.mark.parametrize("dtype,magnitude", [(torch.float16, 1.0), (torch.bfloat16, 1.0e5), (torch.bfloat16, 1e-3)])
def test_cuda_native_kernel_keeps_any_query(fmt, dtype, magnitude):
    lengths = [300, 0, 1000]
    src = make_source(fmt, lengths, 2, 128, dtype=dtype, seed=3, device="cuda")
    query = (torch.randn(len(lengths), 8, 1, 128, device="cuda") * magnitude).to(dtype)
    out = paged_decode_attention(query, [src], 0.1 / magnitude, backend="cuda")
    ref = paged_decode_attention_torch(query, [src], 0.1 / magnitude)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["kivi2", "kivi4"])
def test_cuda_kivi_keeps_keys_with_an_outlier_channel(fmt):
    """One key channel of magnitude about 4e4: scales of about 2.7e4 (KIVI-2) and 5e3 (KIVI-4), which
    overflow fp16 when multiplied by a query of magnitude 32; the query's shift keeps every product finite."""
    g = torch.Generator().manual_seed(11)
    lengths = [300, 70, 0]
    table, valid, row_of = block_table(lengths, 32, False, g)
    k = torch.randn(valid.numel(), 2, 128, generator=g)
    k[:, :, 5] *= 1e4
    v = torch.randn(valid.numel(), 2, 128, generator=g)
    src = PagedSource(operand(fmt, k.to(torch.bfloat16), row_of, 3, "key", g),
                      operand(fmt, v.to(torch.bfloat16), row_of, 3, "value", g), table, 32, valid)
    src = to_device(head_major(src), "cuda")
    assert src.key.scale.float().abs().max() > 2048
    query = torch.randn(3, 8, 1, 128, device="cuda").to(torch.bfloat16)
    out = paged_decode_attention(query, [src], 1e-4, backend="cuda")
    ref = paged_decode_attention_torch(query, [src], 1e-4)
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "ternary", "int", "int2", "kivi2", "kivi4"])
def test_cuda_native_kernel_replays_in_a_graph(fmt):
    lengths = [500, 20, 1200]
    src = make_source(fmt, lengths, 2, 128, device="cuda")
    query = torch.randn(3, 8, 1, 128, device="cuda").to(torch.bfloat16)
    eager = paged_decode_attention(query, [src], 0.1, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(query, [src], 0.1, backend="cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,head_dim,group,other_fmt", [("nvfp4", 128, 4, "ternary"), ("nvfp4", 64, 8, "nvfp4"),
                                                          ("int", 128, 4, "ternary")])
def test_cuda_native_kernel_reads_regions_of_one_pool_in_one_launch(fmt, head_dim, group, other_fmt):
    """The regions' tables split the pool's rows at different columns (empty regions and rows
    included), with another pool's source between them (ThinKV's ternary T pool beside its
    NVFP4 or INT4 R and E regions at head dim 128), so a launch's partial results are not contiguous;
    five regions take two launches. Extents bound each region, and one that cuts a row's last
    valid tokens drops them (enough of them to move the output well past the tolerance)."""
    lengths = [1000, 0, 37, 300, 1]
    src = make_source(fmt, lengths, 2, head_dim, holes=True, seed=7, device="cuda")
    other = make_source(other_fmt, [200, 5, 0, 90, 64], 2, head_dim, seed=8, device="cuda")
    query = torch.randn(len(lengths), 2 * group, 1, head_dim, device="cuda").to(torch.bfloat16)
    buffer = make_source("dense", [3, 0, 15, 1, 0], 2, head_dim, bs=15, seed=9, device="cuda")
    for cuts in ([10], [8, 20, 40], [6, 12, 24, 40]):  # regions of 5 columns or more: none left to Triton
        parts = regions(src, cuts)
        sources = [parts[0], other, *parts[1:], buffer]
        plans = _native_plans(query, sources, False, "cuda")[1]
        assert len(plans) == len(parts) + 1
        assert len(native_groups(plans, sources)) == (2 if len(parts) <= native.MAX_REGIONS else 3)
        check_native(query, sources)
    bs = src.block_size
    extents = [[min(n, 10 * bs) for n in lengths], [max(0, n - 10 * bs) for n in lengths]]
    extents[1][0] -= 392  # row 0's last 392 columns (whole blocks) lie beyond the second region's extent
    out = paged_decode_attention(query, regions(src, [10], extents) + [other, buffer], 0.1, backend="cuda")
    valid = src.valid.clone()
    valid[src.slots()[0, lengths[0] - 392:lengths[0]]] = False
    without = PagedSource(src.key, src.value, src.table, bs, valid)
    ref = paged_decode_attention_torch(query, [without, other, buffer], 0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)
