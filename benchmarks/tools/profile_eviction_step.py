"""Where an eager eviction step of the static decode path spends its time (GPU, Llama-3-8B shapes).

Decodes with the phase timer on (it synchronizes around each phase, so it slows the run;
use it to split time, not to measure throughput) and prints, per policy, the seconds per
eviction step spent in the policy's compression (trigger + view + scoring + pager) and in
the rest of the eager step, and the time of one dense view of one layer.

    python benchmarks/tools/profile_eviction_step.py [--policies rkv,thinkv] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness

from harness.llama import llama_model  # noqa: E402

from kvcompose.hf.static import fast_generate  # noqa: E402
from kvcompose.speed import random_prompts, warm_up_policy  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policies", default="rkv,thinkv")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--trace", action="store_true",
                    help="also run once under torch.profiler and print the top operators by GPU and host time")
    args = ap.parse_args(argv)
    from kvcompose import Policy

    model = llama_model(False, "cuda")
    ids, mask = random_prompts(model.config.vocab_size, args.batch, 512, "cuda")
    for name in args.policies.split(","):
        overrides = {"budget": args.budget}
        if name.startswith("thinkv"):
            overrides["classifier"] = {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1, 2, 3]}
        policy = Policy.from_preset(name, **overrides)
        fast_generate(model, warm_up_policy(policy).make_cache(model), ids, mask, 40)
        cache = policy.make_cache(model)
        cache.time_phases()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fast_generate(model, cache, ids, mask, args.new_tokens, profile=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        summary = cache.static_decoder.summary()
        phases = cache.timer.report()
        layer = cache.layers[5]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            layer.store.view()
        torch.cuda.synchronize()
        view_ms = 1e3 * (time.perf_counter() - t0) / 5
        eager = summary["eager_steps"]
        print(f"{name}: wall {wall:.1f}s, eager steps {eager}, ms by kind {summary.get('ms_by_kind')}, "
              f"phases {phases}, eviction s/eager step {phases.get('eviction', 0) / max(eager, 1):.3f}, "
              f"refresh s/eager step {phases.get('refresh', 0) / max(eager, 1):.3f}, one layer view {view_ms:.1f} ms",
              flush=True)
        if args.trace:
            trace(model, policy, ids, mask, args.new_tokens)
    return 0


def trace(model, policy, ids, mask, new_tokens: int) -> None:
    """Operators of one whole run (eager steps dominate), by GPU time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    cache = policy.make_cache(model)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fast_generate(model, cache, ids, mask, new_tokens)
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_device_time_total", row_limit=25), flush=True)
    print(table.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
