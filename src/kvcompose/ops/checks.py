"""Input checks of the quantization ops, and the error flags their kernels set.

Input checks on the kernel path cost no extra pass and one host synchronization:
shape and dtype are checked on the host, while NaN/inf values, a non-positive or
non-finite head scale and (INT with fp16 scales) values beyond the fp16 range are
detected inside the quantize kernel, which sets bits of a one-element flag tensor
(:data:`FLAG_NONFINITE`, :data:`FLAG_BAD_SCALE`, :data:`FLAG_RANGE`). The op reads the
flag once after the launch and raises the same errors as the torch path
(:func:`raise_on_flags`); a caller that passes its own flag tensor (``flags=``, from
:func:`new_flags`) gets no synchronization at all and raises later with
:func:`check_flags`. NaN/inf are found from each block's or group's amax or extremes,
computed with NaN-propagating reductions the format needs anyway.
"""

from __future__ import annotations

import torch

from .numerics import max_keep_nan_tl
from .triton_shim import jit, tl


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


#: Error bits a quantize kernel sets in its flag tensor (see :func:`raise_on_flags`).
FLAG_NONFINITE = 1  # a NaN/inf input value
FLAG_BAD_SCALE = 2  # a head scale that is not finite and > 0
FLAG_RANGE = 4  # INT with fp16 scales: |x| beyond the float16 range


def check_input(x: torch.Tensor, fmt: str, head_dim_multiple: int = 1) -> torch.Tensor:
    """Validate ``x`` and return its per-head amax (fp32 ``[H]``), which the scales need anyway.

    Raises a ValueError naming ``fmt`` for a bad shape, dtype or head dim, or for
    NaN/inf values (they propagate into the amax, so one pass finds them).
    """
    check_shape(x, fmt, head_dim_multiple)
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    x = x.detach()
    # max(amax, -amin) reads x twice but writes no |x| temporary; NaN and inf propagate.
    amax = torch.maximum(x.amax(dim=(0, 2)), x.amin(dim=(0, 2)).neg()).to(torch.float32)
    if not bool(torch.isfinite(amax).all()):
        check_finite(x, fmt)
    return amax


def check_shape(x: torch.Tensor, fmt: str, head_dim_multiple: int = 1) -> None:
    """The host-side part of :func:`check_input`: type, ``[N, H, D]`` shape, dtype, head dim (no pass over ``x``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fmt}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(
            f"{fmt}: expected x of shape [N, H, D] (tokens, KV heads, head dim), got shape {tuple(x.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES:
        accepted = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise ValueError(f"{fmt}: unsupported dtype {x.dtype}; accepted dtypes: {accepted}")
    d = x.shape[-1]
    if d == 0 or d % head_dim_multiple:
        raise ValueError(f"{fmt}: head_dim {d} is not a positive multiple of {head_dim_multiple}")


def check_finite(x: torch.Tensor, fmt: str) -> None:
    """Quantizing NaN/inf would silently poison a whole block's scale; refuse instead."""
    bad = int((~torch.isfinite(x)).sum().item())
    if bad:
        raise ValueError(f"{fmt}: input has {bad} NaN/inf value(s) out of {x.numel()}; cannot quantize")


def check_head_scale(scale: torch.Tensor, x: torch.Tensor, fmt: str, values: bool = True) -> torch.Tensor:
    """Validate a caller-provided head scale: ``[H]`` (one per KV head) or ``[N, H]`` (one per
    token and head, e.g. a per-sequence scale spread over a batch's tokens), finite, positive;
    returned as contiguous fp32.

    ``values=False`` checks only the shape (no host synchronization): the kernels
    check the values themselves (:data:`FLAG_BAD_SCALE`).
    """
    check_scale_shape(scale, x.shape[0], x.shape[1], fmt, "head scale")
    scale = scale.detach().to(device=x.device, dtype=torch.float32).contiguous()
    if values and not (torch.isfinite(scale) & (scale > 0)).all():
        bad_head_scale(scale, fmt)
    return scale


