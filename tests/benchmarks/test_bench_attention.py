"""The attention benchmark's mixed store is ThinKV's store as its preset keeps it."""

from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_attention_gpu

    return bench_attention_gpu


@pytest.mark.parametrize("label,preset_formats", [("mixed", "THINKV_FORMATS"), ("mixed-int", "THINKV_INT_FORMATS")])
def test_the_mixed_store_holds_thinkvs_classes_as_the_preset_stores_them(bench, monkeypatch, label, preset_formats):
    from kvcompose.ops import dispatch
    from kvcompose.ops.paged_attention import paged_decode_attention_torch

    monkeypatch.setattr(dispatch, "use_triton", lambda *args: False)  # the layout is under test: torch quantizes
    from kvcompose.ops.paged_attention.native import kernel_format, pool_of
    from kvcompose.policies.presets import THINKV_FORMATS, THINKV_INT_FORMATS

    formats = {"THINKV_FORMATS": THINKV_FORMATS, "THINKV_INT_FORMATS": THINKV_INT_FORMATS}[preset_formats]
    B, L = 2, 3 * 64 + bench.BUFFER
    sources = bench.build(label, B, L, "cpu", dim=64)
    *regions, buffer = sources
    assert [s.key.fmt for s in regions] == [spec["name"] for spec in formats.values()]  # R, E, T
    assert [s.key.bits for s in regions] == [spec.get("bits", 0) for spec in formats.values()]
    r, e, t = regions
    assert pool_of(r) == pool_of(e) != pool_of(t)  # R and E: regions of one NVFP4 (INT4) pool
    assert kernel_format(r) == ("nvfp4" if label == "mixed" else "int4")
    assert [s.tokens for s in regions] == [64, 64, 64] and buffer.tokens == bench.BUFFER
    slots = torch.cat([s.slots().reshape(-1) for s in (r, e)])
    assert slots.unique().numel() == slots.numel()  # the regions hold different blocks of the pool
    query = torch.randn(B, bench.Q_HEADS, 1, 64)
    assert paged_decode_attention_torch(query, sources, 0.125).isfinite().all()


def test_head_major_pools_hold_the_same_store(bench, monkeypatch):
    """``--layout head``: the pools' rows by head, the regions still of one pool, the same attention."""
    from kvcompose.ops import dispatch
    from kvcompose.ops.paged_attention import paged_decode_attention_torch, row_layout
    from kvcompose.ops.paged_attention.native import pool_of

    monkeypatch.setattr(dispatch, "use_triton", lambda *args: False)
    B, L = 2, 3 * 64 + bench.BUFFER
    query = torch.randn(B, bench.Q_HEADS, 1, 64)
    monkeypatch.setattr(bench, "LAYOUT", "slot")
    slot_major = bench.build("mixed", B, L, "cpu", dim=64)
    monkeypatch.setattr(bench, "LAYOUT", "head")
    moved = bench.build("mixed", B, L, "cpu", dim=64)
    r, e, t, buffer = moved
    assert row_layout(r) == r.valid.numel() and row_layout(t) == t.valid.numel() and row_layout(buffer) == 0
    assert pool_of(r) == pool_of(e)
    torch.testing.assert_close(paged_decode_attention_torch(query, moved, 0.125),
                               paged_decode_attention_torch(query, slot_major, 0.125), atol=0, rtol=0)


@pytest.mark.parametrize("argv,said", [(["--buffer", "0"], "--buffer 0: give 1 to 512 tokens"),
                                       (["--buffer", "600"], "--buffer 600: give 1 to 512 tokens"),
                                       (["--smoke", "--buffer", "600"], "--buffer 600: give 1 to 512 tokens"),
                                       (["--split-min", "0"], "--split-min 0: give a positive number of tokens"),
                                       (["--small-source", "0"], "--small-source 0: give a positive number of tokens")])
def test_the_buffer_and_split_options_refuse_what_the_grid_cannot_hold(bench, capsys, argv, said):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert said in capsys.readouterr().err


def test_a_longer_buffer_holds_its_tokens_beside_the_pool(bench, monkeypatch):
    """``--buffer 160``: a window as long as KIVI's as the recent buffer; the pool keeps the rest of the row."""
    from kvcompose.ops import dispatch

    monkeypatch.setattr(dispatch, "use_triton", lambda *args: False)
    monkeypatch.setattr(bench, "BUFFER", 160)
    *pools, buffer = bench.build("int2", 1, 224, "cpu", dim=64)
    assert buffer.tokens == 160 and [s.tokens for s in pools] == [64]
