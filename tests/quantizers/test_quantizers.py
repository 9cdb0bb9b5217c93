"""Registered quantizer components: registry, config validation, packing, bits, slot locality."""

import pytest
import torch

from kvcompose import registry
from kvcompose.quantizers import (
    FP8Packed,
    FP8Quantizer,
    IntPacked,
    IntQuantizer,
    NVFP4Packed,
    NVFP4Quantizer,
    TernaryPacked,
    TernaryQuantizer,
)

N, H, D = 12, 2, 64


def x_of(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, D, generator=g).to(dtype)


def test_all_formats_are_registered():
    assert {"fp8", "nvfp4", "ternary", "int"} <= set(registry.names("quantizer"))
    assert registry.get("quantizer", "nvfp4") is NVFP4Quantizer


@pytest.mark.parametrize(
    "spec",
    ["fp8", "nvfp4", "ternary", {"name": "int", "bits": 2, "layout": "kivi", "group_size": 32, "token_group": 16}],
)
def test_build_and_config_roundtrip(spec):
    q = registry.build("quantizer", spec)
    assert registry.build("quantizer", registry.to_config(q)) == q


def test_int_fields_are_validated_with_accepted_values():
    with pytest.raises(ValueError, match=r"bits=3; accepted: 2, 4, 8"):
        IntQuantizer(bits=3)
    with pytest.raises(ValueError, match=r"layout='kivy'; accepted: per_token, kivi"):
        IntQuantizer(layout="kivy")
    with pytest.raises(ValueError, match=r"group_size=6; accepted: None \(the head dim\) or a positive multiple of 4"):
        IntQuantizer(bits=2, group_size=6)
    with pytest.raises(ValueError, match=r"token_group=0; accepted: a positive int"):
        IntQuantizer(token_group=0)
    with pytest.raises(ValueError, match=r"scale_dtype='bfloat16'; accepted: float16, float32"):
        IntQuantizer(scale_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"accepted fields"):
        registry.build("quantizer", {"name": "int", "bitz": 4})


def test_bits_per_value_formulas():
    assert FP8Quantizer().bits_per_value == 8.0
    assert NVFP4Quantizer().bits_per_value == 4.0 + 8 / 16
    assert TernaryQuantizer().bits_per_value == 2.0 + 8 / 16
    # INT: k + 2 * (scale bits) / (values per group)
    assert IntQuantizer(bits=4, group_size=32).bits_per_value == 4 + 2 * 16 / 32
    assert IntQuantizer(bits=2, group_size=64, scale_dtype="float32").bits_per_value == 2 + 2 * 32 / 64
    assert IntQuantizer(bits=8).bits_per_value_for(128) == 8 + 2 * 16 / 128
    kivi = IntQuantizer(bits=2, layout="kivi", token_group=32)
    assert kivi.bits_per_value_for(128) == ((2 + 32 / 32) + (2 + 32 / 128)) / 2
    with pytest.raises(ValueError, match="depend on head_dim"):
        IntQuantizer().bits_per_value


