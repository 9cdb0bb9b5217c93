"""The entry point of the paged decode attention: checks, then the kernels or the reference."""

from __future__ import annotations

import torch

from ..dispatch import step_kernel_runs
from .formats import PagedSource, row_layout
from .kernels import _paged_partial_kernel
from .launch import kernel_fits, paged_decode_triton
from .native import native_status
from .reference import paged_decode_attention_torch


def paged_decode_attention(query: torch.Tensor, sources: list[PagedSource], scaling: float, *,
                           probs: bool = False, mass=None, backend: str | None = None):
    """Attention of one decode step over paged sources: ``[B, Hq, 1, D]`` in the query dtype.

    With ``probs=True`` also returns the attention probabilities ``[B, Hq, L]`` over the
    concatenated token columns of the sources (0 where a slot is not valid): the kernel
    writes each slot's logit in the same pass, and one exponential against the merged
    log-sum-exp finishes them. ``mass=(channels, weight)``: one flat float32 per-slot
    tensor per source and a ``[B]`` weight; each valid slot's channel entry gains
    ``weight[b]`` times its probability averaged over the query heads (what ``h2o``
    accumulates), computed on the device without returning the probabilities.
    ``backend``: None (the kernels on CUDA, the torch reference elsewhere), "triton" (the Triton
    kernel only: CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``), "cuda" (the CUDA
    kernel of :mod:`.native` for the sources it takes, built or an error; Triton for the rest),
    "torch". On CUDA, None runs the CUDA kernel where it is built, takes the source and is the
    faster one (head dim 128; :func:`~kvcompose.ops.paged_attention.native.native_status` says
    whether it is built and why not). Rows with no valid token get zeros.

    The torch path reads a source's decoded copy (:attr:`PagedSource.decoded`, kept by the
    store on CPU) where it has one in the query dtype, instead of decoding every slot of the
    source again at every step: the copy holds the reference's own decoded values, so the
    output is the same bit for bit. The kernel always decodes the codes where they lie.
    """
    check_sources(query, sources)
    if mass is not None:
        check_mass(query, sources, mass)
    if backend not in (None, "triton", "cuda", "torch"):
        raise ValueError(f"unknown backend {backend!r}; accepted: None (auto), 'triton', 'cuda', 'torch'")
    if backend == "cuda":
        require_native(query)
    kernels = "triton" if backend == "cuda" else backend
    fits = kernels is not None or kernel_fits(query, sources)
    if not step_kernel_runs(query, _paged_partial_kernel, kernels, fits):
        sources = [s.with_decoded(query.dtype) for s in sources]
        return paged_decode_attention_torch(query, sources, scaling, return_probs=probs, mass=mass)
    native = {None: "auto", "cuda": "cuda", "triton": "off"}[backend]
    return paged_decode_triton(query, sources, scaling, probs, mass, native=native)


def require_native(query: torch.Tensor) -> None:
    """``backend="cuda"``: the CUDA kernel must be built for the query's device (it then runs the
    sources it takes, the Triton kernel the rest); else an error that says why it is not."""
    if not query.is_cuda:
        raise RuntimeError(f"backend='cuda' needs CUDA tensors; the query is on {query.device}")
    status = native_status(query.device)
    if status["kernel"] != "cuda":
        raise RuntimeError(f"backend='cuda': the CUDA decode kernel is not available ({status['reason']}); "
                           f"accepted instead: None (auto), 'triton', 'torch'")


def check_sources(query: torch.Tensor, sources: list[PagedSource]) -> None:
    """Shapes and dtypes the kernel relies on; errors name the bad value."""
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"decode attention takes one query per row [B, Hq, 1, D]; got shape {tuple(query.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype {query.dtype} not supported; accepted: float16, bfloat16, float32")
    B, Hq, _, D = query.shape
    for i, src in enumerate(sources):
        for role, op in (("key", src.key), ("value", src.value)):
            H = op.codes.shape[1]
            if op.codes.dim() != 3 or op.head_dim() != D or Hq % H:
                raise ValueError(
                    f"source {i} {role}s: codes of shape {tuple(op.codes.shape)} ({op.fmt}) do not fit queries of "
                    f"shape {tuple(query.shape)} (need [slots, H, D / codes per byte] with Hq a multiple of H)"
                )
            if op.fmt == "dense" and op.codes.dtype != query.dtype:
                raise ValueError(f"source {i} {role}s: dtype {op.codes.dtype} differs from the query dtype {query.dtype}")
            if op.head_scale is not None and tuple(op.head_scale.shape) != (B, H):
                raise ValueError(
                    f"source {i} {role}s: head_scale of shape {tuple(op.head_scale.shape)}; expected {(B, H)}")
        if src.table.dim() != 2 or src.table.shape[0] != B:
            raise ValueError(f"source {i}: block table of shape {tuple(src.table.shape)}; expected [{B}, W]")
        try:
            row_layout(src)
        except ValueError as exc:
            raise ValueError(f"source {i}: {exc}") from None


def check_mass(query: torch.Tensor, sources: list[PagedSource], mass) -> None:
    """The ``mass`` argument: a float32 channel with a value per slot of each source, a ``[B]`` weight."""
    channels, weight = mass
    if len(channels) != len(sources):
        raise ValueError(f"mass: {len(channels)} channels for {len(sources)} sources; give one per source")
    for i, (src, channel) in enumerate(zip(sources, channels)):
        if channel.dtype != torch.float32 or channel.shape != src.valid.shape:
            raise ValueError(f"mass channel {i}: {channel.dtype} of shape {tuple(channel.shape)}; expected float32 "
                             f"of shape {tuple(src.valid.shape)} (one value per slot)")
    if tuple(weight.shape) != (query.shape[0],):
        raise ValueError(f"mass weight of shape {tuple(weight.shape)}; expected ({query.shape[0]},), one per row")
