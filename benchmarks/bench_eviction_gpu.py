"""Eviction cost at Llama-3-8B shapes on a GPU, read against bf16 SDPA decode attention.

Run (from the repository root, kvcompose installed or ``PYTHONPATH=src``)::

    python benchmarks/bench_eviction_gpu.py --out benchmarks/results/eviction_gpu.json
    python benchmarks/bench_eviction_gpu.py --smoke --out /tmp/eviction_gpu_smoke.json   # any device, seconds

Shapes: 32 layers, 32 query heads, 8 KV heads, head dim 128, bf16; batch 1/16/64/256;
budget 1024/2048 with ``candidates = budget + 128`` (R-KV's buffer). One eviction
step (context + ``evictor.select`` + ``pager.compact``, as ``kvcompose.runtime.compression.compress`` runs
it once the trigger fires) is timed on ONE layer with CUDA events (median of
``--repeats`` after ``--warmup``, each from a fresh copy of the state) and
multiplied by 32: layers evict independently with identical work, and 32 layers of
state do not fit at batch 256. The amortized cost per decode step divides that by
the 128-token buffer. For context, bf16 SDPA decode attention (one query per
sequence over the same candidates) is timed over 32 layers. Configurations that run
out of memory are recorded as ``"oom"``; a time budget (``--time-budget-s``) marks
whatever is left as ``"skipped"`` so the whole run stays short.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from harness import eviction
from harness.results import ResultLog, result_path
from harness.table import format_table
from harness.timing import call_times_ms, sync


@dataclass(frozen=True)
class Config:
    layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    batches: tuple[int, ...] = (1, 16, 64, 256)
    budgets: tuple[int, ...] = (1024, 2048)
    presets: tuple[str, ...] = eviction.PRESETS
    prompt: int = 64
    warmup: int = 2
    repeats: int = 10
    max_config_s: float = 3.0  # stop repeating a configuration after this long (at least 3 repeats)
    time_budget_s: float = 200.0  # configurations not started by then are recorded as skipped


SMOKE = Config(q_heads=8, kv_heads=2, head_dim=32, batches=(1, 2), budgets=(64,), prompt=16, warmup=1, repeats=1)
ATTENTION_BYTES_TARGET = 256 * 2**20  # cycle through enough layers of K/V to defeat the L2 cache


# ------------------------------------------------------------------------- timing
def time_once(fn, args, device: torch.device) -> float:
    """Milliseconds of ``fn(*args)`` from an idle device: CUDA events on a GPU, a wall clock otherwise."""
    sync(device)
    return call_times_ms(lambda _: fn(*args), 1, device)[0]


def measure(fn, setup, device: torch.device, cfg: Config) -> list[float]:
    """Times of ``fn(*setup())`` in ms: ``cfg.warmup`` untimed, then up to ``cfg.repeats`` timed."""
    for _ in range(cfg.warmup):
        fn(*setup())
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < cfg.repeats:
        times.append(time_once(fn, setup(), device))
        if time.perf_counter() - began > cfg.max_config_s and len(times) >= min(3, cfg.repeats):
            break
    return times


def guarded(fn, *args) -> dict:
    """``fn(*args)``, with running out of memory (or another error) recorded instead of raised."""
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError as e:
        return {"status": "oom", "error": str(e).splitlines()[0]}
    except Exception as e:  # noqa: BLE001 - one broken configuration must not end the run
        traceback.print_exc()
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------- eviction
def scenario(preset: str, batch: int, budget: int, cfg: Config) -> eviction.Scenario:
    return eviction.Scenario(
        preset, batch, keep=budget, candidates=budget + eviction.BUFFER, q_heads=cfg.q_heads,
        kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype, prompt=cfg.prompt,
    )


def own_trigger_steps(policy) -> int | None:
    """Decode steps per eviction under the preset's own trigger (None: not comparable here)."""
    name = policy.trigger.name
    return {"buffer": getattr(policy.trigger, "buffer", None), "over_budget": 1}.get(name)


