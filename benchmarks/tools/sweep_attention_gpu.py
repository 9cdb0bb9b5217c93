"""Launch-shape sweep of the paged attention kernel (tokens per tile, warps, stages, registers).

Sets the module constants of :mod:`kvcompose.ops.paged_attention.launch` (tile shape, stages,
register cap, merge), times formats and shapes of :mod:`bench_attention_gpu`, and prints
one line per variant with each cell's time and the compiled launch's registers per thread,
shared memory and programs per SM (the split plan follows the last). Used to pick the defaults; results go to stdout only.

    python benchmarks/tools/sweep_attention_gpu.py --variants 32,1,3,0 32,1,2,96 --formats nvfp4 ternary
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness and the attention benchmark

import bench_attention_gpu as bench  # noqa: E402
from harness.timing import graph_ms  # noqa: E402

from kvcompose.ops.paged_attention import launch, paged_decode_attention  # noqa: E402

DEFAULT_VARIANTS = ["32,1,3,0", "32,1,2,0", "32,1,4,0", "32,1,3,96", "32,1,2,80", "64,2,3,0", "16,1,3,0"]


def compiled_facts(q: torch.Tensor, sources) -> str:
    """Registers per thread, shared bytes and programs per SM of the launch's compiled variant."""
    cols = sum(s.tokens for s in sources)
    args, consts = launch._partial_launch(q, sources, False)
    kwargs = launch._plan_launch(q, sources, args, consts, cols)[2]
    resident = launch._resident(q, (args, kwargs), cols)
    kernel = launch.compiled_partial(q, (args, kwargs), cols)
    kernel._init_handles()
    return f"r{kernel.n_regs}/s{kernel.metadata.shared}/p{resident}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                   help="block,warps,stages,maxnreg (0: the compiler's choice)")
    p.add_argument("--formats", nargs="*", default=["bf16", "fp8", "nvfp4", "ternary", "int4"])
    p.add_argument("--shapes", nargs="*", default=["1x32768", "16x8192", "64x4096"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--merges", nargs="*", default=["1,32"], help="merge warps,channels per program when sliced")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    queries = {(b, l): torch.randn(b, bench.Q_HEADS, 1, bench.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for b, l in shapes}
    data = {(f, b, l): bench.build(f, b, l, "cuda") for f in args.formats for b, l in shapes}
    for variant, merge in [(v, m) for v in args.variants for m in args.merges]:
        block, warps, stages, regs = (int(v) for v in variant.split(","))
        launch.MERGE_WARPS, launch.MERGE_SLICE = (int(v) for v in merge.split(","))
        launch.TILE_SHAPE = (block, warps)
        launch.STAGES, launch.MAX_REGISTERS = stages, (regs or None)
        launch._RESIDENT.clear()
        launch._REGISTERS.clear()
        cells = []
        for (f, b, l), sources in data.items():
            q = queries[(b, l)]
            try:
                ms = graph_ms(lambda: paged_decode_attention(q, sources, 0.088), args.repeats)
                cells.append(f"{f}@{b}x{l}={ms * 1e3:.1f}us[{compiled_facts(q, sources)}]")
            except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is reported
                cells.append(f"{f}@{b}x{l}=ERR({type(e).__name__}: {str(e)[:60]})")
        print(f"BLOCK={block:3d} WARPS={warps} STAGES={stages} REGS={regs} merge={merge}: " + " ".join(cells),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
