"""INT-k ops (token groups and KIVI channel groups): kernel == reference, arithmetic, errors."""

import pytest
import torch

from kvcompose.ops import quant_int as ops
from kvcompose.ops import quant_int_channel as channel_ops
from kvcompose.ops.layout import unpack_codes
from quant_data import gpu, make, rel_err, same_bits
from quant_data import needs_interpreter as needs_interpreter_for

needs_interpreter = needs_interpreter_for(ops._int_token_quantize_kernel)
F16, F32 = torch.float16, torch.float32


def make_int(kind, shape, dtype=torch.float32, seed=0):
    return make(kind, shape, dtype, seed, octaves=(-16, 8))  # zero groups, ~24 octaves


def check_tokens(x, bits, gs, sdt):
    ref = ops.int_quantize_tokens(x, bits, gs, sdt, backend="torch")
    tri = ops.int_quantize_tokens(x, bits, gs, sdt, backend="triton")
    assert all(same_bits(a, b) for a, b in zip(ref, tri))
    d_ref = ops.int_dequantize_tokens(*ref, bits, backend="torch")
    assert same_bits(d_ref, ops.int_dequantize_tokens(*ref, bits, backend="triton"))
    return ref


def check_channels(x, bits, g, sdt):
    ref = channel_ops.int_quantize_channels(x, bits, g, sdt, backend="torch")
    tri = channel_ops.int_quantize_channels(x, bits, g, sdt, backend="triton")
    assert all(same_bits(a, b) for a, b in zip(ref, tri))
    d_ref = channel_ops.int_dequantize_channels(*ref, bits, g, backend="torch")
    assert same_bits(d_ref, channel_ops.int_dequantize_channels(*ref, bits, g, backend="triton"))
    return ref


@needs_interpreter
@pytest.mark.parametrize(
    "shape, dtype, kind, bits, gs, sdt",
    [
        ((5, 3, 64), F32, "wide", 2, None, F16),
        ((7, 2, 96), torch.bfloat16, "outlier", 4, None, F16),
        ((7, 2, 48), F32, "gauss", 4, 16, F32),
        ((4, 2, 64), F16, "wide", 8, 32, F16),
        ((3, 1, 40), F32, "gauss", 2, 20, F32),
        ((7, 2, 64), torch.bfloat16, "outlier", 2, None, F16),  # bf16 read as words (power-of-two groups)
        ((5, 3, 64), torch.bfloat16, "wide", 4, 32, F16),
        ((9, 2, 32), torch.bfloat16, "gauss", 2, 16, F32),
        ((40, 3, 32), torch.bfloat16, "wide", 4, 4, F16),
    ],
)
def test_token_kernel_matches_reference(shape, dtype, kind, bits, gs, sdt):
    check_tokens(make_int(kind, shape, dtype), bits, gs, sdt)


@needs_interpreter
@pytest.mark.parametrize(
    "shape, dtype, kind, bits, g, sdt",
    [
        ((37, 2, 64), F32, "wide", 2, 8, F16),
        ((37, 2, 64), torch.bfloat16, "outlier", 4, 32, F16),
        ((30, 1, 40), F32, "gauss", 8, 12, F32),
        ((5, 3, 48), F16, "wide", 4, 32, F32),
    ],
)
def test_channel_kernel_matches_reference(shape, dtype, kind, bits, g, sdt):
    check_channels(make_int(kind, shape, dtype), bits, g, sdt)


@needs_interpreter
@pytest.mark.parametrize("chunk", [4, 32])
def test_channel_kernel_at_other_token_chunks(chunk, monkeypatch):
    monkeypatch.setattr(channel_ops, "CHANNEL_QUANT_CHUNK", chunk)  # 4: several passes per group; 32: one
    check_channels(make_int("wide", (37, 2, 64)), 2, 8, F16)
    check_channels(make_int("outlier", (45, 1, 48), torch.bfloat16), 4, 32, F32)


@needs_interpreter
def test_kernels_match_reference_non_contiguous():
    x = make_int("wide", (2, 9, 64)).transpose(0, 1)
    assert not x.is_contiguous()
    check_tokens(x, 4, 32, F16)
    check_channels(x, 2, 4, F16)


def test_exact_grid_values_reconstruct_exactly():
    x = torch.arange(16, dtype=torch.float32).repeat(3, 2, 2) - 5.0  # [3, 2, 32], groups of 16 span -5..10
    codes, scale, lo = ops.int_quantize_tokens(x, 4, 16, backend="torch")
    assert (scale == 1).all() and (lo == -5).all()
    assert torch.equal(unpack_codes(codes, 4), (x + 5).to(torch.int32))
    assert torch.equal(ops.int_dequantize_tokens(codes, scale, lo, 4, backend="torch"), x)


def test_constant_and_zero_groups_are_exact_with_scale_one():
    x = make_int("gauss", (8, 2, 32))
    x[:, 0, :16] = 0
    x[:, 1, :16] = 0.75
    codes, scale, lo = ops.int_quantize_tokens(x, 2, 16, backend="torch")
    assert (scale[:, :, 0] == 1).all()
    y = ops.int_dequantize_tokens(codes, scale, lo, 2, backend="torch")
    assert (y[:, 0, :16] == 0).all() and (y[:, 1, :16] == 0.75).all()
    x[:, :, 5] = 0  # a constant channel in every token group
    codes, scale, lo = channel_ops.int_quantize_channels(x, 4, 4, backend="torch")
    assert (scale[:, :, 5] == 1).all()
    assert (channel_ops.int_dequantize_channels(codes, scale, lo, 4, 4, backend="torch")[:, :, 5] == 0).all()