def time_eviction(s: eviction.Scenario, device: torch.device, cfg: Config) -> dict:
    reset_peak(device)
    state = eviction.build_state(s, device)
    matches = eviction.check_eviction(state)
    if matches is False:
        raise AssertionError("the benchmark's eviction context differs from the library's compression")
    times = measure(eviction.evict, lambda: (state.fresh(),), device, cfg)
    per_layer = statistics.median(times)
    per_step = per_layer * cfg.layers
    steps = own_trigger_steps(state.policy)
    return {
        "status": "ok",
        "trigger": state.policy.trigger.name,
        "eviction_ms_per_layer": round(per_layer, 4),
        "eviction_ms_per_step": round(per_step, 3),
        "amortized_ms_per_decode_step": round(per_step / eviction.BUFFER, 4),
        "own_trigger_ms_per_decode_step": round(per_step / steps, 4) if steps else None,
        "repeats": len(times),
        "min_ms_per_layer": round(min(times), 4),
        "peak_gib": peak_gib(device),
        "matches_policy_compress": matches,
    }


# --------------------------------------------------------------------- attention
def time_attention(batch: int, candidates: int, device: torch.device, cfg: Config) -> dict:
    """bf16 SDPA decode (one query per sequence) over ``candidates`` keys, all ``cfg.layers`` layers."""
    gen = torch.Generator(device=device).manual_seed(0)
    kv_shape = (batch, cfg.kv_heads, candidates, cfg.head_dim)
    layer_bytes = 2 * math.prod(kv_shape) * torch.empty(0, dtype=cfg.dtype).element_size()
    distinct = min(cfg.layers, max(1, math.ceil(ATTENTION_BYTES_TARGET / layer_bytes)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=cfg.dtype)

    kv = [(randn(*kv_shape), randn(*kv_shape)) for _ in range(distinct)]
    query = randn(batch, cfg.q_heads, 1, cfg.head_dim)

    def all_layers() -> None:
        for i in range(cfg.layers):
            k, v = kv[i % distinct]
            F.scaled_dot_product_attention(query, k, v, enable_gqa=cfg.q_heads != cfg.kv_heads)

    per_step = statistics.median(measure(all_layers, lambda: (), device, cfg))
    return {
        "status": "ok",
        "sdpa_ms_per_step": round(per_step, 4),
        "sdpa_ms_per_layer": round(per_step / cfg.layers, 5),
        "sdpa_effective_tbps": round(cfg.layers * layer_bytes / (per_step * 1e-3) / 1e12, 3),
        "sdpa_distinct_layers": distinct,
    }


# ---------------------------------------------------------------------------- run
def run(cfg: Config, device: torch.device) -> tuple[list[dict], list[dict]]:
    attention, results = [], []
    deadline = time.perf_counter() + cfg.time_budget_s
    total = len(cfg.budgets) * len(cfg.batches) * len(cfg.presets)
    done = 0
    for budget in cfg.budgets:
        for batch in cfg.batches:
            candidates = budget + eviction.BUFFER
            key = {"batch": batch, "budget": budget, "candidates": candidates}
            att = skipped() if time.perf_counter() > deadline else guarded(time_attention, batch, candidates, device, cfg)
            attention.append({**key, **att})
            print(f"attention B={batch} L={candidates}: {att.get('sdpa_ms_per_step', att['status'])} ms/step",
                  flush=True)
            for preset in cfg.presets:
                done += 1
                s = scenario(preset, batch, budget, cfg)
                row = skipped() if time.perf_counter() > deadline else guarded(time_eviction, s, device, cfg)
                row = {"preset": preset, **key, **row, **fraction(row, att)}
                results.append(row)
                print(f"[{done}/{total}] " + progress_line(row), flush=True)
    return attention, results


def skipped() -> dict:
    return {"status": "skipped", "error": "time budget (--time-budget-s) spent"}


def fraction(row: dict, att: dict) -> dict:
    """The eviction cost as a share of one decode step's attention."""
    if row.get("status") != "ok" or att.get("status") != "ok":
        return {}
    return {
        "eviction_over_sdpa": round(row["eviction_ms_per_step"] / att["sdpa_ms_per_step"], 3),
        "amortized_over_sdpa": round(row["amortized_ms_per_decode_step"] / att["sdpa_ms_per_step"], 4),
    }


def progress_line(row: dict) -> str:
    head = f"{row['preset']:>12} B={row['batch']:<3} L={row['candidates']:<5}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('error', '')}"
    return (f"{head} evict {row['eviction_ms_per_layer']:.3f} ms/layer, {row['eviction_ms_per_step']:.2f} ms/step, "
            f"amortized {row['amortized_ms_per_decode_step']:.4f} ms/step, peak {row['peak_gib']} GiB")


def table(results: list[dict], attention: list[dict]) -> str:
    sdpa = {(a["batch"], a["candidates"]): a.get("sdpa_ms_per_step") for a in attention}
    headers = ["budget", "batch", "preset", "evict ms/layer", "evict ms/step", "amort. ms/step",
               "sdpa ms/step", "amort./sdpa", "peak GiB", "status"]
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        rows.append([
            r["budget"], r["batch"], r["preset"],
            f"{r['eviction_ms_per_layer']:.3f}" if ok else None,
            f"{r['eviction_ms_per_step']:.2f}" if ok else None,
            f"{r['amortized_ms_per_decode_step']:.4f}" if ok else None,
            sdpa.get((r["batch"], r["candidates"])),
            f"{100 * r['amortized_over_sdpa']:.1f}%" if "amortized_over_sdpa" in r else None,
            r.get("peak_gib"), r["status"],
        ])
    return format_table(headers, rows)


def describe(cfg: Config, device: torch.device, smoke: bool) -> dict:
    return {
        "device": str(device),
        "smoke": smoke,
        "layers": cfg.layers,
        "layers_timed": 1,
        "per_step": f"eviction: one timed layer x {cfg.layers} (identical independent layers; 32 layers of state "
        f"do not fit at batch 256); attention: all {cfg.layers} layers timed, K/V cycled over distinct buffers",
        "q_heads": cfg.q_heads,
        "kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "batches": list(cfg.batches),
        "budgets": list(cfg.budgets),
        "buffer": eviction.BUFFER,
        "prompt_tokens": cfg.prompt,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "max_config_s": cfg.max_config_s,
        "statistic": "median",
        "timer": "CUDA events" if device.type == "cuda" else "perf_counter",
        "measured": "one eviction step: context (protected, slot channels) + evictor.select + pager.compact, "
        "keep = budget of budget + 128 candidates, fresh copy of the state each repeat (untimed)",
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=result_path("eviction_gpu"), help="history file the run is added to")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: checks the script on any device")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--presets", nargs="+", choices=eviction.PRESETS)
    p.add_argument("--batches", nargs="+", type=int)
    p.add_argument("--budgets", nargs="+", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--time-budget-s", type=float)
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    cfg = SMOKE if args.smoke else Config()
    overrides = {k: getattr(args, k) for k in ("presets", "batches", "budgets", "repeats", "warmup", "time_budget_s")}
    return replace(cfg, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v is not None})


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    cfg = config_from(args)
    log = ResultLog(args.out)
    env = log.environment
    print(f"eviction benchmark on {env['gpu'] or env['cpu']} (torch {env['versions']['torch']}), "
          f"{len(cfg.budgets) * len(cfg.batches) * len(cfg.presets)} configurations", flush=True)
    attention, results = run(cfg, device)
    print(table(results, attention), flush=True)
    out = log.save({
        "benchmark": "eviction_gpu",
        "smoke": args.smoke,
        "config": describe(cfg, device, args.smoke),
        "attention": attention,
        "results": results,
    })
    print(f"wrote {out}", flush=True)
    return 1 if any(r["status"] == "error" for r in results + attention) else 0


if __name__ == "__main__":
    sys.exit(main())
