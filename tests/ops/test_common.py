"""Shared quantization helpers: E4M3/E2M1 rounding, packing, input checks, dispatch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompose.ops import checks, dispatch, head_scale, layout, numerics, triton_shim

needs_interpreter = pytest.mark.skipif(
    not triton_shim.HAS_TRITON or not triton_shim.interpreted(numerics.e4m3_encode_tl),
    reason="kvcompose kernels were defined without TRITON_INTERPRET=1 (set it before kvcompose is imported)",
)
gpu = pytest.mark.gpu  # conftest skips it without a GPU or with interpreted kernels

FINITE_E4M3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def torch_e4m3(v: torch.Tensor) -> torch.Tensor:
    """torch's own float8 cast of clamped values, as bit patterns."""
    return v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_probe_values() -> torch.Tensor:
    """Every finite E4M3 value, every midpoint between neighbours, and values just around them."""
    vals = numerics.e4m3_decode(FINITE_E4M3[FINITE_E4M3 < 0x80]).sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    base = torch.cat([vals, mids, torch.tensor([2.0**-10, 2.0**-11, 1e-30, 3e-40, 447.9, 448.0, 460.0, 1e6])])
    near = torch.cat([torch.nextafter(base, torch.full_like(base, 1e9)), torch.nextafter(base, torch.zeros_like(base))])
    out = torch.cat([base, near])
    return torch.cat([out, -out])


# --------------------------------------------------------------------------- E4M3


def test_e4m3_decode_matches_torch_for_every_finite_code():
    expected = FINITE_E4M3.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(numerics.e4m3_decode(FINITE_E4M3).view(torch.int32), expected.view(torch.int32))


def test_e4m3_encode_roundtrips_every_finite_code():
    assert torch.equal(numerics.e4m3_encode(numerics.e4m3_decode(FINITE_E4M3)), FINITE_E4M3)


def test_e4m3_encode_matches_torch_on_ties_and_neighbours():
    v = e4m3_probe_values()
    assert torch.equal(numerics.e4m3_encode(v), torch_e4m3(v))


def test_e4m3_encode_saturates_and_never_emits_nan():
    codes = numerics.e4m3_encode(torch.tensor([448.0, 449.0, 1e30, -1e30]))
    assert codes.tolist() == [0x7E, 0x7E, 0x7E, 0xFE]


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-448.0, max_value=448.0, allow_nan=False, width=32))
def test_e4m3_encode_matches_torch_on_random_floats(v):
    t = torch.tensor([v], dtype=torch.float32)
    assert numerics.e4m3_encode(t).item() == torch_e4m3(t).item()


def test_rne_int_ties_to_even():
    w = torch.tensor([0.0, 0.49999997, 0.5, 1.5, 2.5, 3.5, 2.4, 2.6, 7.0])
    assert numerics.rne_int(w).tolist() == [0, 0, 0, 2, 2, 4, 2, 3, 7]
    assert torch.equal(numerics.rne_int(w), torch.round(w).to(torch.int32))


def test_block_scale_rules():
    ratio = torch.tensor([0.0, 1e-9, 1.0, 500.0, 0.3])
    amax = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    bs = numerics.block_scale_e4m3(ratio, amax)
    assert bs.tolist() == [1.0, 2.0**-9, 1.0, 448.0, 0.3125]


# --------------------------------------------------------------------------- E2M1


def test_every_e2m1_code_decodes_to_its_value():
    codes = torch.arange(16)
    expected = list(numerics.E2M1_VALUES) + [-v for v in numerics.E2M1_VALUES]
    assert numerics.e2m1_decode(codes).tolist() == expected


def test_e2m1_encode_exact_values_roundtrip():
    vals = torch.tensor(list(numerics.E2M1_VALUES[1:]) + [-v for v in numerics.E2M1_VALUES[1:]])
    assert torch.equal(numerics.e2m1_decode(numerics.e2m1_encode(vals)), vals)


@pytest.mark.parametrize(
    "tie, expected", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
)
def test_e2m1_ties_round_to_even_code(tie, expected):
    y = torch.tensor([tie, -tie])
    assert numerics.e2m1_decode(numerics.e2m1_encode(y)).tolist() == [expected, -expected]


def test_e2m1_nearest_and_saturation():
    y = torch.tensor([0.26, 0.74, 1.3, 2.49, 2.51, 4.9, 5.01, 6.0, 7.0, 1e9, -1e9])
    assert numerics.e2m1_decode(numerics.e2m1_encode(y)).tolist() == [0.5, 0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, 6.0, 6.0, -6.0]


def test_e2m1_zero_keeps_the_sign():
    assert numerics.e2m1_encode(torch.tensor([0.0, 0.1, -0.0, -0.1, -0.25])).tolist() == [0, 0, 8, 8, 8]
    assert str(numerics.e2m1_decode(torch.tensor([8])).item()) == "-0.0"
    assert numerics.e2m1_encode(torch.tensor([-0.26])).item() == 0b1001


# --------------------------------------------------------------------------- packing


def test_packing_layout_first_element_in_low_bits():
    assert layout.pack_codes(torch.tensor([[0x3, 0xA]]), 4).tolist() == [[0xA3]]
    assert layout.pack_codes(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[0b00111001]]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 32))
    packed = layout.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(layout.unpack_codes(packed, bits), codes.to(torch.int32))


# --------------------------------------------------------------------------- checks and dispatch


