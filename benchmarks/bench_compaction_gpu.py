"""Time one static ``ct`` compaction of one ThinKV layer, and what its pools allocate.

    python benchmarks/bench_compaction_gpu.py --out benchmarks/results/compaction_gpu.json
    python benchmarks/bench_compaction_gpu.py --smoke          # tiny shapes, unquantized, CPU

A ThinKV store (R and E in one NVFP4 pool, T in a ternary pool; 8 KV heads, head dim 128,
bf16) holds ``--tokens`` random tokens per row of three random classes and enters static mode
for 1,200 tokens per row, the capacity scenario c of ``bench_e2e_gpu.py`` reserves. Then a
third of the tokens (every position divisible by 3) is evicted through the ``ct`` pager, as a
TBE step-down does. The classes reserve room each (``per_class``: the eviction marks holes) or
share a reserve per row (``shared``: it also packs holes and gives emptied blocks back); the
packing's slot writes go through the pool's trash slot in torch ops (``torch``) or through
the kernels of ``kvcompose.ops.scatter_slots`` (``kernels``). Each variant builds a fresh
store per repetition (a compaction changes it) and records the fastest of the repetitions in
milliseconds (CUDA events around the eager call, the host's launches included), the GPU time
of its kernels alone (``kernel_ms_per_layer``, ``torch.profiler``: what a captured eviction
step pays; None on the CPU), and the bytes its pools allocate. (The first recorded run also
routed the marking's writes through the kernels: ``per_class`` ``kernels``.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the import below

from harness.environment import environment  # noqa: E402
from harness.results import append_run  # noqa: E402
from kvcompose import Policy  # noqa: E402
from kvcompose.ops import scatter_slots  # noqa: E402
from kvcompose.pagers import ContinuousThinkingPager  # noqa: E402
from kvcompose.paging import row_reserve, store_static  # noqa: E402

FULL = dict(batch=656, tokens=1104, capacity=1200, heads=8, head_dim=128, reps=2)
SMOKE = dict(batch=3, tokens=150, capacity=160, heads=2, head_dim=64, reps=1)  # room for 10 blocks a class
CALLERS = (store_static, row_reserve)  # the modules that call the slot writes


def use_writes(backend: str | None) -> None:
    """Route the compaction's slot writes to ``backend`` (None: the kernels where they run)."""
    for module in CALLERS:
        for name in ("fill_slots", "copy_slots"):
            if hasattr(module, name):
                op = getattr(scatter_slots, name)
                setattr(module, name, op if backend is None else (lambda *a, _op=op: _op(*a, backend=backend)))


def build(shape: dict, device: str, hole_blocks: int | None):
    # --smoke: the classes unquantized (one pool), so the CPU check needs no interpreted quantizer
    overrides = {"precision": {"R": None, "E": None, "T": None}} if shape is SMOKE else {}
    store = Policy.from_preset("thinkv", **overrides).make_store(shape["batch"], shape["heads"], shape["head_dim"],
                                                                 torch.bfloat16, torch.device(device))
    g = torch.Generator(device=device).manual_seed(0)
    size = (shape["batch"], shape["heads"], shape["tokens"], shape["head_dim"])
    keys = torch.randn(size, device=device, dtype=torch.bfloat16, generator=g)
    classes = torch.randint(0, 3, size[:1] + size[2:3], device=device, generator=g)
    store.append(keys, keys.clone(), None, classes)
    store.fix_capacity(shape["capacity"], hole_blocks=hole_blocks)
    return store


def eviction(shape: dict, device: str, hole_blocks: int | None):
    """A fresh store and the compaction to time on it: every position divisible by 3 goes, as
    a TBE step-down evicts, through the ``ct`` pager. Returns ``(store, compact)``."""
    store = build(shape, device, hole_blocks)
    view = store.view(values=False)
    keep = view.valid & (view.positions % 3 != 0)
    return store, lambda: ContinuousThinkingPager(max_hole_blocks=1).compact(store, view, keep)


def kernel_ms(shape: dict, hole_blocks: int | None) -> float:
    """GPU milliseconds of the kernels of one more compaction (``torch.profiler``): what a
    captured eviction step pays, where the CUDA-event time of an eager call also holds the
    host's launch time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    _, compact = eviction(shape, "cuda", hole_blocks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        compact()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def time_compaction(shape: dict, device: str, hole_blocks: int | None) -> tuple[float, int]:
    """Fastest of ``reps`` compactions (ms, CUDA events around an eager call) and the pools'
    allocated bytes."""
    best, allocated = float("inf"), 0
    for _ in range(shape["reps"] + 1):  # the first also compiles the kernels
        store, compact = eviction(shape, device, hole_blocks)
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compact()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            compact()
            ms = (time.perf_counter() - t0) * 1e3
        store.check_errors()
        best = min(best, ms)
        allocated = sum(p.capacity * p.bytes_per_block for p in store.pools.values())
        del store, compact
    return best, allocated


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script, on CPU without a GPU)")
    ap.add_argument("--out", default=None, help="history file this run is added to")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMOKE if args.smoke else FULL
    records = []
    variants = (("per_class", None, "torch"), ("shared", 1, "torch"), ("shared", 1, "kernels"))
    for reserve, hole_blocks, writes in variants:
        use_writes("torch" if writes == "torch" else None)
        ms, allocated = time_compaction(shape, device, hole_blocks)
        kernels = kernel_ms(shape, hole_blocks) if device == "cuda" else None
        records.append(dict(reserve=reserve, writes=writes, ms_per_layer=ms, kernel_ms_per_layer=kernels,
                            allocated_bytes_per_layer=allocated, **{k: shape[k] for k in ("batch", "tokens", "capacity")}))
        print(f"{reserve:>9} {writes:>8} {ms:8.2f} ms" + ("" if kernels is None else f" ({kernels:.2f} ms of kernels)")
              + f" {allocated / 2**20:9.1f} MiB", flush=True)
    use_writes(None)
    if args.out:
        append_run(args.out, {"benchmark": "compaction", "smoke": args.smoke, "records": records}, environment())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
