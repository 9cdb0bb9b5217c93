"""Launch-shape sweep of the paged attention kernel (tokens per tile, warps, stages, registers).

Sets the module constants of :mod:`kvcompose.ops.paged_attention` and
:mod:`kvcompose.ops.attention_launch` and times a few formats
and shapes of :mod:`bench_attention_gpu`; prints one line per variant with the programs per
SM that each variant's compiled kernel allows (the split plan follows it). Used to pick the
defaults; results go to stdout only.
"""

from __future__ import annotations

import sys

import torch

import bench_attention_gpu as bench
from kvcompose.ops import attention_launch as launch_plan
from kvcompose.ops import paged_attention as pa


def main() -> int:
    shapes = [(1, 32768), (16, 8192), (64, 4096)]
    formats = ["bf16", "fp8", "nvfp4", "ternary"]
    data = {(f, b, l): bench.build(f, b, l, "cuda") for f in formats for b, l in shapes}
    queries = {(b, l): torch.randn(b, bench.Q_HEADS, 1, bench.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for b, l in shapes}
    variants = [(64, 2, 3, None), (32, 2, 3, None), (64, 4, 3, None), (128, 4, 3, None), (64, 2, 4, None),
                (64, 2, 2, None), (32, 1, 3, None), (64, 2, 3, 128)]
    for block, warps, stages, regs in variants:
        launch_plan.FEW_ROWS_SHAPE = launch_plan.MANY_ROWS_SHAPE = (block, warps)
        pa.STAGES, pa.MAX_REGISTERS = stages, regs
        cells = []
        for (f, b, l), sources in data.items():
            q = queries[(b, l)]
            try:
                ms = bench.graph_ms(lambda: pa.paged_decode_attention(q, sources, 0.088), 30)
                launch = pa._partial_launch(q, sources[0], False, (block, warps))
                resident = pa._resident(q, launch, sum(src.tokens for src in sources))
                cells.append(f"{f}@{b}x{l}={ms * 1e3:.0f}us/{resident}")
            except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is reported
                cells.append(f"{f}@{b}x{l}=ERR({type(e).__name__})")
        print(f"BLOCK={block:3d} WARPS={warps} STAGES={stages} REGS={regs}: " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