def test_nan_and_inf_are_counted_in_the_error():
    x = torch.zeros(4, 2, 16)
    x[0, 0, 0] = float("nan")
    x[1, 1, 3] = float("inf")
    x[2, 0, 5] = float("-inf")
    with pytest.raises(ValueError, match=r"nvfp4: input has 3 NaN/inf value"):
        checks.check_input(x, "nvfp4", 16)


def test_shape_dtype_and_head_dim_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"\[N, H, D\].*\(4, 16\)"):
        checks.check_input(torch.zeros(4, 16), "fp8")
    with pytest.raises(ValueError, match=r"torch.int32.*accepted dtypes: torch.float16"):
        checks.check_input(torch.zeros(4, 2, 16, dtype=torch.int32), "fp8")
    with pytest.raises(ValueError, match=r"ternary: head_dim 24 is not a positive multiple of 16"):
        checks.check_input(torch.zeros(4, 2, 24), "ternary", 16)


def test_backend_argument_is_validated():
    x = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        dispatch.use_triton(x, numerics.e4m3_encode_tl, "cuda")
    assert dispatch.use_triton(x, numerics.e4m3_encode_tl, "torch") is False


def test_head_scale_all_zero_head_gets_one():
    x = torch.zeros(3, 2, 16)
    x[:, 1] = -896.0
    amax = checks.check_input(x, "fp8")
    assert amax.tolist() == [0.0, 896.0]
    assert head_scale.head_scale(amax, 448.0).tolist() == [1.0, 2.0]
    assert head_scale.head_scale(checks.check_input(torch.zeros(0, 2, 16), "fp8"), 448.0).tolist() == [1.0, 1.0]


@needs_interpreter
def test_head_scale_kernel_matches_the_torch_rule():
    x = torch.randn(7, 5, 32) * torch.tensor([0.0, 1.0, 0.0, 3e3, 1e-3])[None, :, None]
    x[2, 1, 3] = -9.0
    x[:, 2] = 1e-44  # a subnormal amax: the quotient underflows to 0
    expected = head_scale.head_scale(checks.check_input(x, "nvfp4"), 2688.0)
    scale, flags = head_scale.head_scale_triton(x, 2688.0)
    assert torch.equal(scale, expected) and scale[0] == 1.0 and scale[2] == 1.0  # zero and underflowing heads
    assert checks.flag_bits(flags) == 0


def _nan_inf_detected(device):
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(5, 3, 16).to(dtype).to(device)
            x[4, 2, 15] = bad
            with pytest.raises(ValueError, match=r"fp8: input has 1 NaN/inf value"):
                checks.check_input(x, "fp8")


def test_nan_inf_detected_in_every_dtype():
    _nan_inf_detected("cpu")


@pytest.mark.gpu
@gpu
def test_nan_inf_detected_in_every_dtype_cuda():
    _nan_inf_detected("cuda")


# --------------------------------------------------------------------------- Triton helpers == torch helpers

if triton_shim.HAS_TRITON:
    import triton.language as tl

    @triton_shim.jit
    def _helpers_kernel(v_ptr, e4m3_ptr, e2m1_ptr, rne_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        tl.store(e4m3_ptr + offs, numerics.e4m3_encode_tl(v).to(tl.uint8), mask=mask)
        tl.store(e2m1_ptr + offs, numerics.e2m1_encode_tl(v).to(tl.uint8), mask=mask)
        tl.store(rne_ptr + offs, numerics.rne_int_tl(tl.minimum(tl.abs(v), 1e9)), mask=mask)

    @triton_shim.jit
    def _decode_kernel(c_ptr, e4m3_ptr, e2m1_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        c = tl.load(c_ptr + offs)
        tl.store(e4m3_ptr + offs, numerics.e4m3_decode_tl(c))
        tl.store(e2m1_ptr + offs, numerics.e2m1_decode_tl(c & 15))


def _helpers_agree(device):
    v = torch.cat([e4m3_probe_values(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5])]).to(device)
    v = torch.cat([v, -v])
    n = v.numel()
    e4m3 = torch.empty(n, dtype=torch.uint8, device=device)
    e2m1 = torch.empty(n, dtype=torch.uint8, device=device)
    rne = torch.empty(n, dtype=torch.int32, device=device)
    _helpers_kernel[(triton_shim.cdiv(n, 1024),)](v, e4m3, e2m1, rne, n, BLOCK=1024, **triton_shim.LAUNCH_OPTS)
    assert torch.equal(e4m3, numerics.e4m3_encode(v))
    assert torch.equal(e2m1, numerics.e2m1_encode(v))
    assert torch.equal(rne, numerics.rne_int(v.abs().clamp(max=1e9)))

    codes = torch.arange(256, dtype=torch.uint8, device=device)
    d8 = torch.empty(256, dtype=torch.float32, device=device)
    d4 = torch.empty(256, dtype=torch.float32, device=device)
    _decode_kernel[(1,)](codes, d8, d4, BLOCK=256, **triton_shim.LAUNCH_OPTS)
    assert torch.equal(d8.view(torch.int32), numerics.e4m3_decode(codes).view(torch.int32))
    assert torch.equal(d4, numerics.e2m1_decode(codes.to(torch.int32) & 15))


@needs_interpreter
def test_triton_helpers_match_torch_helpers():
    _helpers_agree("cpu")


@pytest.mark.gpu
@gpu
def test_triton_helpers_match_torch_helpers_cuda():
    _helpers_agree("cuda")