@pytest.mark.parametrize(
    "q, cls, expected_bytes",
    [
        (FP8Quantizer(), FP8Packed, N * H * D + 4 * H),
        (NVFP4Quantizer(), NVFP4Packed, N * H * D // 2 + N * H * D // 16 + 4 * H),
        (TernaryQuantizer(), TernaryPacked, N * H * D // 4 + N * H * D // 16 + 4 * H),
        (IntQuantizer(bits=4, group_size=32), IntPacked, N * H * D // 2 + 2 * 2 * N * H * D // 32),
    ],
)
def test_packed_bytes_and_actual_bits(q, cls, expected_bytes):
    packed = q.quantize(x_of(), backend="torch")
    assert isinstance(packed, cls) and packed.shape == (N, H, D)
    assert all(t.shape[0] == N for t in packed.token_tensors().values())
    assert packed.nbytes == expected_bytes
    assert packed.bits_per_value == 8 * expected_bytes / (N * H * D)
    per_head = 0.0 if packed.head_scale is None else 32 * H / (N * H * D)  # the fp32 [H] scale
    assert packed.bits_per_value == pytest.approx(q.bits_per_value_for(D) + per_head)


QUANTIZERS = [FP8Quantizer(), NVFP4Quantizer(), TernaryQuantizer(), IntQuantizer(bits=2)]


@pytest.mark.parametrize("q", QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_returns_input_dtype(q, dtype):
    x = x_of(dtype)
    packed = q.quantize(x, backend="torch")
    y = q.dequantize(packed, backend="torch")
    assert y.dtype == dtype and y.shape == x.shape
    assert q.dequantize(packed, torch.float32, backend="torch").dtype == torch.float32


@pytest.mark.parametrize("q", QUANTIZERS)
def test_auto_backend_matches_reference(q):
    x = x_of(torch.bfloat16)
    ref = q.quantize(x, backend="torch")
    auto = q.quantize(x)  # the interpreted kernel here; the reference where kernels cannot run
    assert all(torch.equal(a, b) for a, b in zip(auto.tensors().values(), ref.tensors().values()))
    assert torch.equal(q.dequantize(auto), q.dequantize(ref, backend="torch"))


@pytest.mark.parametrize(
    "q", [FP8Quantizer(), NVFP4Quantizer(), TernaryQuantizer(), IntQuantizer(bits=4, group_size=16)]
)
def test_slot_local_formats_code_each_token_independently(q):
    """With the head scale fixed, a token's codes and scales do not depend on its neighbours."""
    assert q.slot_local
    x = x_of(torch.float32)
    whole = q.quantize(x, backend="torch")
    assert whole.slot_local
    subset = torch.tensor([7, 2, 11])
    part = q.quantize(x[subset], backend="torch", head_scale=whole.head_scale)
    assert part.token_tensors().keys() == whole.token_tensors().keys()
    for name, t in part.token_tensors().items():
        assert torch.equal(t, whole.token_tensors()[name][subset]), name


def test_kivi_keys_span_tokens_and_need_a_role():
    q = IntQuantizer(bits=2, layout="kivi", token_group=4)
    assert not q.slot_local
    x = x_of(torch.float32)
    with pytest.raises(ValueError, match="pass role='key' or role='value'"):
        q.quantize(x)
    keys = q.quantize(x, role="key", backend="torch")
    values = q.quantize(x, role="value", backend="torch")
    assert keys.grouping == "channel" and not keys.slot_local and keys.scale.shape == (3, H, D)
    assert list(keys.token_tensors()) == ["codes"]
    assert values.grouping == "token" and values.slot_local and values.scale.shape == (N, H, 1)
    assert q.dequantize(keys, backend="torch").shape == x.shape
    with pytest.raises(ValueError, match="role must be 'key', 'value' or None"):
        q.quantize(x, role="query")


def test_wrong_packed_type_and_head_scale_misuse_raise():
    packed = FP8Quantizer().quantize(x_of(), backend="torch")
    with pytest.raises(TypeError, match="nvfp4 quantizer cannot decode a FP8Packed"):
        NVFP4Quantizer().dequantize(packed)
    with pytest.raises(ValueError, match="no per-head scale"):
        IntQuantizer().quantize(x_of(), head_scale=torch.ones(H))


def test_nan_input_raises_through_the_component():
    x = x_of(torch.float32)
    x[3, 1, 7] = float("nan")
    named = [(FP8Quantizer(), "fp8"), (NVFP4Quantizer(), "nvfp4"), (TernaryQuantizer(), "ternary"), (IntQuantizer(bits=8), "int8")]
    for q, name in named:
        with pytest.raises(ValueError, match=rf"^{name}: input has 1 NaN/inf value"):
            q.quantize(x)


DEFERRED = [FP8Quantizer(), NVFP4Quantizer(), TernaryQuantizer(), IntQuantizer(bits=4),
            IntQuantizer(bits=2, layout="kivi", token_group=4)]


@pytest.mark.parametrize("q", DEFERRED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_caller_flags_defer_the_error_to_check_flags(q, bad):
    """With ``flags`` the kernels only record bad input; check_flags raises it later."""
    from kvcompose.ops.checks import check_flags, new_flags
    from kvcompose.ops.quant_fp8 import _fp8_quantize_kernel
    from kvcompose.ops.triton_shim import interpreted

    if not interpreted(_fp8_quantize_kernel):
        pytest.skip("kernels were defined without TRITON_INTERPRET=1")
    x = x_of(torch.float32)
    flags = new_flags(x.device)
    good = q.quantize(x, role="key", flags=flags)  # no error recorded: nothing raised
    check_flags(flags)
    assert all(torch.equal(a, b) for a, b in
               zip(good.tensors().values(), q.quantize(x, role="key", backend="torch").tensors().values()))
    x[5, 0, 3] = bad
    q.quantize(x, role="key", flags=flags)  # recorded, not raised
    with pytest.raises(ValueError, match="^test: a call since the last check got NaN/inf input"):
        check_flags(flags, "test")
    with pytest.raises(ValueError, match=r"flags must be a one-element int32 tensor on cpu .* got torch.int64"):
        q.quantize(x, role="key", flags=torch.zeros(1, dtype=torch.int64))


def _bad_value_in_every_position(device):
    """With the head scale fixed only the quantize kernel sees the values: a NaN or inf anywhere
    in a block, group or row (first/last element, either half of a 16-value block) is caught."""
    quantizers = [FP8Quantizer(), NVFP4Quantizer(), TernaryQuantizer(), IntQuantizer(bits=4),
                  IntQuantizer(bits=2, layout="kivi", token_group=4)]
    for q in quantizers:
        x = x_of(torch.float32).to(device)
        hs = q.quantize(x, role="key").head_scale
        for pos in (0, 7, 8, 15, D - 1):
            for bad in (float("nan"), float("-inf")):
                y = x.clone()
                y[N - 1, H - 1, pos] = bad
                with pytest.raises(ValueError, match="NaN/inf"):
                    q.quantize(y, role="key", head_scale=hs)


def test_bad_value_in_every_position_is_caught():
    _bad_value_in_every_position("cpu")


@pytest.mark.gpu
@pytest.mark.gpu
def test_bad_value_in_every_position_is_caught_cuda():
    _bad_value_in_every_position("cuda")


LAUNCH_SHAPES = [  # (ops module, launch constant, values): the kernels must stay exact at every tile shape
    ("quant_fp8", "QUANT_TILE", [2048, 4096, 8192]), ("quant_fp8", "DEQUANT_TILE", [2048, 8192]),
    ("quant_nvfp4", "TILE_BLOCKS", [64, 128, 256]), ("quant_nvfp4", "QUANT_WARPS", [1, 2, 4]),
    ("quant_nvfp4", "DEQUANT_TILE_BLOCKS", [256, 1024]),
    ("quant_ternary", "QUANT_TILE", [64, 128, 256]), ("quant_ternary", "QUANT_WARPS", [2, 4]),
    ("quant_int", "TOKEN_QUANT", [(1024, 1), (2048, 1), (4096, 4)]),
    ("quant_int_channel", "CHANNEL_QUANT_WARPS", [1, 2, 4]), ("quant_int_channel", "CHANNEL_QUANT_CHUNK", [32, 8, 4]),
    ("quant_int_channel", "CHANNEL_DEQUANT", [(2048, 1), (4096, 4)]),
]


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("module, name, values", LAUNCH_SHAPES)
def test_cuda_kernels_match_reference_at_every_launch_shape(module, name, values, monkeypatch):
    import importlib

    mod = importlib.import_module(f"kvcompose.ops.{module}")
    quantizers = {"quant_fp8": [FP8Quantizer()], "quant_nvfp4": [NVFP4Quantizer()], "quant_ternary": [TernaryQuantizer()],
                  "quant_int": [IntQuantizer(bits=4), IntQuantizer(bits=2, layout="kivi", token_group=32)],
                  "quant_int_channel": [IntQuantizer(bits=2, layout="kivi", token_group=32)]}[module]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    for value in values:
        monkeypatch.setattr(mod, name, value)
        for q in quantizers:
            for role in ("key", "value"):
                tri = q.quantize(x, role=role, backend="triton")
                ref = q.quantize(x, role=role, backend="torch")
                for (field, a), b in zip(tri.tensors().items(), ref.tensors().values()):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, value, field)
                assert torch.equal(q.dequantize(tri, torch.bfloat16, backend="triton"),
                                   q.dequantize(ref, torch.bfloat16, backend="torch")), (name, value)


@pytest.mark.parametrize("q", [FP8Quantizer(), NVFP4Quantizer(), TernaryQuantizer()])
def test_per_token_head_scales(q):
    """A head scale may be [N, H] (one per token and head): kernel == reference, and a scale
    that repeats one row per token gives the per-head result bit for bit."""
    x = x_of(torch.bfloat16)
    per_head = q.quantize(x, backend="torch").head_scale
    g = torch.Generator().manual_seed(1)
    per_tok = per_head[None, :] * torch.rand(N, H, generator=g).add(0.5)
    ref = q.quantize(x, head_scale=per_tok, backend="torch")
    auto = q.quantize(x, head_scale=per_tok)  # the interpreted kernel here
    assert ref.head_scale.shape == (N, H)
    for a, b in zip(auto.tensors().values(), ref.tensors().values()):
        assert torch.equal(a, b)
    assert torch.equal(q.dequantize(auto, torch.float32), q.dequantize(ref, torch.float32, backend="torch"))
    # row t is coded under its own scale, exactly as if it were quantized alone with it
    t = 5
    alone = q.quantize(x[t:t + 1], head_scale=per_tok[t], backend="torch")
    for name, v in alone.token_tensors().items():
        if v.dim() == 3:
            assert torch.equal(v[0], ref.tensors()[name][t]), name
    same = q.quantize(x, head_scale=per_head.expand(N, H), backend="torch")
    plain = q.quantize(x, head_scale=per_head, backend="torch")
    for (name, a), b in zip(same.tensors().items(), plain.tensors().values()):
        if a.dim() == 3:
            assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=rf"head scale must be a tensor of shape \({H},\) .* or \({N}, {H}\)"):
        q.quantize(x, head_scale=torch.ones(N + 1, H))
