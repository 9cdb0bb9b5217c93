"""How the paged decode attention is launched: tile shape, split-KV plan, resident programs.

The partial kernel of :mod:`kvcompose.ops.paged_attention` runs one program per (row, KV
head, split). Its speed depends on how many programs an SM holds at once and on the last
wave of the grid, so the launcher asks three questions, answered here without touching
the kernel: which tile shape (``TILE_SHAPE``), how many programs of a compiled
variant fit on one SM (:func:`resident_programs`), and how many splits per row
(:func:`plan_splits`).
"""

from __future__ import annotations

import functools

import torch

from .triton_shim import cdiv

# Launch shape of the partial kernel: (tokens per tile, warps). One warp on 32-token tiles keeps
# 9-12 programs resident per SM (registers bound them: 170-240 per thread). Swept on an H200
# (benchmarks/sweep_attention_gpu.py, session 16): fastest in every format at 16 x 8K, 64 x 4K
# and 256 x 1K, and at 1 x 32K too once the recent buffer shares the pool's launch (3-18% under
# two warps on 64-token tiles, which an earlier H100 sweep had picked for few rows). Two or
# four warps per program hold nearly as many registers per thread and halve the programs per SM.
TILE_SHAPE = (32, 1)
TOKENS_PER_SPLIT_MIN = 256  # a split never holds fewer tokens than this (unless the row is shorter)
PROGRAMS_PER_SM = 4  # resident programs assumed where the compiled kernel does not say
WAVE_TOLERANCE = 1.05  # a plan this close to the cheapest counts as cheapest (fewer splits win)


def plan_splits(rows: int, tokens: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM,
                block: int = TILE_SHAPE[0]) -> int:
    """Splits per row for ``rows`` (row, KV head) programs over ``tokens`` columns, tiles of
    ``block`` tokens, ``per_sm`` programs resident per SM (see :func:`fewest_waves`); each
    split holds at least ``TOKENS_PER_SPLIT_MIN`` tokens."""
    if tokens == 0:
        return 0
    most = cdiv(tokens, TOKENS_PER_SPLIT_MIN)
    if device.type != "cuda":
        return min(2, most)  # the interpreter: exercise the merge without slowing tests down
    slots = max(1, per_sm) * torch.cuda.get_device_properties(device).multi_processor_count
    return fewest_waves(max(rows, 1), tokens, slots, most, block)


@functools.lru_cache(maxsize=4096)
def fewest_waves(rows: int, tokens: int, slots: int, most: int, block: int) -> int:
    """The split count in ``1..most`` for ``rows`` programs per split with ``slots`` resident at once.

    Programs of one launch are latency-bound and take about the same time, so a launch costs
    its waves (``ceil(programs / slots)``) times the tiles of one split. Among the plans within
    ``WAVE_TOLERANCE`` of the cheapest, the fewest splits (fewer partial results to merge, no
    many-wave plan for a rounding gain). A 1.2-wave grid costs two waves: rounding the split
    count up to "fill the GPU" made 16 x 8K rows slower than 64 x 4K ones."""
    cost = {s: cdiv(rows * s, slots) * cdiv(cdiv(tokens, s), block) for s in range(1, most + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * WAVE_TOLERANCE)


def resident_programs(kernel, device: torch.device) -> int:
    """Programs of a compiled kernel that one SM holds at once (registers, shared memory and
    threads permitting); ``PROGRAMS_PER_SM`` where the compiled kernel does not say."""
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()  # loads the binary, which sets n_regs
    regs, warps = getattr(kernel, "n_regs", None), getattr(getattr(kernel, "metadata", None), "num_warps", None)
    if not regs or not warps:
        return PROGRAMS_PER_SM
    props = torch.cuda.get_device_properties(device)
    per_warp = cdiv(regs * 32, 256) * 256  # registers are handed out per warp in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
    shared = kernel.metadata.shared + 1024  # the runtime reserves 1 KiB per block
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // shared
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return max(1, min(by_regs, by_shared, by_threads, 32))


__all__ = ["TILE_SHAPE", "fewest_waves", "plan_splits",
           "resident_programs"]
