"""Where a scheduled eviction step's GPU time goes, kernel by kernel (Llama-3-8B shapes, GPU).

A static decode replays each eviction step as a CUDA graph, so the end-to-end benchmark sees
only its total (``evict_ms_per_step``). This tool decodes the same way without graphs and
profiles every layer's scheduled compression (the keys-only view, the evictor, the pager)
with ``torch.profiler``: the kernels, their GPU time and their launches per eviction step.
The eager run's host time is not what a replay costs; its kernels are the ones a replay runs.
The classifier's refresh, which shares the step, is profiled on its own (``refresh_ms``).

    python benchmarks/tools/profile_eviction_step.py --policies thinkv --batch 656 \\
        --out benchmarks/results/eviction_profile_gpu.json
    python benchmarks/tools/profile_eviction_step.py --smoke   # tiny model, CPU operators: checks the script
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness and bench_e2e_gpu

from bench_e2e_gpu import build_model, make_policy  # noqa: E402
from harness.results import ResultLog  # noqa: E402

from kvcompose.hf.static import fast_generate  # noqa: E402
from kvcompose.runtime import compression, layer as layer_runtime, thoughts  # noqa: E402
from kvcompose.speed import random_prompts  # noqa: E402


class KernelTally:
    """Kernel (CPU: operator) calls and microseconds summed over profiled calls."""

    def __init__(self, cuda: bool):
        self.cuda, self.calls, self.us = cuda, Counter(), Counter()

    @contextmanager
    def profiled(self):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU]) as prof:
            yield
            if self.cuda:
                torch.cuda.synchronize()
        for event in prof.key_averages():
            us = event.self_device_time_total if self.cuda else event.self_cpu_time_total
            if us > 0 and (not self.cuda or event.device_type == torch.autograd.DeviceType.CUDA):
                self.calls[event.key] += event.count
                self.us[event.key] += us


@contextmanager
def profiling_scheduled_work(evictions: KernelTally, refreshes: KernelTally, counts: Counter):
    """Profile every scheduled compression (``compress(..., scheduled=True)``) into ``evictions``
    and every refresh step's classifier work into ``refreshes`` while the block runs."""
    compress, observe = compression.compress, thoughts.ThoughtTracker.observe

    def compress_profiled(layer, view=None, scheduled=False):
        if not scheduled:
            return compress(layer, view, scheduled)
        counts["compress"] += 1
        with evictions.profiled():
            return compress(layer, view, scheduled)

    def observe_profiled(self, layer_idx, query, view, scaling, store):
        if not self.is_refresh_step(store):
            return observe(self, layer_idx, query, view, scaling, store)
        counts["observe"] += 1
        with refreshes.profiled():
            return observe(self, layer_idx, query, view, scaling, store)

    layer_runtime.compress, thoughts.ThoughtTracker.observe = compress_profiled, observe_profiled
    try:
        yield
    finally:
        layer_runtime.compress, thoughts.ThoughtTracker.observe = compress, observe


def profile_policy(model, name: str, args, smoke: bool) -> dict:
    """One policy's record: kernels per eviction step, biggest first (``--top`` of them)."""
    device = "cpu" if smoke else "cuda"
    policy = make_policy(name, args.budget, smoke)
    ids, mask = random_prompts(model.config.vocab_size, args.batch, args.prompt, device)
    # the same decode first: every kernel is compiled, and the bookkeeping a fused decode compiles at
    # its first eviction step (with inductor's one-time tuning launches) is ready before the profile
    fast_generate(model, policy.make_cache(model), ids, mask, args.new_tokens, graphs=False)
    evictions, refreshes, counts = KernelTally(not smoke), KernelTally(not smoke), Counter()
    with profiling_scheduled_work(evictions, refreshes, counts):
        fast_generate(model, policy.make_cache(model), ids, mask, args.new_tokens, graphs=False)
    layers = model.config.num_hidden_layers
    steps = counts["compress"] / layers  # every layer compresses once per eviction step
    per_step = max(steps, 1)
    top = sorted(evictions.us, key=lambda k: -evictions.us[k])[:args.top]
    return {"policy": name, "batch": args.batch, "prompt": args.prompt, "budget": args.budget,
            "new_tokens": args.new_tokens, "eviction_steps": steps, "time_unit": "CPU ms" if smoke else "GPU ms",
            "ms_per_eviction_step": sum(evictions.us.values()) / 1e3 / per_step,
            "launches_per_eviction_step": sum(evictions.calls.values()) / per_step,
            "refresh_ms": sum(refreshes.us.values()) / 1e3 / max(counts["observe"] / layers, 1),
            "kernels": [{"name": k, "calls_per_step": evictions.calls[k] / per_step,
                         "ms_per_step": evictions.us[k] / 1e3 / per_step} for k in top]}


def workload_parser(description: str, top: int, top_help: str, smoke_help: str) -> argparse.ArgumentParser:
    """The arguments of the eviction-step tools (this one and ``count_eviction_ops.py``): which
    policies decode, at which shapes, and how many entries are shown."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="thinkv")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=768, help="decode steps (evictions start past the budget)")
    ap.add_argument("--top", type=int, default=top, help=top_help)
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    return ap


def workload(ap: argparse.ArgumentParser, argv) -> tuple:
    """``(args, model)``: the parsed arguments (``--smoke``: the tiny model's shapes) and the model."""
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt, args.budget, args.new_tokens = 3, 16, 32, 120
    return args, build_model(args.smoke, "cpu" if args.smoke else "cuda")


def main(argv=None) -> int:
    ap = workload_parser(__doc__, 20, "kernels recorded per policy",
                         "tiny model on the CPU, operators instead of kernels")
    ap.add_argument("--out", default=None, help="history file the run is added to")
    args, model = workload(ap, argv)
    log = ResultLog(args.out) if args.out else None
    records = []
    for name in [p for p in args.policies.split(",") if p]:
        record = profile_policy(model, name, args, args.smoke)
        records.append(record)
        print(f"{name}, batch {args.batch}: {record['eviction_steps']:.0f} eviction steps, "
              f"{record['ms_per_eviction_step']:.1f} {record['time_unit']} and "
              f"{record['launches_per_eviction_step']:.0f} launches each; refresh {record['refresh_ms']:.1f}",
              flush=True)
        for k in record["kernels"]:
            print(f"  {k['ms_per_step']:9.2f} {k['calls_per_step']:7.0f}  {k['name'][:100]}", flush=True)
        if log is not None:  # after every policy: a run cut off keeps what it measured
            log.save({"benchmark": "eviction step profile", "smoke": args.smoke, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
