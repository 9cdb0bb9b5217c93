"""One launch that rotates a decode step's queries, keys and values (or its attention output).

A rotation of the stored keys and values (:mod:`kvcompose.rotations`) costs four products per
layer and step, and in torch ops each one is two kernels (a sign flip, then the product).
For the Hadamard rotation with random signs, every KV head's matrix is one shared ``[D, D]``
matrix up to the signs of its rows or columns (:class:`~kvcompose.rotations.SignedProduct`),
so one program per (row, KV head) can take the group's query heads, the key and the value
as the rows of one tile, flip their signs and multiply them by the shared matrix on the
tensor cores: the queries, keys and values of a step in one launch, the output in another.
"""

from __future__ import annotations

import torch

from .dispatch import step_kernel_runs
from .layout import OUT_KINDS, store_out_tl
from .triton_shim import interpreted, jit, next_pow2, tl


#: The largest matrix a program of the kernel holds (shared memory, with room to spare on sm_80+).
MATRIX_BYTES = 64 * 1024


@jit
def _rotate_rows_kernel(x0_ptr, x1_ptr, x2_ptr, o0_ptr, o1_ptr, o2_ptr, sign_ptr, m_ptr,
                        s0b, s0h, s1b, s1h, s2b, s2h,
                        H: tl.constexpr, G0: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr,
                        D: tl.constexpr, R: tl.constexpr, SIGNS_FIRST: tl.constexpr, OUT: tl.constexpr,
                        LOW: tl.constexpr):
    """Rows of one (row ``b``, KV head ``h``): ``G0`` heads of tensor 0, then ``G1`` of tensor 1
    and ``G2`` of tensor 2 (0: absent), padded to ``R`` rows; each row times ``diag(s_h) M``
    (``SIGNS_FIRST``) or ``M diag(s_h)``. Inputs at any (batch, head) strides, channels at unit
    stride; outputs contiguous ``[B, H * G, D]`` of kind ``OUT`` (:func:`~kvcompose.ops.layout.store_out_tl`).
    The matrix is ``±1`` (or ``±1/D``), so each product is exact and only the fp32 sums round, as
    in the torch product: on the tensor cores in the inputs' 16-bit dtype (``LOW``, where the
    sign flip is exact too), else in fp32 without TF32."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    r = tl.arange(0, R)
    d = tl.arange(0, D)
    in0 = r < G0
    x = tl.load(x0_ptr + b * s0b + (h * G0 + r)[:, None] * s0h + d[None, :], mask=in0[:, None], other=0.0
                ).to(tl.float32)
    in1 = (r >= G0) & (r < G0 + G1)
    in2 = (r >= G0 + G1) & (r < G0 + G1 + G2)
    if G1 > 0:
        x += tl.load(x1_ptr + b * s1b + (h * G1 + r - G0)[:, None] * s1h + d[None, :], mask=in1[:, None],
                     other=0.0).to(tl.float32)
    if G2 > 0:
        x += tl.load(x2_ptr + b * s2b + (h * G2 + r - G0 - G1)[:, None] * s2h + d[None, :], mask=in2[:, None],
                     other=0.0).to(tl.float32)
    signs = tl.load(sign_ptr + h * D + d).to(tl.float32)
    if SIGNS_FIRST:
        x = x * signs[None, :]
    m = tl.load(m_ptr + d[:, None] * D + d[None, :])
    if LOW:
        y = tl.dot(x.to(m.dtype), m)
    else:
        y = tl.dot(x, m.to(tl.float32), input_precision="ieee")
    if not SIGNS_FIRST:
        y = y * signs[None, :]
    store_out_tl(o0_ptr + ((b * H + h) * G0 + r)[:, None] * D + d[None, :], y, in0[:, None], OUT)
    if G1 > 0:
        store_out_tl(o1_ptr + ((b * H + h) * G1 + r - G0)[:, None] * D + d[None, :], y, in1[:, None], OUT)
    if G2 > 0:
        store_out_tl(o2_ptr + ((b * H + h) * G2 + r - G0 - G1)[:, None] * D + d[None, :], y, in2[:, None], OUT)


def rotate_rows_fits(tensors: list[torch.Tensor], signs: torch.Tensor, backend: str | None = None) -> bool:
    """Whether :func:`rotate_rows` takes these: decode shapes ``[B, H * G, 1, D]`` (at most three
    tensors, one dtype), a power-of-two head dim of at least 16 whose matrix fits
    :data:`MATRIX_BYTES`, and a device the kernel runs on."""
    x = tensors[0]
    D, H = x.shape[-1], signs.shape[0]
    shapes = all(t.dim() == 4 and t.shape[2] == 1 and t.shape[0] == x.shape[0] and t.shape[3] == D
                 and t.shape[1] % H == 0 and t.dtype == x.dtype and t.stride(3) == 1 for t in tensors)
    # each program holds the [D, D] matrix in shared memory (D = 128: 64 KiB in fp32, 32 KiB in bf16)
    small = D * D * (4 if x.dtype == torch.float32 else 2) <= MATRIX_BYTES
    fits = shapes and len(tensors) <= 3 and D == next_pow2(D) and D >= 16 and x.dtype in OUT_KINDS and small
    return fits and step_kernel_runs(x, _rotate_rows_kernel, backend)


def rotate_rows(tensors: list[torch.Tensor], signs: torch.Tensor, matrix: torch.Tensor, signs_first: bool
                ) -> list[torch.Tensor]:
    """Each ``[B, H * G, 1, D]`` tensor's rows times their KV head's ``diag(signs[h]) @ matrix``
    (``signs_first``) or ``matrix @ diag(signs[h])``, in one launch (see :func:`rotate_rows_fits`):
    what :func:`kvcompose.rotations.rotate` computes with a
    :class:`~kvcompose.rotations.SignedProduct`, up to the order of the fp32 sums."""
    B, D, H = tensors[0].shape[0], tensors[0].shape[-1], signs.shape[0]
    groups = [t.shape[1] // H for t in tensors] + [0] * (3 - len(tensors))
    dtype = tensors[0].dtype
    kind = OUT_KINDS[dtype]
    outs = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in tensors]
    x = tensors + [tensors[0]] * (3 - len(tensors))  # absent tensors: never read (G = 0)
    o = [out.view(torch.int16) if kind == 1 else out for out in outs]  # bf16 is written as its bits
    o += [o[0]] * (3 - len(o))
    _rotate_rows_kernel[(B * H,)](
        *x, *o, signs.to(dtype).contiguous(), matrix.to(dtype).contiguous(),
        x[0].stride(0), x[0].stride(1), x[1].stride(0), x[1].stride(1), x[2].stride(0), x[2].stride(1),
        H=H, G0=groups[0], G1=groups[1], G2=groups[2], D=D, R=max(16, next_pow2(sum(groups))),
        SIGNS_FIRST=signs_first, OUT=kind, LOW=kind != 0 and not interpreted(_rotate_rows_kernel), num_warps=4)
    return outs
