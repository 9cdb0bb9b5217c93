"""Where a plain decode step's time and a run's memory go (Llama-3-8B shapes, GPU).

The end-to-end benchmark gives one number per run; this splits it, so that the next change
aims at the largest part. Per policy, at one batch:

- **kernels**: GPU time per decode step by kernel, from ``torch.profiler``: a run of
  ``--new-tokens`` more steps than a short one, minus the short one (the static-shape path
  without CUDA graphs: the kernels are those a replayed graph runs; only launches differ).
  Also the launches per step and per decoder layer (every kernel of the step, the model's
  head included, over the layer count): an average that includes each step's share of the
  periodic work (flushes of the recent buffer, evictions, refreshes).
- **plain step**: the launches of a step without periodic work alone, counted on the host
  inside the ranges the static decoder names ``kvcompose decode step: plain``.
- **replayed step**: the GPU time of one replayed plain step with CUDA graphs; beyond the
  kernels' own time it holds the gaps between them.
- **memory**: above the weights, the peak of a prefill-only run, the peak of the decode run
  (with graphs, as the benchmark runs), and the KV bytes the cache allocated and used;
  what is neither KV nor weights is activations, eviction scratch and graph pools.

    python benchmarks/profile_decode.py --policies fullkv,kivi2 --batch 16
    python benchmarks/profile_decode.py --smoke          # tiny model on the CPU, checks the script
"""

from __future__ import annotations

import argparse
import bisect
import gc
from collections import defaultdict

import torch

from bench_e2e_gpu import build_model, make_policy
from harness.llama import llama_model
from harness.results import ResultLog
from harness.table import format_table
from kvcompose.hf.static import STEP_RANGE, fast_generate
from kvcompose.speed import random_prompts


def kernel_times(model, policy, ids, mask, steps: int) -> tuple[dict[str, tuple[float, float]], tuple]:
    """``{kernel: (calls per step, microseconds per step)}`` of the decode steps alone: a run
    of ``steps + 2`` new tokens minus one of 2 (the prefill, the stores' static capacity and
    one decode step in both); and the longer run's :func:`plain_step_launches`."""
    run = _profile(model, policy, ids, mask, steps + 2)
    calls_us = _by_kernel(run, ids.is_cuda)
    prefill = _by_kernel(_profile(model, policy, ids, mask, 2), ids.is_cuda)
    out = {}
    for name, (calls, us) in calls_us.items():
        calls0, us0 = prefill.get(name, (0, 0.0))
        if us - us0 > 0:
            out[name] = ((calls - calls0) / steps, (us - us0) / steps)
    return out, plain_step_launches(run, ids.is_cuda)


def _profile(model, policy, ids, mask, new: int):
    """``torch.profiler`` over a run without CUDA graphs: the device's kernels and the host's calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = ids.is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    cache = policy.make_cache(model)
    with profile(activities=activities) as prof:
        fast_generate(model, cache, ids, mask, new, graphs=False)
        if cuda:
            torch.cuda.synchronize()
    return prof


def _by_kernel(prof, cuda: bool) -> dict[str, tuple[int, float]]:
    """``{kernel: (calls, microseconds)}`` (CPU: operators and their own time). The ranges the
    static decoder names its steps (``record_function``) show on the device too, spanning the
    step's kernels: they are not kernels and are left out."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        annotation = getattr(event, "is_user_annotation", False) or event.key.startswith(STEP_RANGE)
        if us > 0 and not annotation and (not cuda or event.device_type == torch.autograd.DeviceType.CUDA):
            totals[event.key][0] += event.count
            totals[event.key][1] += us
    return {k: (c, us) for k, (c, us) in totals.items()}


#: Host calls that put work on the GPU: kernel launches (runtime and driver API), copies and fills.
LAUNCHES = ("cudaLaunch", "cuLaunch", "cudaMemcpy", "cudaMemset")


