"""Shared pieces of the quantization ops: input checks, E4M3/E2M1 rounding, packing, dispatch.

Every format module has a Triton kernel and a plain-torch reference that must agree
bit for bit. The rounding steps below are therefore written as integer and
correctly-rounded float arithmetic (add, subtract, multiply, IEEE division,
comparisons, bit casts) with one version in torch and one as ``@triton.jit``
helpers, instead of hardware float8 casts. That keeps results identical on CPU, in
the Triton interpreter and on any CUDA GPU (Triton cannot cast to E4M3 below sm_89),
and the E4M3 helper is tested against ``torch.float8_e4m3fn`` casts. One exception:
on GPUs that have an E4M3 conversion instruction (sm_89+) the fp8 kernels use it
(:func:`e4m3_encode_hw_tl`; round to nearest even, the same codes, checked against
the reference by the GPU tests); ``KVCOMPOSE_HW_E4M3=0`` turns that off.

Two compiler details matter for bit-exactness on GPU and are handled here once:
Triton's ``/`` lowers to an approximate division, so kernels use ``tl.div_rn``; and
ptxas fuses ``a * b + c`` into an FMA (one rounding instead of two), so every launch
passes :data:`LAUNCH_OPTS` (``enable_fp_fusion=False``). Signs are set through the
bit pattern, never by negation (Triton 3.6 compiles ``-x`` as ``0 - x``, losing -0.0).

Tensors in these ops are ``[N, H, D]``: N tokens, H KV heads, D head dim. Kernels
read fp16/bf16/fp32 input and compute in fp32. Dequantize kernels write the caller's
dtype directly (:func:`store_out_tl`): fp32 as is, fp16 through Triton's
round-to-nearest cast, bf16 through an integer round-to-nearest-even of the fp32 bit
pattern (the interpreter's own bf16 cast truncates), each equal to torch's ``.to()``.

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

Values are never divided one by one: a kernel takes the correctly rounded reciprocal of
each scale once (:func:`recip_tl`, :func:`reciprocal`) and multiplies, because a
division per value costs more than moving the value through memory. When the per-head
scale must be computed from ``x``, one Triton pass finds the per-head amax
(:func:`head_amax_triton`) instead of torch's two reductions, and one tiny kernel turns it
into the scale (:func:`head_scale_triton`).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships for Linux only; the torch references work everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on platforms without triton
    triton = None
    tl = None

HAS_TRITON = triton is not None

#: Keyword arguments for every kernel launch (ignored by the interpreter).
LAUNCH_OPTS = {"enable_fp_fusion": False}

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
#: Magnitudes of the eight E2M1 codes 0..7 (bit 3 of a nibble is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("triton", "torch")

#: Error bits a quantize kernel sets in its flag tensor (see :func:`raise_on_flags`).
FLAG_NONFINITE = 1  # a NaN/inf input value
FLAG_BAD_SCALE = 2  # a head scale that is not finite and > 0
FLAG_RANGE = 4  # INT with fp16 scales: |x| beyond the float16 range
#: Output kinds of the dequantize kernels (``OUT`` constexpr of :func:`store_out_tl`).
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def jit(fn):
    """``triton.jit`` when Triton is installed; otherwise a stub that refuses to launch."""
    if HAS_TRITON:
        return triton.jit(fn)
    return _NoTriton(fn.__name__)


class _NoTriton:
    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):  # pragma: no cover - only without triton
        raise RuntimeError(f"Triton is not installed; kernel {self.name} cannot run (use backend='torch')")


# ---------------------------------------------------------------------------
# Input checks and dispatch


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


def per_token(scale: torch.Tensor) -> torch.Tensor:
    """A ``[H]`` or ``[N, H]`` scale as ``[1 or N, H, 1]``, ready to broadcast over ``[N, H, D]``."""
    return scale.reshape(-1, scale.shape[-1])[:, :, None]


def token_stride(scale: torch.Tensor) -> int:
    """Token stride of a contiguous ``[H]`` or ``[N, H]`` scale: 0 (per head) or H."""
    return 0 if scale.dim() == 1 else scale.shape[1]


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


def quantize_two_level(x, scale, backend, flags, *, fmt: str, divisor: float, multiple: int, kernel, reference,
                       launch):
    """Dispatch shared by the formats with an fp32 per-head scale (fp8, nvfp4, ternary).

    Returns ``(codes, scale)`` (codes: whatever ``reference(x, scale)`` / ``launch(x, scale,
    flags)`` return). Torch path: every check first. Kernel path: one pass over ``x``
    (two when the scale comes from ``x``), errors found by the kernel; with ``flags=None``
    they are raised at once (one host synchronization), with a caller-owned ``flags``
    tensor they are only recorded there (no synchronization, CUDA-graph safe) and
    :func:`check_flags` raises them later.
    """
    check_shape(x, fmt, multiple)
    if not use_triton(x, kernel, backend):
        amax = check_input(x, fmt, multiple)
        scale = head_scale(amax, divisor) if scale is None else check_head_scale(scale, x, fmt)
        return reference(x, scale), scale
    x = x.detach().contiguous()
    if flags is not None:
        check_flag_tensor(flags, x)
    if scale is None:
        scale, own = head_scale_triton(x, divisor)
    else:
        scale = check_head_scale(scale, x, fmt, values=x.numel() == 0)
        own = new_flags(x.device) if flags is None else None
    codes = launch(x, scale, own if flags is None else flags)
    if flags is None:
        raise_on_flags(own, x, fmt, scale)
    return codes, scale


def dequantize_block_scaled(codes, block_scales, s2, dtype, backend, *, fmt: str, codes_per_byte: int, kernel,
                            reference, launch) -> torch.Tensor:
    """Checks and dispatch shared by the decoders of NVFP4 and ternary (codes ``[N, H, D / codes_per_byte]``,
    E4M3 block scales ``[N, H, D/16]``, ``s2`` ``[H]`` or ``[N, H]``)."""
    per_block = 16 // codes_per_byte  # code bytes per 16-value block
    if codes.dtype != torch.uint8 or codes.dim() != 3 or codes.shape[2] % per_block:
        raise ValueError(f"{fmt}: codes must be uint8 [N, H, D/{codes_per_byte}] with D % 16 == 0, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    n, h = codes.shape[:2]
    expected = (n, h, codes.shape[2] // per_block)
    if block_scales.shape != expected or block_scales.dtype != torch.uint8:
        raise ValueError(f"{fmt}: block_scales must be uint8 {expected}, got {tuple(block_scales.shape)}")
    check_scale_shape(s2, n, h, fmt, "s2")
    s2 = s2.to(torch.float32).contiguous()
    if use_triton(codes, kernel, backend):
        out = launch(codes, block_scales, s2, dtype)
    else:
        out = reference(codes, block_scales, s2)
    return out.to(dtype)


def flag_bits(flags: torch.Tensor) -> int:
    return int((flags if flags.numel() == 1 else flags[-1]).item())


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


def head_scale(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """Per-head scale ``amax / divisor`` (``amax`` from :func:`check_input`); 1 where that is 0.

    A zero quotient means an all-zero head (or one so tiny the quotient underflows);
    scale 1 keeps every later division finite and still encodes zeros exactly.
    """
    s = amax / torch.full_like(amax, divisor)  # a tensor divisor: CUDA turns scalar division into a reciprocal multiply
    return torch.where(s > 0, s, torch.ones_like(s))


def use_triton(x: torch.Tensor, kernel, backend: str | None) -> bool:
    """Pick the implementation: Triton for CUDA tensors or an interpreted kernel, else torch.

    ``TRITON_INTERPRET=1`` is read by ``triton.jit`` when a module is imported, so the
    kernel object itself says whether it can run on CPU tensors.
    """
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; accepted: None (auto), 'triton', 'torch'")
    if backend == "torch":
        return False
    runnable = HAS_TRITON and (x.is_cuda or interpreted(kernel))
    if backend == "triton" and not runnable:
        why = "Triton is not installed" if not HAS_TRITON else "x is not on CUDA and kernels are not interpreted"
        raise RuntimeError(
            f"backend='triton' cannot run: {why} (set TRITON_INTERPRET=1 before importing kvcompose to run on CPU)"
        )
    return runnable


def step_kernel_runs(x: torch.Tensor, kernel, backend: str | None, fits: bool = True) -> bool:
    """Dispatch of the ops that run every decode step (paged attention, in-place eviction):
    ``backend=None`` picks the kernel on CUDA only (``fits``: the kernel takes these shapes),
    since a model's every step through the CPU interpreter would be too slow; ``"triton"``
    forces it (CUDA, or the interpreter under ``TRITON_INTERPRET=1``), ``"torch"`` the reference."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; accepted: None (auto), 'triton', 'torch'")
    if backend == "triton" and not (HAS_TRITON and (x.is_cuda or interpreted(kernel))):
        raise RuntimeError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (set before importing kvcompose)")
    if backend is None:
        return HAS_TRITON and x.is_cuda and fits
    return backend == "triton"


