"""The per-head scale of the two-level formats (fp8, nvfp4, ternary): ``amax / divisor``, 1 for a zero head.

:func:`head_scale` applies the rule to an amax from :func:`kvcompose.ops.checks.check_input`.
On the kernel path one Triton pass finds the per-head amax (:func:`head_amax_triton`)
instead of torch's two reductions, and one tiny kernel turns it into the scale
(:func:`head_scale_triton`).
"""

from __future__ import annotations

import torch

from .checks import new_flags
from .triton_shim import LAUNCH_OPTS, cdiv, jit, next_pow2, tl


def head_scale(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """Per-head scale ``amax / divisor`` (``amax`` from :func:`check_input`); 1 where that is 0.

    A zero quotient means an all-zero head (or one so tiny the quotient underflows);
    scale 1 keeps every later division finite and still encodes zeros exactly.
    """
    s = amax / torch.full_like(amax, divisor)  # a tensor divisor: CUDA turns scalar division into a reciprocal multiply
    return torch.where(s > 0, s, torch.ones_like(s))


def head_amax_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head ``max |x|`` (fp32 ``[H]``) of contiguous ``x`` in one pass, and a zeroed error flag.

    NaN/inf propagate (as bit patterns above +inf's), so the scale computed from the
    amax is not trusted: the quantize kernel flags non-finite input anyway.
    """
    n, h, d = x.shape
    buf = new_flags(x.device, extra=h)
    if x.numel():
        tok, bd, hb = _amax_tile(h, d)
        per_prog = max(tok, cdiv(cdiv(n, AMAX_PROGRAMS), tok) * tok)
        _head_amax_kernel[(cdiv(n, per_prog),)](
            x, buf, n, per_prog, H=h, D=d, HB=hb, BD=bd, TOK=tok, num_warps=4, **LAUNCH_OPTS
        )
    return buf[:h].view(torch.float32), buf[h:]


def head_scale_triton(x: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_scale` of the per-head amax of ``x``, and a zeroed error flag, in two launches.

    The rule is applied by a one-program kernel: as five small torch ops it cost a few
    microseconds of launches, a sixth of a 32k-token quantize call on an H200.
    """
    amax, own = head_amax_triton(x)
    scale = torch.empty_like(amax)
    h = amax.numel()
    _head_scale_kernel[(1,)](amax, scale, h, DIVISOR=float(divisor), HB=next_pow2(h), num_warps=1, **LAUNCH_OPTS)
    return scale, own


AMAX_PROGRAMS = 1024  # programs of the amax pass (each loops over its share of tokens)


def _amax_tile(h: int, d: int) -> tuple[int, int, int]:
    hb, bd = next_pow2(h), next_pow2(d)
    return max(1, 4096 // (hb * bd)), bd, hb


@jit
def _head_amax_kernel(x_ptr, amax_ptr, n, per_prog, H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr,
                      BD: tl.constexpr, TOK: tl.constexpr):
    # amax_ptr: int32 [H]; |x| as fp32 bit patterns, whose integer order is the float order (NaN above inf).
    t0 = tl.program_id(0).to(tl.int64) * per_prog
    t = tl.arange(0, TOK)[:, None, None]
    h = tl.arange(0, HB)[None, :, None]
    d = tl.arange(0, BD)[None, None, :]
    acc = tl.zeros([TOK, HB, BD], dtype=tl.int32)
    end = tl.minimum(t0 + per_prog, n)
    for start in range(t0, end, TOK):
        tok = start + t
        m = (tok < end) & (h < H) & (d < D)
        v = tl.load(x_ptr + (tok * H + h) * D + d, mask=m, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    hm = tl.max(tl.max(acc, axis=2), axis=0)
    hh = tl.arange(0, HB)
    tl.atomic_max(amax_ptr + hh, hm, mask=hh < H)


@jit
def _head_scale_kernel(amax_ptr, scale_ptr, H, DIVISOR: tl.constexpr, HB: tl.constexpr):
    # head_scale(): IEEE division, then 1 where the quotient is not > 0 (zero, or NaN from a NaN amax)
    h = tl.arange(0, HB)
    s = tl.div_rn(tl.load(amax_ptr + h, mask=h < H, other=0.0), tl.full([HB], DIVISOR, tl.float32))
    tl.store(scale_ptr + h, tl.where(s > 0.0, s, 1.0), mask=h < H)
