"""The one-launch rotation of a decode step's queries, keys and values (ops/rotate_rows.py):
kernel == the torch rotation (kvcompose.rotations.rotate) with the same SignedProduct."""

import pytest
import torch

from kvcompose.ops.rotate_rows import rotate_rows, rotate_rows_fits
from kvcompose.rotations import HadamardRotation, SignedProduct, rotate
from kvcompose.runtime.layer import _exact_form

B, H, D = 3, 2, 64


def signed_product(dtype, device="cpu", back=False) -> SignedProduct:
    forward, inverse, _ = _exact_form(HadamardRotation().matrices(1, H, D), dtype, device)
    return inverse if back else forward


def step_tensors(group, dtype, device="cpu"):
    """Queries, keys and values as a model hands them over: views with the heads second."""
    g = torch.Generator().manual_seed(group)
    q = torch.randn(B, 1, H * group, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, H, 1, D, generator=g).to(dtype)
    return [t.to(device) for t in (q, k, v)]


def check(tensors, product):
    got = rotate_rows(tensors, product.signs, product.matrix, product.signs_first)
    dtype = tensors[0].dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for t, out in zip(tensors, got):
        want = rotate(t, product)
        assert out.shape == t.shape and out.dtype == dtype and out.is_contiguous()
        torch.testing.assert_close(out.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_keys_and_values_in_one_launch(group, dtype):
    assert rotate_rows_fits(step_tensors(group, dtype), signed_product(dtype).signs, backend="triton")
    check(step_tensors(group, dtype), signed_product(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_output_turned_back(dtype):
    out = step_tensors(4, dtype)[0].contiguous()
    check([out], signed_product(dtype, back=True))  # signs after the product, the matrix over D
    forward, back = signed_product(dtype), signed_product(dtype, back=True)
    there = rotate_rows([out], forward.signs, forward.matrix, forward.signs_first)[0]
    again = rotate_rows([there], back.signs, back.matrix, back.signs_first)[0]
    torch.testing.assert_close(again, out, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-3)


@pytest.mark.parametrize("signs_first", [True, False])
def test_any_shared_matrix_and_signs(signs_first):
    """Not only the (symmetric) Hadamard matrix: a random one, random signs per KV head."""
    g = torch.Generator().manual_seed(11)
    product = SignedProduct(torch.randint(0, 2, (H, D), generator=g).float() * 2 - 1,
                            torch.randn(D, D, generator=g), signs_first)
    check(step_tensors(3, torch.float32), product)


def test_what_the_launch_does_not_take_goes_to_torch():
    signs = signed_product(torch.float32).signs
    q, k, v = step_tensors(4, torch.float32)
    assert not rotate_rows_fits([q, k, v], signs)  # CPU tensors: the kernel runs on CUDA unless forced
    assert rotate_rows_fits([q, k, v], signs, backend="triton") and not rotate_rows_fits([q, k, v], signs, "torch")
    assert not rotate_rows_fits([torch.randn(B, H, 5, D)], signs, backend="triton")  # a prefill's tokens
    assert not rotate_rows_fits([q, k.double(), v], signs, backend="triton")  # one dtype per launch
    assert not rotate_rows_fits([q, k, v, v], signs, backend="triton")  # three tensors at most
    wide = torch.randn(B, H, 1, 256)
    assert not rotate_rows_fits([wide], torch.ones(H, 256), backend="triton")  # its fp32 matrix: 256 KiB
    assert not rotate_rows_fits([wide.bfloat16()], torch.ones(H, 256), backend="triton")  # and in bf16: 128 KiB
    assert rotate_rows_fits([q.bfloat16(), k.bfloat16()], signs, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_the_torch_rotation(group, dtype):
    tensors = step_tensors(group, dtype, "cuda")
    assert rotate_rows_fits(tensors, signed_product(dtype, "cuda").signs)
    check(tensors, signed_product(dtype, "cuda"))
    check([tensors[0].contiguous()], signed_product(dtype, "cuda", back=True))
