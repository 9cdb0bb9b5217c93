"""Ternary ops: kernel == reference bit for bit, the least-squares scale rule, layout, errors."""

import pytest
import torch

from kvcompose.ops import quant_ternary as ops
from kvcompose.ops.numerics import e4m3_decode, e4m3_round
from kvcompose.ops.triton_shim import HAS_TRITON, interpreted
from quant_data import backends_agree, gpu, make, rel_err, same_bits
from quant_data import needs_interpreter as needs_interpreter_for

needs_interpreter = needs_interpreter_for(ops._ternary_quantize_kernel)
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def check_backends_agree(x, s2=None):
    return backends_agree(ops.ternary_quantize, ops.ternary_dequantize, x, s2)


CASES = [
    ((1, 1, 16), torch.float32, "gauss"),
    ((9, 2, 64), torch.float32, "wide"),
    ((5, 2, 48), torch.bfloat16, "outlier"),
    ((3, 2, 128), torch.float16, "wide"),
    ((7, 1, 80), torch.float32, "ties"),
]


@needs_interpreter
@pytest.mark.parametrize("shape, dtype, kind", CASES)
def test_kernel_matches_reference(shape, dtype, kind):
    check_backends_agree(make(kind, shape, dtype))


@needs_interpreter
def test_kernel_matches_reference_non_contiguous_and_fixed_s2():
    x = make("wide", (2, 5, 64)).transpose(0, 1)
    assert not x.is_contiguous()
    check_backends_agree(x)
    check_backends_agree(make("outlier", (3, 2, 64))[:, :, ::2], torch.tensor([1e-3, 2.0]))


def _one_block(values, backend="torch", s2=1.0):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 1, 16)
    packed = ops.ternary_quantize(x, torch.tensor([s2]), backend=backend)
    return packed, ops.ternary_dequantize(*packed, backend=backend).flatten().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_least_squares_scale_on_hand_made_blocks(backend):
    # one outlier: coding it alone (alpha = 20) beats any larger set
    assert _one_block([20.0] + [1.0] * 15, backend)[1] == [20.0] + [0.0] * 15
    # two levels: {3s} scores 24^2/8 = 72 > all 32^2/16 = 64; 1/3 rounds to 0
    assert _one_block([3.0] * 8 + [1.0] * 8, backend)[1] == [3.0] * 8 + [0.0] * 8
    # constant block is exact; signs are kept
    assert _one_block([-2.0, 2.0] * 8, backend)[1] == [-2.0, 2.0] * 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_scores_pick_the_largest_threshold(backend):
    # {4} scores 4^2/1 = 16 and {4, eight 1s} scores 12^2/9 = 16: the smaller set wins.
    assert _one_block([4.0] + [1.0] * 8 + [0.0] * 7, backend)[1] == [4.0] + [0.0] * 15


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_way_values_round_to_zero_and_scale_saturates(backend):
    # alpha = 20 but s2 = 2^-6 caps the block scale at 448, so the level is 448 * 2^-6 = 7
    # and 3.5 sits exactly half way: it codes as 0.
    values = [20.0, -20.0, 3.5, -3.5] + [0.0] * 12
    assert _one_block(values, backend, s2=2.0**-6)[1] == [7.0, -7.0] + [0.0] * 14


def test_scale_matches_exact_least_squares_optimum():
    x = make("gauss", (64, 2, 64), seed=7)
    _, bs, s2 = ops.ternary_quantize(x, backend="torch")
    a = x.double().abs().reshape(64, 2, 4, 16).sort(dim=-1, descending=True).values
    csum = a.cumsum(-1)
    k = torch.arange(1, 17, dtype=torch.float64)
    best = (csum**2 / k).argmax(-1, keepdim=True)
    alpha = (csum.gather(-1, best) / (best + 1)).squeeze(-1).float()
    expected = e4m3_round(alpha / s2[None, :, None])
    agree = (e4m3_decode(bs) == expected).float().mean().item()
    assert agree > 0.99  # fixed-point magnitudes may flip a near-tie now and then


def test_two_bit_layout_and_redundant_code():
    (codes, bs, s2), _ = _one_block([1.0, -1.0, 0.0, 1.0] + [0.0] * 12)
    assert codes[0, 0, 0].item() == 0b01_00_10_01  # element 0 in the lowest bits
    redundant = torch.full_like(codes, 0xFF)  # code 3 everywhere
    assert (ops.ternary_dequantize(redundant, bs, s2, backend="torch") == 0).all()
    if HAS_TRITON and interpreted(ops._ternary_dequantize_kernel):
        assert (ops.ternary_dequantize(redundant, bs, s2, backend="triton") == 0).all()


def test_zero_blocks_are_exact_with_scale_one():
    x = make("gauss", (4, 2, 32))
    x[2, 1, 16:] = 0
    x[:, 0] = 0
    codes, bs, s2 = ops.ternary_quantize(x, backend="torch")
    assert s2[0] == 1.0 and (e4m3_decode(bs[:, 0]) == 1.0).all() and e4m3_decode(bs[2, 1, 1]) == 1.0
    y = ops.ternary_dequantize(codes, bs, s2, backend="torch")
    assert (y[:, 0] == 0).all() and (y[2, 1, 16:] == 0).all()


@pytest.mark.parametrize("kind, bound", [("gauss", 0.45), ("outlier", 0.28)])
def test_roundtrip_error(kind, bound):
    # measured 0.407 (gauss) and 0.242 (outlier) on 3 seeds of [256, 4, 128]
    x = make(kind, (256, 4, 128), seed=1)
    assert rel_err(x, ops.ternary_dequantize(*ops.ternary_quantize(x, backend="torch"), backend="torch")) < bound


def test_errors_name_format_and_problem():
    x = make("gauss", (4, 2, 32))
    x[0, 0, :5] = float("nan")
    with pytest.raises(ValueError, match=r"ternary: input has 5 NaN/inf value"):
        ops.ternary_quantize(x)
    with pytest.raises(ValueError, match=r"ternary: head_dim 8 is not a positive multiple of 16"):
        ops.ternary_quantize(make("gauss", (4, 2, 8)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gauss", "outlier", "wide", "ties"])
def test_cuda_kernel_matches_reference(dtype, kind):
    x = make(kind, (1000, 8, 128), dtype, seed=3)
    cpu = ops.ternary_quantize(x, backend="torch")
    xc = x.cuda()
    ref = ops.ternary_quantize(xc, backend="torch")
    tri = ops.ternary_quantize(xc, backend="triton")
    assert all(same_bits(a, b) for a, b in zip(tri, ref))
    assert all(same_bits(a.cpu(), b) for a, b in zip(tri, cpu))
    d_tri = ops.ternary_dequantize(*tri, backend="triton")
    assert same_bits(d_tri, ops.ternary_dequantize(*ref, backend="torch"))
    assert same_bits(d_tri.cpu(), ops.ternary_dequantize(*cpu, backend="torch"))
    odd = make(kind, (333, 3, 80), dtype, seed=5).cuda().transpose(0, 1).contiguous().transpose(0, 1)
    tri, ref = ops.ternary_quantize(odd, backend="triton"), ops.ternary_quantize(odd, backend="torch")
    assert all(same_bits(a, b) for a, b in zip(tri, ref))
