"""Launch-shape sweep of the paged attention kernel (tokens per tile, warps, programs per SM, stages).

Sets the module constants of :mod:`kvcompose.ops.paged_attention` and times a few formats
and shapes of :mod:`bench_attention_gpu`; prints one line per variant. Used to pick the
defaults; results go to stdout only.
"""

from __future__ import annotations

import itertools
import sys

import torch

import bench_attention_gpu as bench
from kvcompose.ops import paged_attention as pa


def main() -> int:
    shapes = [(1, 32768), (64, 4096)]
    formats = ["bf16", "fp8", "nvfp4", "ternary"]
    data = {(f, b, l): bench.build(f, b, l, "cuda") for f in formats for b, l in shapes}
    queries = {(b, l): torch.randn(b, bench.Q_HEADS, 1, bench.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for b, l in shapes}
    for block, warps, per_sm, stages, regs in itertools.product((64,), (2,), (4, 8), (2, 3), (None, 128, 168)):
        pa.BLOCK_N, pa.WARPS, pa.PROGRAMS_PER_SM, pa.STAGES, pa.MAX_REGISTERS = block, warps, per_sm, stages, regs
        cells = []
        for (f, b, l), sources in data.items():
            q = queries[(b, l)]
            try:
                ms = bench.graph_ms(lambda: pa.paged_decode_attention(q, sources, 0.088), 30)
                cells.append(f"{f}@{b}x{l}={ms * 1e3:.0f}us")
            except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is reported
                cells.append(f"{f}@{b}x{l}=ERR({type(e).__name__})")
        print(f"BLOCK={block:3d} WARPS={warps} PER_SM={per_sm:2d} STAGES={stages} REGS={regs}: " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