#: Use the GPU's own E4M3 conversion where it has one (see :func:`e4m3_encode_hw_tl`).
HW_E4M3 = os.environ.get("KVCOMPOSE_HW_E4M3", "1") != "0"


def hw_e4m3(x: torch.Tensor, kernel) -> bool:
    """Whether a kernel launched on ``x`` may convert to E4M3 in hardware (sm_89+, compiled, :data:`HW_E4M3`)."""
    if not HW_E4M3 or not x.is_cuda or interpreted(kernel) or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def interpreted(kernel) -> bool:
    """True when ``kernel`` was built by the Triton interpreter (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------
# E4M3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448,
# subnormals are multiples of 2^-9. Encoding saturates at +-448 and never produces
# the NaN codes 0x7F/0xFF.


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """Round finite fp32 values to E4M3 (nearest, ties to even, saturating) and return the bit patterns."""
    v = v.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX)
    bits = v.view(torch.int32)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: round the 23-bit fp32 mantissa to 3 bits; a carry bumps the exponent.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: multiples of 2^-9, i.e. round |v| * 512 to an integer.
    sub = rne_int(v.abs() * 512.0)
    code = torch.where(mag >= (121 << 23), normal, sub) | sign
    return code.to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) to fp32 values."""
    c = code.to(torch.int32)
    f = (c >> 3) & 0xF
    m = c & 7
    normal = (((f + 120) << 23) | (m << 20)).view(torch.float32)
    mag = torch.where(f > 0, normal, m.to(torch.float32) * E4M3_MIN_SUBNORMAL)
    return with_sign(mag, (c & 0x80) << 24)


