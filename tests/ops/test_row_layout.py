"""Sources whose per-slot tensors are head-major (each head's rows together) decode as slot-major ones do."""

import dataclasses

import pytest
import torch

from kvcompose.ops.paged_attention import head_major, paged_decode_attention, paged_decode_attention_torch, row_layout

from test_paged_attention import FORMATS, check_close, make_source


def test_row_layout_tells_slot_major_from_head_major():
    src = make_source("nvfp4", [40, 9], 2, 64)
    assert row_layout(src) == 0
    moved = head_major(src)
    slots = src.valid.numel()
    assert row_layout(moved) == slots
    assert moved.key.codes.stride() == (32, slots * 32, 1)  # one head's rows are one run
    assert torch.equal(moved.key.codes, src.key.codes) and torch.equal(moved.value.scale, src.value.scale)


def test_a_layout_the_kernels_cannot_address_is_named():
    src = make_source("nvfp4", [40, 9], 2, 64)
    codes = src.key.codes
    padded = torch.zeros(codes.shape[0], codes.shape[1], codes.shape[2] + 16, dtype=codes.dtype)[..., :codes.shape[2]]
    bad = dataclasses.replace(src, key=dataclasses.replace(src.key, codes=padded.copy_(codes)))
    query = torch.randn(2, 4, 1, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"source 0: key codes of shape \(96, 2, 32\) has strides \(96, 48, 1\); accepted"):
        paged_decode_attention(query, [bad], 0.1, backend="torch")
    mixed = dataclasses.replace(src, key=head_major(src).key)
    with pytest.raises(ValueError, match="must lie one way .*; got key codes: head-major over 96 slots, key "
                                         "scale: head-major over 96 slots, value codes: slot-major"):
        row_layout(mixed)
    flat = dataclasses.replace(src, value=dataclasses.replace(src.value, scale=src.value.scale.flatten(1)))
    with pytest.raises(ValueError, match=r"value scale of shape \(96, 8\); accepted: \[slots, H, ...\]"):
        row_layout(flat)


@pytest.mark.parametrize("fmt", ["ternary", "dense"])  # dense: gathered by rows of the head-major storage
def test_the_reference_reads_head_major_sources_bit_for_bit(fmt):
    src = make_source(fmt, [70, 0, 33], 2, 128, holes=True)
    query = torch.randn(3, 8, 1, 128).to(torch.bfloat16)
    torch.testing.assert_close(paged_decode_attention_torch(query, [head_major(src)], 0.1),
                               paged_decode_attention_torch(query, [src], 0.1), atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_reads_head_major_sources(fmt):
    """Every format, head-major pool beside a slot-major buffer, in one launch."""
    src = head_major(make_source(fmt, [37, 0, 70], 2, 64, seed=3, holes=True))
    buffer = make_source("dense", [5, 0, 15], 2, 64, bs=15, seed=4)
    check_close(torch.randn(3, 8, 1, 64).to(torch.bfloat16), [src, buffer])
