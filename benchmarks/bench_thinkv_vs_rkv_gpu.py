"""ThinKV vs R-KV on a Llama-3-8B-shaped model: eviction call rate and time breakdown.

Random weights (speed does not depend on them) in bf16: 32 layers, 32 query heads,
8 KV heads, head dim 128. Each policy decodes the same random prompts greedily with
EOS disabled; the cache's phase timer (``cache.time_phases()``, which synchronizes
CUDA around each phase) splits the time into attention (including the store's
dense gather), eviction (trigger + scoring + pager) and ThinKV's classifier refresh.
ThinKV's classifier uses fixed stand-in thresholds on layers 0-3, since a random
model has no calibration; the thought mix is therefore not meaningful, the costs are.

    python benchmarks/bench_thinkv_vs_rkv_gpu.py --out benchmarks/results/thinkv_vs_rkv_gpu.json
"""

from __future__ import annotations

import argparse
import time

import torch

from harness.llama import llama_model
from harness.results import append_run, result_path
from harness.table import format_table

POLICIES = {
    "rkv": dict(name="rkv", overrides={"budget": 1024}),
    "thinkv": dict(name="thinkv", overrides={
        "budget": 1024,
        "classifier": {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1, 2, 3]},
    }),
}


def run(model, policy, batch: int, prompt: int, new: int, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    cache = policy.make_cache(model)
    cache.time_phases()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    r = cache.report()
    return {
        "batch": batch, "prompt": prompt, "new_tokens": new, "total_s": total,
        "tokens_per_s": batch * new / total,
        "eviction_call_rate_pct": r.eviction_call_rate, "eviction_steps": r.eviction_steps, "steps": r.steps,
        "eviction_events": r.evictions, "time_s": r.time_s, "refreshes": r.refreshes,
        "kv_bytes": r.kv_bytes, "peak_kv_bytes": r.peak_kv_bytes, "full_kv_bytes": r.full_kv_bytes,
        "memory_pct": 100 * r.memory_fraction, "avg_bits": r.avg_bits, "thought_mix": r.thought_mix,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(result_path("thinkv_vs_rkv_gpu")), help="history file the run is added to")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=2048)
    args = ap.parse_args()
    from kvcompose import Policy

    device = "cpu" if args.smoke else "cuda"
    batch, prompt, new = (2, 32, 80) if args.smoke else (args.batch, args.prompt, args.new_tokens)
    model = llama_model(args.smoke, device, max_positions=8192)
    results = {}
    for key, spec in POLICIES.items():
        overrides = dict(spec["overrides"])
        if args.smoke:
            overrides["budget"] = 48
            if key == "thinkv":
                overrides.update(refresh=16, classifier={**overrides["classifier"], "layers": [0, 1]})
            else:
                overrides["trigger"] = {"buffer": 16}
        policy = Policy.from_preset(spec["name"], **overrides)
        print(f"running {key} ...", flush=True)
        results[key] = {"policy": policy.to_config(), **run(model, policy, batch, prompt, new, device)}
        print(f"  {results[key]['total_s']:.1f} s, call rate {results[key]['eviction_call_rate_pct']:.2f}%",
              flush=True)
    rows = []
    for key, r in results.items():
        t = r["time_s"] or {}
        rows.append([key, f"{r['tokens_per_s']:.1f}", f"{r['eviction_call_rate_pct']:.2f}",
                     f"{t.get('attention', 0):.2f}", f"{t.get('eviction', 0):.2f}", f"{t.get('refresh', 0):.2f}",
                     f"{r['total_s']:.1f}", f"{r['memory_pct']:.1f}", f"{r['avg_bits']:.2f}"])
    print(format_table(["policy", "tok/s", "call rate %", "attn s", "evict s", "refresh s", "total s",
                        "KV mem %", "avg bits"], rows))
    append_run(args.out, {"benchmark": "thinkv_vs_rkv", "smoke": args.smoke,
                          "config": {"batch": batch, "prompt": prompt, "new_tokens": new, "smoke": args.smoke},
                          "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