def check_scale_shape(scale, n: int, h: int, fmt: str, what: str) -> None:
    """A second-level scale is ``[H]`` or ``[N, H]``; anything else is named in the error."""
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) not in ((h,), (n, h)):
        shape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{fmt}: {what} must be a tensor of shape ({h},) (one per KV head) or ({n}, {h}) "
                         f"(one per token and head), got {shape}")


def bad_head_scale(scale: torch.Tensor, fmt: str):
    raise ValueError(f"{fmt}: head scale must be finite and > 0, got {scale.tolist()}")


def new_flags(device, extra: int = 0) -> torch.Tensor:
    """Zeroed int32 tensor: ``extra`` leading slots (e.g. an amax buffer), then the error flag."""
    return torch.zeros(extra + 1, dtype=torch.int32, device=device)


def raise_on_flags(flags: torch.Tensor, x: torch.Tensor, fmt: str, scale: torch.Tensor | None = None) -> None:
    """Read a kernel's error flag (one host synchronization) and raise what the torch path would.

    NaN/inf input first (with its count), then a bad head scale; :data:`FLAG_RANGE`
    is left to the caller (its message depends on the format), so it is returned
    through :func:`flag_bits` instead.
    """
    bits = flag_bits(flags)
    if bits & FLAG_NONFINITE:
        check_finite(x, fmt)
        raise ValueError(f"{fmt}: input has NaN/inf value(s); cannot quantize")  # pragma: no cover - counted above
    if bits & FLAG_BAD_SCALE and scale is not None:
        bad_head_scale(scale, fmt)


def check_flag_tensor(flags: torch.Tensor, x: torch.Tensor) -> None:
    """A caller-owned error flag must be a one-element int32 tensor on ``x``'s device."""
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.int32 or flags.numel() != 1 \
            or flags.device != x.device:
        got = f"{flags.dtype} {tuple(flags.shape)} on {flags.device}" if isinstance(flags, torch.Tensor) else flags
        raise ValueError(f"flags must be a one-element int32 tensor on {x.device} (see new_flags), got {got}")


def check_flags(flags: torch.Tensor, what: str = "quantize") -> None:
    """Raise for the errors quantize calls with caller-owned ``flags`` recorded (one host synchronization).

    The deferred form of the checks: those calls did not synchronize, so the offending
    input is no longer at hand and the message names the error kinds only.
    """
    bits = flag_bits(flags)
    if not bits:
        return
    kinds = [name for bit, name in ((FLAG_NONFINITE, "NaN/inf input"), (FLAG_BAD_SCALE, "a head scale that is not "
             "finite and > 0"), (FLAG_RANGE, "values beyond the float16 range of INT scales")) if bits & bit]
    raise ValueError(f"{what}: a call since the last check got {' and '.join(kinds)}; its result is not valid")


def flag_bits(flags: torch.Tensor) -> int:
    return int((flags if flags.numel() == 1 else flags[-1]).item())


@jit
def bad_scale_tl(s):
    """FLAG_BAD_SCALE (2) where a head scale is not finite and > 0, else 0."""
    return tl.where((s > 0.0) & (s <= 3.4028234663852886e38), 0, 2)


@jit
def set_flag_tl(flag_ptr, bits):
    """OR ``bits`` (a scalar or a tensor of error bits) into the flag; predicated off where 0, so
    good input issues no memory traffic and needs no reduction across the program."""
    tl.atomic_or(flag_ptr + tl.zeros_like(bits), bits, mask=bits != 0)


@jit
def amax_tl(x, axis: tl.constexpr, KEEP: tl.constexpr):
    """``max |x|`` along ``axis``; NaN propagates (plain ``tl.max`` may drop it), so the amax
    doubles as the NaN/inf check (:func:`nonfinite_tl`) at no extra cost per value."""
    return max_keep_nan_tl(tl.abs(x), axis, KEEP)


@jit
def nonfinite_tl(amax):
    """FLAG_NONFINITE (1) where an amax from :func:`amax_tl` is NaN or inf, else 0."""
    return tl.where(amax <= 3.4028234663852886e38, 0, 1)
