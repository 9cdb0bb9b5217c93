"""Launch-shape sweep of the paged attention kernel (tokens per tile, warps, stages, registers).

Sets the module constants of :mod:`kvcompose.ops.paged_attention` and
:mod:`kvcompose.ops.attention_launch`, times formats and shapes of
:mod:`bench_attention_gpu`, and prints one line per variant with each cell's time and the
compiled pool kernel's registers per thread, shared memory and programs per SM (the split
plan follows the last). Used to pick the defaults; results go to stdout only.

    python benchmarks/sweep_attention_gpu.py --variants 32,1,3,0 32,1,2,96 --formats nvfp4 ternary
"""

from __future__ import annotations

import argparse
import sys

import torch

import bench_attention_gpu as bench
from kvcompose.ops import attention_launch as launch_plan
from kvcompose.ops import paged_attention as pa

DEFAULT_VARIANTS = ["32,1,3,0", "32,1,2,0", "32,1,4,0", "32,1,3,96", "32,1,2,80", "64,2,3,0", "16,1,3,0"]


def compiled_facts(q: torch.Tensor, sources, shape) -> str:
    """Registers per thread, shared bytes and programs per SM of the pool's compiled variant."""
    cols = sum(s.tokens for s in sources)
    args, consts = pa._partial_launch(q, sources, False, shape)
    if pa.ONE_LAUNCH and pa.CAP_UNION_REGISTERS:
        consts = dict(consts, maxnreg=pa._registers(q, (args[:1], dict(consts, CONSTS=consts["CONSTS"][:1], NSRC=1)),
                                                    cols))
    if not pa.ONE_LAUNCH:  # the pool's own launch
        args, consts = args[:1], dict(consts, CONSTS=consts["CONSTS"][:1], NSRC=1)
    resident = pa._resident(q, (args, consts), cols)
    kernel = pa.compiled_partial(q, (args, consts), cols)
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
    p.add_argument("--query-rows", nargs="*", type=int, default=[1], help="least rows of the query tile")
    p.add_argument("--launches", nargs="*", default=["one"], choices=["one", "one-capped", "each"],
                   help="one partial launch for all sources, or one per source")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    queries = {(b, l): torch.randn(b, bench.Q_HEADS, 1, bench.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for b, l in shapes}
    data = {(f, b, l): bench.build(f, b, l, "cuda") for f in args.formats for b, l in shapes}
    grid = [(v, m, g, r) for v in args.variants for m in args.launches for g in args.merges for r in args.query_rows]
    for variant, launches, merge, rows in grid:
        block, warps, stages, regs = (int(v) for v in variant.split(","))
        pa.MIN_QUERY_ROWS = rows
        pa.MERGE_WARPS, pa.MERGE_SLICE = (int(v) for v in merge.split(","))
        pa.ONE_LAUNCH = launches != "each"
        pa.CAP_UNION_REGISTERS = launches == "one-capped"
        pa.TILE_SHAPE = (block, warps)
        pa.STAGES, pa.MAX_REGISTERS = stages, (regs or None)
        pa._RESIDENT.clear()
        cells = []
        for (f, b, l), sources in data.items():
            q = queries[(b, l)]
            try:
                ms = bench.graph_ms(lambda: pa.paged_decode_attention(q, sources, 0.088), args.repeats)
                cells.append(f"{f}@{b}x{l}={ms * 1e3:.1f}us[{compiled_facts(q, sources, (block, warps))}]")
            except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is reported
                cells.append(f"{f}@{b}x{l}=ERR({type(e).__name__}: {str(e)[:60]})")
        print(f"BLOCK={block:3d} WARPS={warps} STAGES={stages} REGS={regs} launches={launches} merge={merge} "
              f"query rows>={rows}: "
              + " ".join(cells),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