def plain_step_launches(prof, cuda: bool) -> tuple[int, float | None]:
    """``(plain steps, launches per plain step)``: the host's launch calls inside the ranges
    the static decoder names plain steps (no eviction, refresh or flush). The kernel count of
    :func:`kernel_times` averages in every step's share of the periodic work; this is the
    step that runs between them. CPU: ``(steps, None)``."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    plain = [e.time_range for e in events if e.name == STEP_RANGE + "plain"]
    if not cuda:
        return len(plain), None
    starts = sorted(e.time_range.start for e in events if e.name.startswith(LAUNCHES))
    inside = sum(bisect.bisect_right(starts, r.end) - bisect.bisect_left(starts, r.start) for r in plain)
    return len(plain), inside / max(len(plain), 1)


REPLAYED = ("replay", "evict", "refresh")  # steps that replay a graph (not its warm-up or capture)


def replayed_step_ms(model, policy, ids, mask, steps: int) -> float | None:
    """GPU milliseconds per replayed step (CUDA graphs, as the benchmark runs; plain, eviction
    and refresh steps alike, as the kernel count averages them): against the kernels' own
    time, the difference is what the step spends between its kernels. None without replays."""
    if not ids.is_cuda:
        return None
    cache = policy.make_cache(model)
    fast_generate(model, cache, ids, mask, steps + 2, profile=True)
    summary = cache.static_decoder.summary()
    count = sum(summary["steps_by_kind"].get(k, 0) for k in REPLAYED)
    return sum(summary["ms_by_kind"].get(k, 0.0) for k in REPLAYED) / count if count else None


def memory(model, policy, ids, mask, steps: int, reserve: int | None) -> dict:
    """GiB above the weights: prefill peak, decode peak, KV allocated and in use."""
    if not ids.is_cuda:
        return {}
    gib = 2.0 ** -30
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fast_generate(model, policy.make_cache(model), ids, mask, 1)
    prefill = torch.cuda.max_memory_allocated() - weights
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache = policy.make_cache(model)
    fast_generate(model, cache, ids, mask, steps, reserve_new_tokens=reserve)
    decode = torch.cuda.max_memory_allocated() - weights
    report = cache.report()
    return {"weights_gib": weights * gib, "prefill_peak_gib": prefill * gib, "decode_peak_gib": decode * gib,
            "kv_allocated_gib": report.allocated_bytes * gib, "kv_peak_used_gib": report.peak_kv_bytes * gib,
            "other_gib": (decode - report.allocated_bytes) * gib}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="fullkv,nvfp4,kivi2,streamingllm,rkv,thinkv")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps profiled")
    ap.add_argument("--reserve", type=int, default=None, help="size the stores for this many new tokens (memory)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per policy")
    ap.add_argument("--smoke", action="store_true", help="tiny model, CPU operators instead of kernels")
    ap.add_argument("--out", default=None, help="history file the run is added to (e.g. "
                    "benchmarks/results/profile_decode_gpu.json)")
    args = ap.parse_args(argv)
    log = ResultLog(args.out) if args.out else None
    device = "cpu" if args.smoke else "cuda"
    model = llama_model(True, "cpu") if args.smoke else build_model(False)
    prompt = 16 if args.smoke else args.prompt
    ids, mask = random_prompts(model.config.vocab_size, args.batch, prompt, device)
    records = []
    for name in [p for p in args.policies.split(",") if p]:
        policy = make_policy(name, 32 if args.smoke else args.budget, args.smoke)
        fast_generate(model, policy.make_cache(model), ids, mask, 8)  # compile every kernel first
        kernels, (plain_steps, plain_launches) = kernel_times(model, policy, ids, mask, args.new_tokens)
        total = sum(us for _, us in kernels.values())
        calls = sum(c for c, _ in kernels.values())
        layers = model.config.num_hidden_layers
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]
        rows = [[k[:70], f"{c:.1f}", f"{us:.1f}", f"{100 * us / total:.1f}"] for k, (c, us) in top]
        rest = total - sum(us for _, (_, us) in top)
        rows.append(["(the rest)", "", f"{rest:.1f}", f"{100 * rest / max(total, 1e-9):.1f}"])
        print(f"\n{name}, batch {args.batch}: {total / 1e3:.2f} ms of {'kernels' if device == 'cuda' else 'CPU operators'}"
              f" per decode step, {calls:.0f} launches ({calls / layers:.1f} per layer)", flush=True)
        print(format_table(["kernel" if device == "cuda" else "operator", "calls/step", "us/step", "%"], rows))
        if plain_launches is not None:
            print(f"plain step ({plain_steps} of them): {plain_launches:.0f} launches "
                  f"({plain_launches / layers:.1f} per layer)", flush=True)
        replay = replayed_step_ms(model, policy, ids, mask, args.new_tokens)
        if replay is not None:
            print(f"replayed step {replay:.2f} ms: {replay - total / 1e3:.2f} ms more than its kernels", flush=True)
        mem = memory(model, policy, ids, mask, args.new_tokens, args.reserve)
        if mem:
            print(" ".join(f"{k} {v:.2f}" for k, v in mem.items()), flush=True)
        records.append({"policy": name, "batch": args.batch, "prompt": prompt, "steps": args.new_tokens,
                        "ms_per_step": total / 1e3, "memory": mem, "launches_per_step": calls,
                        "launches_per_layer": calls / layers, "plain_steps": plain_steps,
                        "launches_per_plain_step": plain_launches,
                        "launches_per_layer_plain_step": None if plain_launches is None else plain_launches / layers,
                        **({} if replay is None else {"replay_ms_per_step": replay}),
                        "kernels": [{"name": k, "calls_per_step": c, "us_per_step": us} for k, (c, us) in top]})
        if log is not None:  # after every policy: a run cut off by a time limit keeps what it measured
            log.save({"benchmark": "decode step profile", "smoke": args.smoke, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