def test_channel_groups_cover_a_short_last_group():
    x = make_int("gauss", (10, 2, 16))
    codes, scale, lo = channel_ops.int_quantize_channels(x, 8, 4, backend="torch")
    assert scale.shape == (3, 2, 16) and codes.shape == (10, 2, 16)
    assert torch.equal(lo[2].float(), x[8:].amin(0).half().float())


@pytest.mark.parametrize(
    "bits, gauss_bound, outlier_bound",
    # measured on 3 seeds of [256, 4, 128], whole-head-dim groups: 2-bit 0.502 / 0.976,
    # 4-bit 0.0999 / 0.211, 8-bit 0.0059 / 0.0124
    [(2, 0.55, 1.05), (4, 0.115, 0.24), (8, 0.007, 0.015)],
)
def test_token_roundtrip_error(bits, gauss_bound, outlier_bound):
    for kind, bound in (("gauss", gauss_bound), ("outlier", outlier_bound)):
        x = make_int(kind, (256, 4, 128), seed=1)
        y = ops.int_dequantize_tokens(*ops.int_quantize_tokens(x, bits, backend="torch"), bits, backend="torch")
        assert rel_err(x, y) < bound, kind


@pytest.mark.parametrize("bits, bound", [(2, 0.45), (4, 0.09), (8, 0.0055)])
def test_channel_roundtrip_error_and_outlier_channel(bits, bound):
    # measured (G = 32) 0.392 / 0.078 / 0.0046 on Gaussian and on outlier keys alike
    for kind in ("gauss", "outlier"):
        x = make_int(kind, (256, 4, 128), seed=1)
        packed = channel_ops.int_quantize_channels(x, bits, 32, backend="torch")
        y = channel_ops.int_dequantize_channels(*packed, bits, 32, backend="torch")
        assert rel_err(x, y) < bound, kind
    # the point of KIVI keys: an outlier channel hurts per-token groups, not per-channel ones
    x = make_int("outlier", (256, 4, 128), seed=1)
    per_token = ops.int_dequantize_tokens(*ops.int_quantize_tokens(x, bits, backend="torch"), bits, backend="torch")
    assert rel_err(x, y) < rel_err(x, per_token) * 0.6


def test_errors_name_the_problem():
    x = make_int("gauss", (4, 2, 32))
    x[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"int4: input has 1 NaN/inf value"):
        ops.int_quantize_tokens(x, 4)
    with pytest.raises(ValueError, match=r"bits=3 is not supported; accepted: 2, 4, 8"):
        ops.int_quantize_tokens(make_int("gauss", (4, 2, 32)), 3)
    with pytest.raises(ValueError, match=r"group_size 12 must divide head_dim 32"):
        ops.int_quantize_tokens(make_int("gauss", (4, 2, 32)), 4, 12)
    with pytest.raises(ValueError, match=r"head_dim 30 is not a positive multiple of 4"):
        channel_ops.int_quantize_channels(make_int("gauss", (4, 2, 30)), 2)
    with pytest.raises(ValueError, match=r"float16 range .* use scale_dtype=torch.float32"):
        ops.int_quantize_tokens(make_int("gauss", (4, 2, 32)) * 1e5, 4)
    big = make_int("gauss", (4, 2, 32)) * 1e5
    packed = ops.int_quantize_tokens(big, 8, scale_dtype=F32, backend="torch")
    y = ops.int_dequantize_tokens(*packed, 8, backend="torch")
    assert rel_err(big, y) < 0.01


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gauss", "outlier", "wide"])
def test_cuda_kernels_match_reference(bits, dtype, kind):
    x = make_int(kind, (1000, 8, 128), dtype, seed=3)
    xc = x.cuda()
    for gs, sdt in ((None, F16), (32, F32)):
        cpu = ops.int_quantize_tokens(x, bits, gs, sdt, backend="torch")
        ref = ops.int_quantize_tokens(xc, bits, gs, sdt, backend="torch")
        tri = ops.int_quantize_tokens(xc, bits, gs, sdt, backend="triton")
        assert all(same_bits(a, b) for a, b in zip(tri, ref))
        assert all(same_bits(a.cpu(), b) for a, b in zip(tri, cpu))
        d_tri = ops.int_dequantize_tokens(*tri, bits, backend="triton")
        assert same_bits(d_tri, ops.int_dequantize_tokens(*ref, bits, backend="torch"))
        assert same_bits(d_tri.cpu(), ops.int_dequantize_tokens(*cpu, bits, backend="torch"))
    odd = make_int(kind, (333, 3, 96), dtype, seed=5)
    for g, sdt in ((32, F16), (12, F32)):
        cpu = channel_ops.int_quantize_channels(odd, bits, g, sdt, backend="torch")
        oc = odd.cuda().transpose(0, 1).contiguous().transpose(0, 1)
        ref = channel_ops.int_quantize_channels(oc, bits, g, sdt, backend="torch")
        tri = channel_ops.int_quantize_channels(oc, bits, g, sdt, backend="triton")
        assert all(same_bits(a, b) for a, b in zip(tri, ref))
        assert all(same_bits(a.cpu(), b) for a, b in zip(tri, cpu))
        d_tri = channel_ops.int_dequantize_channels(*tri, bits, g, backend="triton")
        assert same_bits(d_tri, channel_ops.int_dequantize_channels(*ref, bits, g, backend="torch"))
        assert same_bits(d_tri.cpu(), channel_ops.int_dequantize_channels(*cpu, bits, g, backend="torch"))
