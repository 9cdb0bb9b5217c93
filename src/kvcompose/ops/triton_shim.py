"""Triton where it is installed, and the few helpers every kernel module shares.

Triton ships for Linux only; without it :func:`jit` returns a stub that refuses to
launch, so every op falls back to its torch reference. ``TRITON_INTERPRET=1`` (set before
importing kvcompose) makes the kernels run on CPU tensors (:func:`interpreted`).

ptxas fuses ``a * b + c`` into an FMA (one rounding instead of two), which would break
the bit-exact agreement of kernels and torch references, so every launch passes
:data:`LAUNCH_OPTS` (``enable_fp_fusion=False``).
"""

from __future__ import annotations

try:  # Triton ships for Linux only; the torch references work everywhere.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on platforms without triton
    triton = None
    tl = None


HAS_TRITON = triton is not None


#: Keyword arguments for every kernel launch (ignored by the interpreter).
LAUNCH_OPTS = {"enable_fp_fusion": False}


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


def interpreted(kernel) -> bool:
    """True when ``kernel`` was built by the Triton interpreter (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
