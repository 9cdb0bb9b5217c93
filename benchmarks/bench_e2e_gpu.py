"""End-to-end decode throughput: kvcompose presets against transformers' compiled static cache.

One process, one random Llama-3-8B-shaped model in bf16 (32 layers, 32 query heads, 8 KV
heads of 128, vocabulary 128,256), the same random prompts for every run, EOS disabled,
greedy decoding. The baseline runs first: ``model.generate(..., cache_implementation="static")``
with its compiled decode step (sdpa attention). kvcompose runs through the static-shape
path with CUDA graphs (:func:`kvcompose.hf.static.fast_generate`).

Scenarios (``--scenarios``):

- ``a``: same batch. B=16, prompt 512, 2,048 new tokens, budget 1,024.
- ``b``: long reasoning. B=16, prompt 512, 8,192 new tokens, budget 1,024.
- ``long``: long prompt. B=16, prompt 8,192, 512 new tokens, budget 1,024.
- ``c``: fixed memory. For prompt 512 + 8,192 new tokens, the largest batch whose peak GPU
  memory (weights included) stays under ``--memory-gib``, from the bytes each row reserves
  (:func:`kvcompose.speed.fit_policy`: measured at two small batches, its capacity being
  reserved at the prefill; :func:`kvcompose.speed.fit_transformers_static`: its static cache
  and prefill activations per row plus 2 GiB, counted since it recompiles per batch size),
  then throughput at that batch over the first ``--window`` new tokens, on both sides. A run
  that still runs out of memory or peaks over the cap (the probes see neither the eviction
  graphs' scratch nor a large prefill's activations) is repeated at 90% of the batch, up to
  ``--oom-retries`` times; the record lists the batches that did not fit.

Both sides time the same decode steps (``timed_steps``): in a, b and long every new token
after the first (the prefill produces that one), in c those of the window. The baseline's
static cache is reserved for prompt + new tokens in every scenario.

The CUDA allocator runs with ``expandable_segments:True`` (unless ``PYTORCH_CUDA_ALLOC_CONF``
says otherwise; the JSON records it): at the batch sizes of scenario c the default
allocator failed a 4.9 GiB prefill allocation with 13 GiB reserved but fragmented.

Per run: decode ms/step (kvcompose: from the first decode step to the end; the baseline:
wall time of the whole run minus a prefill-only run; over the timed steps), tok/s,
``ratio_to_baseline`` and ``ratio_to_fullkv`` (tok/s over the baseline's and over kvcompose
fullkv's in the same run and scenario), the floor (``floor_ms_per_step``: weight and KV bytes
read per step over the copy bandwidth ``copy_tbps`` measured once per run in this process, see
:data:`kvcompose.speed.FLOOR_METHOD`; ``floor_ratio`` = ms/step over it), peak GPU memory, the
policy's KV bytes, the share of eager steps (evictions, classifier refreshes) and their share
of decode time (CUDA events per step), and the host's own milliseconds per replayed step. The
timed kvcompose run is not profiled (the host queues steps ahead of the GPU, as in a user's
call); those splits come from a second, profiled run (``profiled_ms_per_step``).
The environment (GPU, versions, git commit and dirty flag) is read by the script.

    python benchmarks/bench_e2e_gpu.py --smoke                       # tiny model, seconds
    python benchmarks/bench_e2e_gpu.py --smoke --device cpu --policies fullkv,rkv   # on a CPU, about 1 min
    python benchmarks/bench_e2e_gpu.py --scenarios a --out benchmarks/results/e2e_gpu.json

A policy named ``preset+rotation`` (``nvfp4+hadamard``) is the preset with that rotation of the
stored keys and values, and ``preset@slot`` (``thinkv@slot``) the preset with its pools' rows
slot-major (``Policy.pool_layout``; ``@head`` names the default). Records carry that name and the
``pool_layout`` the preset ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import torch  # noqa: E402

from harness.environment import environment  # noqa: E402
from harness.llama import llama_model  # noqa: E402
from harness.results import ResultLog  # noqa: E402
from harness.table import format_table  # noqa: E402

from kvcompose.speed import (  # noqa: E402
    FLOOR_METHOD,
    add_floor,
    add_fullkv_ratios,
    attention_kernels,
    copy_tbps,
    fit_policy,
    fit_transformers_static,
)

POLICIES = ["fullkv", "streamingllm", "snapkv", "h2o", "rkv", "rpc", "fp8", "nvfp4", "kivi2", "thinkv", "thinkv-tbq"]
SCENARIOS = {
    "a": dict(batch=16, prompt=512, new=2048, budget=1024),
    "b": dict(batch=16, prompt=512, new=8192, budget=1024),
    "c": dict(batch=None, prompt=512, new=8192, budget=1024),
    "long": dict(batch=16, prompt=8192, new=512, budget=1024),
}
SMOKE = dict(batch=4, prompt=64, new=48, budget=48)
SMOKE_LONG = dict(batch=4, prompt=160, new=24, budget=48)  # --smoke of long: a prompt over the budget
# ThinKV's shipped calibration belongs to the embedded model; a random model gets stand-in
# thresholds on its first four layers (speed does not depend on the thought mix).
THINKV_CLASSIFIER = {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1, 2, 3]}
BUDGETED = {"streamingllm", "snapkv", "h2o", "rkv", "thinkv"}
MODEL = "random Llama-3-8B shapes, bf16"
SMOKE_MODEL = "tiny random Llama (--smoke: bf16 on CUDA, fp32 on CPU)"


def build_model(smoke: bool, device: str = "cuda"):
    # bf16 on the GPU; the CPU check runs the tiny model in fp32 (CPU bf16 matmuls are slow)
    model = llama_model(smoke, device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_policy(name: str, budget: int, smoke: bool):
    """The preset ``name`` as the scenario runs it; ``preset+rotation`` (``nvfp4+hadamard``) adds
    that rotation of the stored keys and values, ``preset@layout`` (``thinkv@slot``) that pool
    layout (``Policy.pool_layout``)."""
    from kvcompose import Policy
    from kvcompose.speed import warm_up_policy

    name, _, layout = name.partition("@")
    name, _, rotation = name.partition("+")
    overrides = {"rotation": rotation} if rotation else {}
    if layout:
        overrides["pool_layout"] = layout
    if name in BUDGETED:
        overrides["budget"] = budget
    if name.startswith("thinkv"):
        overrides["classifier"] = dict(THINKV_CLASSIFIER, layers=[0, 1] if smoke else [0, 1, 2, 3])
    policy = Policy.from_preset(name, **overrides)
    return warm_up_policy(policy, budget) if smoke else policy  # smoke: short periods, every step kind


def prompts(model, batch: int, prompt: int):
    from kvcompose.speed import random_prompts

    return random_prompts(model.config.vocab_size, batch, prompt, model.device)


def baseline_run(model, batch: int, prompt: int, new: int, cache_len: int | None = None) -> dict:
    from kvcompose.speed import time_transformers_static

    return time_transformers_static(model, *prompts(model, batch, prompt), new, cache_len)


def kvcompose_run(model, policy, batch: int, prompt: int, new: int) -> dict:
    from kvcompose.speed import time_policy

    return time_policy(model, policy, *prompts(model, batch, prompt), new)


TABLE = ["policy", "scenario", "batch", "timed_steps", "ms_per_step", "steady_ms_per_step", "floor_ms_per_step",
         "floor_ratio", "tok_per_s", "ratio_to_fullkv", "ratio_to_baseline", "peak_gib", "eviction_share", "error"]


def _cell(value):
    return f"{value:.3g}" if isinstance(value, float) else value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths (checks the script)")
    ap.add_argument("--scenarios", default="a", help="comma-separated subset of " + ",".join(SCENARIOS))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script without a GPU (with --smoke)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--new-tokens", type=int, default=None, help="override the scenario's new tokens (recorded)")
    ap.add_argument("--memory-gib", type=float, default=70.0, help="scenario c: GPU memory cap, weights included")
    ap.add_argument("--window", type=int, default=1536,
                    help="scenario c: new tokens timed on both sides (the capacity is still reserved for all)")
    ap.add_argument("--oom-retries", type=int, default=4, help="scenario c: smaller batches tried after an OOM or a peak over the cap")
    ap.add_argument("--start-batch", type=start_batches, default={},
                    help="scenario c: the first batch tried per policy instead of the estimate, e.g. thinkv=683 "
                         "(a batch an earlier run found; the search still backs off, never up; recorded)")
    ap.add_argument("--run", default=None, help="label of this run, stored in each record (e.g. b7)")
    ap.add_argument("--out", default=None, help="history file this run is added to (e.g. "
                    "benchmarks/results/e2e_gpu.json); earlier runs stay as they are")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    log = open_log(args.out)
    model = build_model(args.smoke, args.device)
    copy = copy_tbps(model.device)  # once per run, in this process: what every record's floor divides by
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the copy's 4 GiB back before any memory is measured
    print(f"copy bandwidth: {copy:.3g} TB/s", flush=True)
    args.attention_kernels = attention_kernels(model.device)  # which decode attention kernels this run used
    print(f"attention: {args.attention_kernels}", flush=True)
    names = [p for p in args.policies.split(",") if p]
    records = []
    for scenario in scenarios:
        shape = dict(SCENARIOS[scenario])
        if args.smoke:
            shape = dict(SMOKE_LONG if scenario == "long" else SMOKE)
        if args.new_tokens:
            shape["new"] = args.new_tokens
        rows = run_scenario(model, scenario, shape, names, args, copy,
                            lambda rows: save(log, records + rows, args, copy))
        records += rows
        print(format_table(TABLE, [[_cell(r.get(c)) for c in TABLE] for r in rows]), flush=True)
    return 0


def start_batches(text: str) -> dict[str, int]:
    """``--start-batch``: ``policy=rows`` pairs separated by commas."""
    out = {}
    for item in (i for i in text.split(",") if i):
        name, _, rows = item.partition("=")
        if not name or not rows.isdigit() or int(rows) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: give policy=rows with a positive number of rows, e.g. "
                                             "thinkv=683,fullkv=51")
        out[name] = int(rows)
    return out


def open_log(out: str | None) -> ResultLog | None:
    """This run's entry in the history at ``out`` (None: nothing is written); its environment
    records the allocator settings."""
    if out is None:
        return None
    return ResultLog(out, environment(allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")))


def save(log: ResultLog | None, records: list[dict], args, copy: float | None = None) -> None:
    """Write what has run so far as this run's entry of ``--out``'s history (after every record:
    a run cut off by a time limit keeps the records it finished)."""
    if log is not None:
        log.save(run_entry(records, args.run, log.environment["date"], args.smoke, copy,
                           getattr(args, "attention_kernels", None)))


def run_entry(records: list[dict], run: str | None, date: str, smoke: bool = False,
              copy: float | None = None, kernels: str | None = None) -> dict:
    """One run's entry: its records, each labelled with the run (default: the first scenario)
    and its date; a record's ``ratio_to_baseline`` and ``ratio_to_fullkv`` are against the
    baseline and the fullkv record of the same run and scenario. ``copy_tbps``: the copy
    bandwidth this run measured, which every record's ``floor_ms_per_step`` divides by
    (``floor_method`` says how). ``attention_kernels``: which decode attention kernels ran
    (:func:`kvcompose.speed.attention_kernels`)."""
    run = run or records[0]["scenario"]
    for r in records:
        r.update(run=run, date=date)
    return {"benchmark": "e2e_gpu", "run": run, "smoke": smoke, "model": SMOKE_MODEL if smoke else MODEL, "copy_tbps": copy,
            "floor_method": FLOOR_METHOD, "attention_kernels": kernels, "records": records}


def run_scenario(model, scenario: str, shape: dict, names: list[str], args, copy: float,
                 saved=lambda rows: None) -> list[dict]:
    """The baseline, then fullkv if asked, then the other policies in order, on ``shape``; both
    sides time the same steps: every new token in a, b and long, the first ``--window`` in c (at
    each side's own batch). Every record gets its floor at ``copy`` TB/s and its ratios to the
    baseline and to fullkv."""
    prompt, new, budget = shape["prompt"], shape["new"], shape["budget"]
    fixed_memory = scenario == "c" and not args.smoke
    rows = []
    if fixed_memory:
        base = fit_transformers_static(model, prompt, new, args.memory_gib, min(args.window, new))
        batch = base["batch"]
    else:
        batch = shape["batch"]
        base = baseline_run(model, batch, prompt, new, cache_len=prompt + new)
    base = add_floor(base, copy)
    base.update(policy="transformers-static", scenario=scenario, ratio_to_baseline=1.0)
    rows.append(base)
    print(json.dumps(base), flush=True)
    saved(rows)
    # the reference (fullkv, on any layout) first: a run cut short keeps it
    for name in sorted(names, key=lambda n: n.partition("@")[0] != "fullkv"):
        policy = make_policy(name, budget, args.smoke)
        try:
            if fixed_memory:
                row = fit_policy(model, policy, prompt, new, args.memory_gib, min(args.window, new), args.oom_retries,
                                 start_batch=args.start_batch.get(name))
            else:
                row = kvcompose_run(model, policy, batch, prompt, new)
        except Exception as exc:  # record what failed instead of losing the other runs
            traceback.print_exc()
            row = {"batch": batch, "new_tokens": new, "error": f"{type(exc).__name__}: {exc}"[:500]}
        row = add_floor(row, copy)
        row.update(policy=name, scenario=scenario, pool_layout=policy.pool_layout)
        if "tok_per_s" in row:
            row["ratio_to_baseline"] = row["tok_per_s"] / base["tok_per_s"]
        rows.append(row)
        add_fullkv_ratios(rows)
        print(json.dumps(row), flush=True)
        saved(rows)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
