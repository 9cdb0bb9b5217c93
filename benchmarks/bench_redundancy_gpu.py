"""Time R-KV's redundancy column sums: the dense torch path against the fused Triton kernel.

    PYTHONPATH=src:benchmarks python benchmarks/bench_redundancy_gpu.py --out $OUT/redundancy.json
    PYTHONPATH=src:benchmarks python benchmarks/bench_redundancy_gpu.py --smoke   # tiny, CPU + interpreter

One layer of a Llama-3-8B-shaped batch (16 sequences, 8 KV heads, head dim 128, bf16
keys) at 1,024 and 2,176 candidates per sequence, about 5% of the slots empty. The
dense path (:func:`redundancy_column_sums_torch`, the ``rkv`` evictor's former code)
builds the ``[B, Hkv, L, L]`` fp32 similarity matrix and a ``topk`` over it; the kernel
path (:func:`redundancy_column_sums` on CUDA) streams it in tiles, plus a torch prologue
(inverse key norms) and a ``scatter_add``, both included in its time. β = 1 (R-KV's
default) and β = 0 (no sparing) are timed.

The keys are drawn around ``L / 4`` random directions (cosine about 0.8 within a
cluster, about 0 ± 0.09 across), so that at the threshold 0.5 most tokens have similar
partners to spare and no pair lies near the threshold. Every case checks that the two
paths agree (column sums within 1e-4, relative or absolute) and the script exits with
status 1 if one does not.

Each timing is the median over ``--repeats`` calls after ``--warmup`` calls, measured
with CUDA events; ``peak_mib`` is the peak memory allocated by one call beyond its inputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the import below

from harness.environment import environment  # noqa: E402
from harness.results import append_run  # noqa: E402
from harness.table import format_table  # noqa: E402
from harness.timing import call_times_ms  # noqa: E402
from kvcompose.ops.redundancy import redundancy_column_sums, redundancy_column_sums_torch  # noqa: E402

THRESHOLD = 0.5  # R-KV's default
TOLERANCE = 1e-4


def clustered_keys(B: int, H: int, L: int, D: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    centers = torch.randn(B, H, max(L // 4, 1), D, generator=g, device=device)
    which = torch.randint(0, centers.shape[2], (L,), generator=g, device=device)
    return (centers[:, :, which] + 0.5 * torch.randn(B, H, L, D, generator=g, device=device)).to(dtype)


def time_ms(fn, device: str, repeats: int, warmup: int) -> float:
    """Median milliseconds of one call (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    return statistics.median(call_times_ms(lambda _: fn(), repeats, device))


def peak_mib(fn, device: str) -> float | None:
    """Peak memory one call allocates beyond what was allocated before it."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(B, H, L, D, dtype, beta, device, repeats, warmup) -> dict:
    keys = clustered_keys(B, H, L, D, dtype, device, seed=L)
    g = torch.Generator(device=device).manual_seed(L + 1)
    valid = torch.rand(B, L, generator=g, device=device) < 0.95
    positions = torch.stack([torch.randperm(2 * L, generator=g, device=device)[:L] for _ in range(B)])
    positions = torch.where(valid, positions, -1)

    def dense():
        return redundancy_column_sums_torch(keys, valid, positions, THRESHOLD, beta)

    def kernel():
        return redundancy_column_sums(keys, valid, positions, THRESHOLD, beta, backend="triton")

    want, got = dense(), kernel()
    diff = (got - want).abs()
    agree = bool(torch.allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE))
    row = {"batch": B, "kv_heads": H, "candidates": L, "head_dim": D, "dtype": str(dtype).removeprefix("torch."),
           "beta": beta, "threshold": THRESHOLD, "live_fraction": round(float(valid.float().mean()), 4),
           "max_abs_diff": float(diff.max()), "max_column_sum": float(want.abs().max()), "agree": agree}
    row["dense_ms"] = time_ms(dense, device, repeats, warmup)
    row["kernel_ms"] = time_ms(kernel, device, repeats, warmup)
    row["speedup"] = row["dense_ms"] / row["kernel_ms"]
    row["dense_peak_mib"] = peak_mib(dense, device)
    row["kernel_peak_mib"] = peak_mib(kernel, device)
    del keys, valid, positions, want, got
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="history file the run is added to (e.g. benchmarks/results/redundancy_gpu.json)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2176], help="candidates per sequence")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU through the Triton interpreter")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("bench_redundancy_gpu: no CUDA GPU; use --smoke for a CPU check")
    device = "cuda" if cuda else "cpu"
    B, H, D, lengths, repeats, warmup = args.batch, 8, 128, args.lengths, args.repeats, args.warmup
    if args.smoke:
        B, H, D, lengths, repeats, warmup = 2, 2, 32, [40, 70], 1, 0
    rows = []
    for L in lengths:
        for beta in (1, 0):
            row = run_case(B, H, L, D, torch.bfloat16, beta, device, repeats, warmup)
            rows.append(row)
            print(f"L={L:5d} beta={beta}: dense {row['dense_ms']:8.3f} ms | kernel {row['kernel_ms']:8.3f} ms "
                  f"| x{row['speedup']:.1f} | max diff {row['max_abs_diff']:.2e} | agree {row['agree']}", flush=True)
    headers = ["L", "beta", "dense ms", "kernel ms", "speedup", "dense MiB", "kernel MiB", "max diff", "agree"]
    body = [[r["candidates"], r["beta"], f"{r['dense_ms']:.3f}", f"{r['kernel_ms']:.3f}", f"{r['speedup']:.1f}",
             None if r["dense_peak_mib"] is None else f"{r['dense_peak_mib']:.0f}",
             None if r["kernel_peak_mib"] is None else f"{r['kernel_peak_mib']:.0f}", f"{r['max_abs_diff']:.1e}",
             r["agree"]] for r in rows]
    print(f"\nR-KV redundancy column sums, B={B} Hkv={H} D={D} bf16, threshold {THRESHOLD} "
          f"({'CUDA events' if cuda else 'CPU interpreter: not a performance number'})")
    print(format_table(headers, body))
    result = {
        "benchmark": "redundancy_gpu",
        "smoke": args.smoke,
        "timing": f"median of {repeats} calls after {warmup} warm-up calls; "
                  + ("CUDA events" if cuda else "wall clock on CPU (Triton interpreter)"),
        "results": rows,
    }
    if args.out:
        env = environment(triton_interpret=os.environ.get("TRITON_INTERPRET"))
        print(f"wrote {append_run(args.out, result, env)}")
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
