"""Test data and checks shared by the per-format quantization op tests."""

import pytest
import torch

from kvcompose.ops.triton_shim import HAS_TRITON, interpreted

gpu = pytest.mark.gpu  # conftest skips it without a GPU or with interpreted kernels


def needs_interpreter(kernel):
    """Skip unless ``kernel`` runs on CPU through the Triton interpreter."""
    return pytest.mark.skipif(
        not HAS_TRITON or not interpreted(kernel),
        reason="kvcompose kernels were defined without TRITON_INTERPRET=1 (set it before kvcompose is imported)",
    )


def make(kind, shape, dtype=torch.float32, seed=0, octaves=(-20, 8)):
    """Random ``[N, H, D]`` input: ``gauss``; ``outlier`` (one channel 20x larger, as in real keys);
    ``wide`` (exponents over ``octaves``, plus zero blocks); ``ties`` (few distinct magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "outlier":
        x[:, :, 3] *= 20
    elif kind == "wide":
        x = x * torch.exp2(torch.randint(*octaves, shape, generator=g).float())
        x[::3, :, :16] = 0
    elif kind == "ties":
        x = torch.randint(-2, 3, shape, generator=g).float() * 0.5
    return x.to(dtype)


def rel_err(x, y):
    return ((x.float() - y.float()).norm() / x.float().norm()).item()


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def backends_agree(quantize, dequantize, x, *args):
    """Quantize ``x`` with the torch reference and the Triton kernel, and dequantize the
    reference's tensors with both: each pair agrees bit for bit. Returns the reference's tensors."""
    ref = quantize(x, *args, backend="torch")
    tri = quantize(x, *args, backend="triton")
    assert all(same_bits(a, b) for a, b in zip(ref, tri, strict=True))
    assert same_bits(dequantize(*ref, backend="torch"), dequantize(*ref, backend="triton"))
    return ref
