"""Fused against unfused decode steps (kvcompose.hf.fusion) at Llama-3-8B shapes: ms per replayed
step, kernels per step, one-time compile seconds, and whether the tokens match.

    python benchmarks/tools/fusion_probe_gpu.py --policies fullkv,nvfp4,rkv,thinkv --new 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from bench_e2e_gpu import build_model, make_policy  # noqa: E402
from harness.environment import environment  # noqa: E402
from harness.table import format_table  # noqa: E402
from kvcompose.hf.static import fast_generate  # noqa: E402
from kvcompose.speed import random_prompts  # noqa: E402

REPLAYED = ("replay", "evict", "refresh")


def kernels_per_step(model, policy, ids, mask, steps: int, fuse: bool) -> tuple[float, float]:
    """(kernels, GPU ms) per decode step: a run of steps + 2 minus a run of 2, no graphs."""
    from torch.profiler import ProfilerActivity, profile

    def run(new):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fast_generate(model, policy.make_cache(model), ids, mask, new, graphs=False, fuse=fuse)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        return {e.key: (e.count, e.self_device_time_total / 1e3) for e in events}

    long, short = run(steps + 2), run(2)
    per_kernel = {k: ((c - short.get(k, (0, 0))[0]) / steps, (t - short.get(k, (0, 0.0))[1]) / steps)
                  for k, (c, t) in long.items()}
    per_kernel = {k: v for k, v in per_kernel.items() if v[0] > 0}
    return sum(c for c, _ in per_kernel.values()), sum(t for _, t in per_kernel.values()), per_kernel


def replayed(model, policy, ids, mask, new: int, fuse: bool):
    cache = policy.make_cache(model)
    began = time.perf_counter()
    out = fast_generate(model, cache, ids, mask, new, profile=True, fuse=fuse)
    torch.cuda.synchronize()
    wall = time.perf_counter() - began
    s = cache.static_decoder.summary()
    count = sum(s["steps_by_kind"].get(k, 0) for k in REPLAYED)
    ms = sum(s["ms_by_kind"].get(k, 0.0) for k in REPLAYED) / max(count, 1)
    one_time = sum(s["ms_by_kind"].get(k, 0.0) for k in ("warm-up", "capture")) / 1e3
    return out, ms, wall, one_time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="fullkv,nvfp4,rkv,thinkv")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = build_model(args.smoke)
    ids, mask = random_prompts(model.config.vocab_size, args.batch, args.prompt, "cuda")
    rows = []
    for name in args.policies.split(","):
        policy = make_policy(name, args.budget, args.smoke)
        res = {}
        for fuse in (False, True):
            t = time.perf_counter()
            fast_generate(model, policy.make_cache(model), ids, mask, 8, fuse=fuse)  # compiles (fused), warms
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            out, ms, wall, one_time = replayed(model, policy, ids, mask, args.new, fuse)
            k, kms, per_kernel = kernels_per_step(model, policy, ids, mask, 16, fuse)
            if fuse:
                top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:40]
                for kname, (calls, ms) in top:
                    print(f"  {calls:7.1f}/step {1e3 * ms:8.1f} us  {kname[:110]}", flush=True)
            res[fuse] = out
            rows.append(dict(policy=name, fused=fuse, replay_ms=ms, wall_s=wall, first_run_s=first,
                             kernels_per_step=k, kernels_per_layer=k / model.config.num_hidden_layers,
                             kernel_ms=kms))
            print(json.dumps(rows[-1]), flush=True)
        new_f, new_u = res[True][:, args.prompt:], res[False][:, args.prompt:]
        same = (new_f == new_u).all(1)
        first_diff = [int((a != b).nonzero()[0]) for a, b in zip(new_f, new_u) if (a != b).any()]
        rows[-1]["rows_equal"] = f"{int(same.sum())}/{len(same)}"
        rows[-1]["first_diff"] = min(first_diff) if first_diff else None
        print(rows[-1]["rows_equal"], rows[-1]["first_diff"], flush=True)
    cols = ["policy", "fused", "replay_ms", "kernel_ms", "kernels_per_layer", "first_run_s", "rows_equal", "first_diff"]
    print(format_table(cols, [[f"{r.get(c):.3g}" if isinstance(r.get(c), float) else r.get(c) for c in cols] for r in rows]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
