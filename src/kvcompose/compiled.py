"""Bookkeeping compiled into a few kernels while a fused decode step runs on CUDA.

An eviction step of static decode runs, per layer, dozens of small integer operations on
``[B, L]`` and ``[B, segments]`` tensors (ThinKV's segment sizes, step-down levels and order,
the columns its K-means reads). Replayed in a CUDA graph, each still costs its launch, a few
microseconds, which at decode batch sizes is most of what such an operation costs.

A function marked :func:`fused` takes tensors and Python constants and returns tensors,
with no host read. Inside :func:`compiled_functions` (entered by
:func:`kvcompose.hf.fusion.fused_layers`, so by every fused static decode) and on CUDA
tensors it runs compiled by torch.compile (inductor), which fuses its pointwise work and
reductions; everywhere else it runs as written, which stays the reference. Its operations
are integer and comparison work, so both give the same results. One compilation serves
every layer, as the layers share the shapes and constants.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

#: The compiler backend of fused bookkeeping.
BACKEND = "inductor"
#: Compilations allowed per function inside :func:`compiled_functions` and the fused layers: one
#: per decoder layer (its index is a constant of a layer's graphs), batch size and store shape a
#: process decodes with (the default of 8 would turn the ninth into an error).
RECOMPILE_LIMIT = 1024

_depth = 0  # how many compiled_functions() blocks are open
# with fullgraph, a compilation past the recompile limit raises this (not a TorchDynamoException)
_LIMIT_HIT = tuple(e for e in [getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)] if e is not None)


@contextmanager
def compiled_functions():
    """Within the block, :func:`fused` functions called with CUDA tensors run compiled."""
    global _depth
    _depth += 1
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                        accumulated_recompile_limit=RECOMPILE_LIMIT):
            yield
    finally:
        _depth -= 1


def compiling() -> bool:
    """Whether a :func:`compiled_functions` block is open (where :func:`fused` functions run
    compiled on CUDA tensors; on CPU tensors they still run as written)."""
    return _depth > 0


def fused(fn):
    """``fn`` compiled (whole, no graph break) when called inside :func:`compiled_functions`
    with a CUDA tensor as its first argument; as written otherwise (``.eager``: always so)."""
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if not (_depth and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, backend=BACKEND, dynamic=False, fullgraph=True)
        try:
            return compiled(*args, **kwargs)
        except (torch._dynamo.exc.TorchDynamoException, *_LIMIT_HIT) as exc:
            raise RuntimeError(f"could not compile {fn.__qualname__} for a fused decode step ({exc}); "
                               "decode with fast_generate(..., fuse=False)") from exc

    run.eager = fn
    return run