def with_sign(mag: torch.Tensor, sign_bit: torch.Tensor) -> torch.Tensor:
    """Set the fp32 sign bit from an int32 mask (0 or 1 << 31).

    Negation is avoided on purpose: some Triton versions compile ``-x`` as ``0 - x``,
    which turns -0.0 into +0.0.
    """
    return (mag.view(torch.int32) | sign_bit).view(torch.float32)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of each fp32 value, as fp32."""
    return e4m3_decode(e4m3_encode(v))


def rne_int(w: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 values (< 2^31) to int32, ties to even; every step is exact."""
    ip = w.to(torch.int32)
    frac = w - ip.to(torch.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((ip & 1) == 1))
    return ip + up.to(torch.int32)


def reciprocal(t: torch.Tensor) -> torch.Tensor:
    """``1 / t`` correctly rounded, the reference of :func:`recip_tl` (a tensor numerator:
    CUDA turns division by a Python scalar into a multiply by an approximate reciprocal)."""
    return torch.ones_like(t) / t


def block_scale_e4m3(ratio: torch.Tensor, block_amax: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale (fp32 value) for a block whose ideal scale is ``ratio``.

    All-zero blocks get 1. A non-zero block whose scale rounds to 0 gets the smallest
    subnormal 2^-9 so that dividing by it stays finite.
    """
    bs = e4m3_round(ratio.clamp(max=E4M3_MAX))
    bs = torch.clamp(bs, min=E4M3_MIN_SUBNORMAL)
    return torch.where(block_amax > 0, bs, torch.ones_like(bs))


# ---------------------------------------------------------------------------
# E2M1 (FP4): nibble = sign bit 3 | magnitude index 0..7 -> E2M1_VALUES. Nearest
# value, ties to the code with mantissa bit 0 (the even index), saturating at 6.


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) to 4-bit E2M1 codes (uint8, 0..15).

    Midpoints 0.25, 1.25, 2.5, 5 round down (to even) and 0.75, 1.75, 3.5 round up.
    The sign bit is the sign of ``y``, so a small negative value codes as -0 (as hardware
    FP4 conversions do); both zeros decode to a zero.
    """
    a = y.abs()
    idx = (
        (a > 0.25).to(torch.int32)
        + (a >= 0.75).to(torch.int32)
        + (a > 1.25).to(torch.int32)
        + (a >= 1.75).to(torch.int32)
        + (a > 2.5).to(torch.int32)
        + (a >= 3.5).to(torch.int32)
        + (a > 5.0).to(torch.int32)
    )
    return (idx | (torch.signbit(y).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (any integer dtype, 0..15) to fp32 values."""
    c = code.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    pow2 = (1 << (e - 1).clamp(min=0)).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, pow2 * (1.0 + m * 0.5))
    return with_sign(mag, (c & 8) << 28)


# ---------------------------------------------------------------------------
# Packing: ``8 // bits`` codes per byte along the last dim, element ``c*i + j`` in
# bits ``[bits*j, bits*(j+1))`` of byte ``i`` (the first element in the lowest bits).


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``< 2**bits`` along the last dim into uint8."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes of {bits} bits into whole bytes")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., B]`` -> int32 codes ``[..., B * 8 // bits]``."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


# ---------------------------------------------------------------------------
# Triton versions of the helpers above (same operations, same order).


@jit
def e4m3_encode_tl(v):
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    sub = rne_small_tl(tl.abs(v) * 512.0)  # < 2^-6 * 512 = 8 where it is used
    return tl.where(mag >= (121 << 23), normal, sub) | sign


@jit
def e4m3_encode_hw_tl(v):
    """:func:`e4m3_encode_tl` through the hardware conversion (sm_89+: ``cvt.rn.satfinite.e4m3x2.f32``).

    Round to nearest even with saturation at +-448, the same codes for every finite
    input (the clamp first keeps it independent of how the hardware saturates).
    """
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@jit
def e4m3_decode_tl(code):
    c = code.to(tl.int32)
    f = (c >> 3) & 0xF
    m = c & 7
    normal = (((f + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(f > 0, normal, m.to(tl.float32) * 0.001953125)
    return (mag.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@jit
def rne_int_tl(w):
    ip = w.to(tl.int32)
    frac = w - ip.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((ip & 1) == 1))
    return ip + up.to(tl.int32)


@jit
def rne_small_tl(w):
    """:func:`rne_int_tl` for ``0 <= w < 2^23`` in two operations: adding 2^23 leaves a unit
    last place, so the fp32 addition itself rounds to the nearest integer, ties to even."""
    return (w + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000


@jit
def e2m1_encode_tl(y):
    """E2M1 code of ``y`` in the low 4 bits; bits 24-30 hold junk (0x4B), so keep the low
    byte (``.to(tl.uint8)``) or mask, as the packing does anyway.

    Same codes as the seven comparisons of :func:`e2m1_encode`, mostly on the FMA pipe
    (Hopper's integer/compare ALU pipe runs at half rate and bound the kernel). The index
    of ``a = |y|`` is RNE(f(a)) with the concave piecewise-linear
    ``f(a) = min(2a, a + 2, a/2 + 4, 7)``: grid spacing 0.5 below 2, 1 up to 4, 2 up to 6,
    and every midpoint lands on a half-integer whose even neighbour is the even code. RNE
    is monotone, so it is the min of RNE of each line, and ``fma(a, s, 2^23 + c)`` rounds
    a line exactly once to an integer (the unit in the last place of [2^23, 2^24) is 1):
    the fp32 pattern of the result is ``0x4B000000 + index``. The sign bit is ``y``'s (a
    small negative value gives -0), OR-ed into bit 3, which the index never sets.
    """
    a = tl.abs(y)
    c = tl.minimum(tl.fma(a, 2.0, 8388608.0), tl.fma(a, 1.0, 8388610.0))
    c = tl.minimum(tl.minimum(c, tl.fma(a, 0.5, 8388612.0)), 8388615.0)
    return c.to(tl.int32, bitcast=True) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@jit
def e2m1_decode_tl(code):
    # Built from bits instead of arithmetic: for magnitude index i = 2e + m >= 2 the value
    # 2^(e-1) * (1 + m/2) is the fp32 pattern ((i + 252) << 22) (1.0 = 254 << 22); index 1
    # is the subnormal 0.5 (0x3F000000) and 0 is 0. The same values as :func:`e2m1_decode`.
    c = code.to(tl.int32)
    i = c & 7
    mag = tl.where(i < 2, i * 0x3F000000, (i + 252) << 22)
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


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
    return tl.reduce(tl.abs(x), axis, max_nan_tl, keep_dims=KEEP)


@jit
def nonfinite_tl(amax):
    """FLAG_NONFINITE (1) where an amax from :func:`amax_tl` is NaN or inf, else 0."""
    return tl.where(amax <= 3.4028234663852886e38, 0, 1)


@jit
def block_scale_code_tl(ratio, block_amax):
    """E4M3 block scale for a block whose ideal scale is ``ratio`` (>= 0): ``(code, value)``.

    The rules of :func:`block_scale_e4m3`: round to nearest even, saturate at 448, at least
    the smallest subnormal (code 1, 2^-9), and 1.0 (code 0x38) for an all-zero block. The
    value comes out of the rounding itself instead of decoding the code (a normal value
    is the rounded fp32 pattern with its low 20 bits cleared; a subnormal one a multiple
    of 2^-9). Always integer arithmetic: the hardware conversion gave wrong codes for
    these per-block vectors at some tile shapes (Triton 3.6, H200), never for full tiles.
    """
    r = tl.minimum(ratio, 448.0)
    bits = r.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # 3 mantissa bits, ties to even
    steps = (r * 512.0 + 8388608.0) - 8388608.0  # subnormal: nearest multiple of 2^-9, ties to even
    normal = bits >= (121 << 23)  # r >= 2^-6
    code = tl.where(normal, (rounded >> 20) - (120 << 3), steps.to(tl.int32))
    value = tl.where(normal, (rounded & -1048576).to(tl.float32, bitcast=True), steps * 0.001953125)
    nonzero = block_amax > 0
    return tl.where(nonzero, tl.maximum(code, 1), 0x38), tl.where(nonzero, tl.maximum(value, 0.001953125), 1.0)


@jit
def scale_index_tl(unit0, u, PER_ROW: tl.constexpr, H: tl.constexpr, ST: tl.constexpr):
    """Offset of the scale of units ``unit0 + u`` in a ``[H]`` (``ST`` = 0) or ``[N, H]`` (``ST`` = H) scale.

    Units (rows or 16-value blocks, ``PER_ROW`` per (token, head) row) are numbered flat
    over ``[N, H, PER_ROW]``; ``unit0`` is an int64 tile start, ``u`` a small int32 range,
    so the per-unit arithmetic stays 32-bit.
    """
    g = (unit0 % (H * PER_ROW)).to(tl.int32) + u
    head = (g // PER_ROW) % H
    if ST == 0:
        return head
    return ((unit0 // (H * PER_ROW)).to(tl.int32) + g // (H * PER_ROW)) * ST + head  # token * H + head < 2^31


@jit
def max_nan_tl(a, b):
    """Combine function of a max reduction that keeps NaN (plain ``tl.max`` may drop it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def min_nan_tl(a, b):
    """Combine function of a min reduction that keeps NaN."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def block_dequant_tile_tl(bs_ptr, s2_ptr, n_blocks, H: tl.constexpr, NB: tl.constexpr, BLOCKS: tl.constexpr,
                          ST: tl.constexpr):
    """Start of a block-scaled dequantize program (NVFP4, ternary): ``(blk0, b, ok, scale)`` with
    ``scale = E4M3 block scale * s2`` for the program's BLOCKS blocks ``blk0 + b``."""
    blk0 = tl.program_id(0).to(tl.int64) * BLOCKS
    b = tl.arange(0, BLOCKS)
    ok = b < n_blocks - blk0
    s2 = tl.load(s2_ptr + scale_index_tl(blk0, b, NB, H, ST), mask=ok, other=1.0)
    return blk0, b, ok, e4m3_decode_tl(tl.load(bs_ptr + blk0 + b, mask=ok, other=0)) * s2


@jit
def recip_tl(x):
    """``1 / x`` correctly rounded (IEEE division, as torch's ``1 / x``): kernels divide once
    per scale and multiply every value by the result, because a division per value costs
    more than moving the value through memory."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@jit
def store_out_tl(ptr, x, mask, OUT: tl.constexpr):
    """Store fp32 ``x`` as the output dtype: 0 fp32, 1 bf16 (round to nearest even), 2 fp16."""
    if OUT == 1:
        # bf16 = the high half of the fp32 pattern after round-to-nearest-even on the low
        # half (inf stays inf, overflow rounds to inf); ``ptr`` points into an int16 view.
        bits = x.to(tl.int32, bitcast=True)
        tl.store(ptr, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    elif OUT == 2:
        tl.store(ptr, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


def out_buffer(shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(result, what the kernel writes to, OUT kind)`` for a dequantize kernel writing ``dtype``.

    Dtypes the kernels do not write (e.g. float64) get an fp32 kernel output, cast by the caller.
    """
    kind = OUT_KINDS.get(dtype, 0)
    out = torch.empty(shape, dtype=dtype if dtype in OUT_KINDS else torch.float32, device=device)
    return out, out.view(torch.int16) if kind == 1 else out, kind


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
