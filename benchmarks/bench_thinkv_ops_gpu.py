"""Time ThinKV's two ops: attention sparsity (thought refresh) and batched K-means (TBE step-down).

    python benchmarks/bench_thinkv_ops_gpu.py --out benchmarks/results/thinkv_ops_gpu.json
    python benchmarks/bench_thinkv_ops_gpu.py --smoke          # tiny shapes, CPU + Triton interpreter

Sparsity runs on Llama-3-8B shapes (32 query heads, 8 KV heads, head dim 128, bf16) for
batch 1/16/64 and 1K/4K/16K cached tokens, every slot live. The kernel streams the keys
twice (softmax statistics, then counting), so besides microseconds we report the keys'
size over the time (``keys_gbps``, one logical read) and the bytes actually moved over
the time (``traffic_gbps``, two reads). For scale, a bf16 decode SDPA over the same keys
and values (one read of K and V) and the torch reference are timed as well.

K-means runs S segments of 128 tokens whose features are the keys of 8 KV heads x 128
dims (F = 1024), for each TBE retention level K = 64/32/16/8/4, 10 Lloyd rounds.

Each timing is the median over repetitions of one call, measured with CUDA events,
with the L2 cache flushed before every repetition (so small cases read from HBM, as
they would inside a decode step). Input checks are off (``validate=False``): they cost
one extra pass and a host sync and are not part of the kernels.
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
from harness.timing import call_times_ms  # noqa: E402
from kvcompose.ops.kmeans import kmeans_select  # noqa: E402
from kvcompose.ops.sparsity import attention_sparsity  # noqa: E402


class Timer:
    """Median time of one call in microseconds: CUDA events with an L2 flush, or a wall clock on CPU."""

    def __init__(self, device: str, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if device == "cuda" else None

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        flush = None if self.flush is None else (lambda _: self.flush.zero_())
        ms = call_times_ms(lambda _: fn(), self.reps, self.device, before=flush)
        return statistics.median(t * 1e3 for t in ms)


def bench_sparsity(cfg: dict, timer: Timer, device: str) -> list[dict]:
    rows = []
    hq, hkv, d, dtype = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"]
    for b in cfg["batches"]:
        for length in cfg["lengths"]:
            g = torch.Generator(device=device).manual_seed(b * 100003 + length)
            q = torch.randn(b, hq, d, device=device, generator=g).to(dtype)
            k = torch.randn(b, hkv, length, d, device=device, generator=g).to(dtype)
            v = torch.randn_like(k)
            valid = torch.ones(b, length, dtype=torch.bool, device=device)
            scaling = d ** -0.5
            row = {"batch": b, "length": length, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                   "dtype": str(dtype).replace("torch.", "")}
            keys_bytes = k.numel() * k.element_size()
            row["keys_bytes"] = keys_bytes
            for combine in ("scores", "sparsity"):
                us = timer(lambda: attention_sparsity(q, k, valid, scaling, combine=combine, backend="triton",
                                                      validate=False))
                row[f"triton_{combine}_us"] = us
                row[f"triton_{combine}_keys_gbps"] = keys_bytes / us / 1e3
                row[f"triton_{combine}_traffic_gbps"] = 2 * keys_bytes / us / 1e3
            row["torch_reference_us"] = timer(
                lambda: attention_sparsity(q, k, valid, scaling, backend="torch", validate=False))
            row["validate_us"] = timer(lambda: _validate_only(q, k, valid))
            qs = q[:, :, None, :]
            row["sdpa_bf16_us"] = timer(
                lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
            rows.append(row)
            print(f"sparsity B={b:3d} L={length:6d}: triton {row['triton_scores_us']:9.1f} us "
                  f"({row['triton_scores_keys_gbps']:7.1f} GB/s keys, {row['triton_scores_traffic_gbps']:7.1f} moved) "
                  f"| per-group {row['triton_sparsity_us']:9.1f} us | torch {row['torch_reference_us']:9.1f} us "
                  f"| sdpa {row['sdpa_bf16_us']:8.1f} us", flush=True)
            del q, k, v, valid
    return rows


def _validate_only(q, k, valid):
    """The input check alone (what validate=True adds): one pass over the keys and a host sync."""
    keys_ok = (torch.isfinite(k).all(dim=-1) | ~valid[:, None, :]).all()
    torch.stack([torch.isfinite(q).all(), keys_ok]).tolist()


def bench_kmeans(cfg: dict, timer: Timer, device: str) -> list[dict]:
    rows = []
    n, f, iters, dtype = cfg["tokens"], cfg["features"], cfg["iters"], cfg["dtype"]
    for s in cfg["segments"]:
        g = torch.Generator(device=device).manual_seed(s)
        keys = torch.randn(s, n, f, device=device, generator=g).to(dtype)
        valid = torch.ones(s, n, dtype=torch.bool, device=device)
        for kk in cfg["ks"]:
            k = torch.full((s,), kk, dtype=torch.int32, device=device)
            row = {"segments": s, "tokens": n, "features": f, "k": kk, "iters": iters,
                   "dtype": str(dtype).replace("torch.", "")}
            row["triton_us"] = timer(lambda: kmeans_select(keys, valid, k, iters=iters, backend="triton",
                                                           max_k=kk, validate=False))
            row["triton_us_per_segment"] = row["triton_us"] / s
            row["torch_reference_us"] = timer(lambda: kmeans_select(keys, valid, k, iters=iters, backend="torch",
                                                                    max_k=kk, validate=False))
            rows.append(row)
            print(f"kmeans S={s:5d} K={kk:3d}: triton {row['triton_us']:10.1f} us "
                  f"({row['triton_us_per_segment']:7.2f} us/segment) | torch {row['torch_reference_us']:10.1f} us",
                  flush=True)
        del keys, valid
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="history file the run is added to (e.g. benchmarks/results/thinkv_ops_gpu.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU through the Triton interpreter")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("bench_thinkv_ops_gpu: no CUDA GPU; use --smoke for a CPU check")
    device = "cuda" if cuda else "cpu"
    if args.smoke:
        sparsity_cfg = dict(hq=4, hkv=2, d=16, dtype=torch.bfloat16, batches=[1, 2], lengths=[64, 100])
        kmeans_cfg = dict(tokens=32, features=48, iters=3, dtype=torch.bfloat16, segments=[4], ks=[8, 4])
        timer = Timer(device, reps=args.reps or 2, warmup=1)
    else:
        sparsity_cfg = dict(hq=32, hkv=8, d=128, dtype=torch.bfloat16, batches=[1, 16, 64],
                            lengths=[1024, 4096, 16384])
        kmeans_cfg = dict(tokens=128, features=8 * 128, iters=10, dtype=torch.bfloat16, segments=[32, 256, 1024],
                          ks=[64, 32, 16, 8, 4])
        timer = Timer(device, reps=args.reps or 30, warmup=3)

    result = {
        "benchmark": "thinkv_ops_gpu",
        "smoke": args.smoke,
        "timing": "median of one call; CUDA events; L2 flushed before each repetition; validate=False"
        if cuda else "median wall clock of one call on CPU (Triton interpreter); not a performance number",
        "sparsity": bench_sparsity(sparsity_cfg, timer, device),
        "kmeans": bench_kmeans(kmeans_cfg, timer, device),
    }
    if args.out:
        env = environment(triton_interpret=os.environ.get("TRITON_INTERPRET"))
        print(f"wrote {append_run(args.out, result, env)}")


if __name__ == "__main__":
    main()
