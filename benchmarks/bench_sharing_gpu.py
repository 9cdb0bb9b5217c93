"""Time ReasonCache's block sharing (filter + share pager) at Llama-3-8B cache shapes.

    PYTHONPATH=src:benchmarks python benchmarks/bench_sharing_gpu.py                    # H100: 32 layers, B=16
    PYTHONPATH=src:benchmarks python benchmarks/bench_sharing_gpu.py --smoke --device cpu --out /tmp/sharing.json

``--smoke``: 4 layers, batch 2, prompt 64, 1,024 steps (each sequence needs ~10 finished
steps before anything is shared: the filter first collects 8 distances).

What it measures: the host time of ``SharingTracker.after_forward`` (scan the new tokens
for step ends, lexical + structural match, block distances over all layers, and the
shares), which runs after the last layer of every decode forward pass, against
ReasonCache's reported overhead of 13.5 ms per reasoning step. No model runs: the cache's
stores are fed directly, 32 layers x 8 KV heads x head dim 128 in bf16, 16 sequences,
a 512-token prompt then 2,048 decode steps, so the numbers are the filter's alone.

The token stream is scripted reasoning: steps of 20-80 tokens ending in "\\n\\n", some
with formulas ("2x+5=10", so the SymPy/AST stage runs), and ``--repeat-share`` of them
repeating an earlier step of the same sequence, exactly or with one token changed
(self-verification). Keys and values are random, except that a repeated token gets the
keys and values of the token it repeats plus 0.05 x randn noise, so true repeats are close
in KV distance. Each sequence of the batch has its own script. ``reasoncache-random`` runs
at the share rate that ``reasoncache`` measured in the same run, so memory is matched.

Each ``after_forward`` call is timed on the host with CUDA synchronized before and after
(the appends before it are not timed); calls that decided at least one step are reported
apart from the others (scan only). ``share_ms_per_call`` times ``pager.share`` alone (one
call per layer per forward that shares).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

from harness.results import append_run, result_path
from harness.table import format_table
from harness.timing import sync
from kvcompose import Policy
from kvcompose.hf.cache import KVComposeCache

PRESETS = ("reasoncache", "reasoncache-random")
BUDGET_MS = 13.5  # ReasonCache's filter overhead per reasoning step (§V-C)
NOISE = 0.05

# ----------------------------------------------------------------- scripted reasoning text
DELIM = 0
DIGITS = list(range(1, 11))  # "0".."9"
VARS, ARITH, EQ, LPAR, RPAR, COMMA, STOP = [11, 12], [13, 14, 15], 16, 17, 18, 19, 20
WORDS = list(range(21, 21 + 30 + 200))
PIECES = (["\n\n"] + [str(d) for d in range(10)] + ["x", "y", "+", "-", "*", "=", "(", ")", ", ", "."]
          + ["Let ", "So ", "check ", "the ", "we ", "get ", "Wait, ", "verify ", "answer ", "is ", "then ",
             "equation ", "solve ", "Now ", "substitute ", "both ", "sides ", "gives ", "which ", "means ", "value ",
             "of ", "and ", "again ", "step ", "first ", "next ", "because ", "term ", "sum "]
          + [f"w{i} " for i in range(200)])
SWAPS = [DIGITS, VARS, ARITH, WORDS]  # a verification that changes one token swaps it within its kind


class ScriptTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(PIECES[i] for i in ids)


def number(rng: random.Random) -> list[int]:
    return [DIGITS[int(c)] for c in str(rng.randint(1, 99))]


def formula(rng: random.Random) -> list[int]:
    x, op = rng.choice(VARS), rng.choice(ARITH)
    kind = rng.randrange(3)
    if kind == 0:  # 2x+5=10
        return number(rng) + [x, op] + number(rng) + [EQ] + number(rng)
    if kind == 1:  # x=7
        return [x, EQ] + number(rng)
    return [LPAR] + number(rng) + [op] + number(rng) + [RPAR, ARITH[2]] + number(rng) + [EQ] + number(rng)


def new_step(rng: random.Random, formula_share: float) -> list[int]:
    n = rng.randint(20, 80)
    words = lambda k: [rng.choice(WORDS) for _ in range(max(k, 1))]  # noqa: E731
    if rng.random() < formula_share:
        f = formula(rng)
        ids = words(rng.randint(2, 10)) + f + [COMMA]
        ids += words(n - len(ids) - 2)
    else:
        ids = words(n - 2)
    return ids + [STOP, DELIM]


def script(rng: random.Random, prompt: int, tokens: int, repeat_share: float, formula_share: float):
    """A sequence's ids (prompt then ``tokens`` generated) and, per id, the index of the id whose
    keys and values it repeats (-1: fresh)."""
    ids = [rng.choice(WORDS) for _ in range(prompt)]
    src = [-1] * prompt
    steps: list[tuple[int, int]] = []  # (first index, length) of finished steps
    while len(ids) < prompt + tokens:
        if steps and rng.random() < repeat_share:
            first, n = rng.choice(steps[-10:])  # verify one of the recent steps
            step, step_src = ids[first:first + n], list(range(first, first + n))
            if rng.random() < 0.5:  # change one token of the repeat
                i = rng.choice([i for i, t in enumerate(step) if any(t in kind for kind in SWAPS)])
                kind = next(kind for kind in SWAPS if step[i] in kind)
                step[i], step_src[i] = rng.choice([t for t in kind if t != step[i]]), -1
        else:
            step = new_step(rng, formula_share)
            step_src = [-1] * len(step)
        steps.append((len(ids), len(step)))
        ids += step
        src += step_src
    return ids[:prompt + tokens], src[:prompt + tokens]


# ---------------------------------------------------------------------------- one run
def stats(ms: list[float]) -> dict:
    if not ms:
        return {"calls": 0, "mean": None, "p50": None, "p95": None, "max": None}
    a = np.asarray(ms)
    return {"calls": len(ms), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "max": float(a.max())}


def run(preset: str, filter_fields: dict, args, device: torch.device, dtype: torch.dtype) -> dict:
    B, L, H, D, P, N = args.batch, args.layers, args.kv_heads, args.head_dim, args.prompt, args.steps
    policy = Policy.from_preset(preset, filter=filter_fields) if filter_fields else Policy.from_preset(preset)
    cache = KVComposeCache(policy, num_layers=L, tokenizer=ScriptTokenizer())
    for layer in cache.layers:
        layer.store = policy.make_store(B, H, D, dtype, device)
        layer.dtype, layer.device, layer.is_initialized = dtype, device, True

    share_ms: list[float] = []
    plain_share = policy.pager.share

    def timed_share(*a, **kw):  # the tracker calls policy.pager.share once per layer
        sync(device)
        t0 = time.perf_counter()
        plain_share(*a, **kw)
        sync(device)
        share_ms.append(1e3 * (time.perf_counter() - t0))

    policy.pager.share = timed_share

    rows = [script(random.Random(f"{args.seed}:{b}"), P, N, args.repeat_share, args.formula_share) for b in range(B)]
    ids = torch.tensor([r[0] for r in rows])  # [B, P + N] on the host, as the cache's token stream keeps them
    src = torch.tensor([r[1] for r in rows], device=device)
    fresh_mask = (src < 0)[None, :, :, None, None]  # [1, B, T, 1, 1]: tokens with keys/values of their own
    src = src.clamp(min=0)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    # Every token's keys/values of every layer, [L, B, T, H, D], so a repeat can copy its original's.
    hist_k = torch.empty(L, B, P + N, H, D, device=device, dtype=dtype)
    hist_v = torch.empty_like(hist_k)
    hist_k[:, :, :P], hist_v[:, :, :P] = randn(L, B, P, H, D), randn(L, B, P, H, D)
    arange = torch.arange(B, device=device)

    tracker = cache.sharing
    cache.observe_tokens(ids[:, :P])
    for l, layer in enumerate(cache.layers):  # the prefill
        layer.store.append(hist_k[l, :, :P].transpose(1, 2), hist_v[l, :, :P].transpose(1, 2))
    sync(device)
    t0 = time.perf_counter()
    tracker.after_forward()
    sync(device)
    prefill_ms = 1e3 * (time.perf_counter() - t0)

    deciding, scanning, steps_per_call = [], [], []
    for t in range(P, P + N):
        fresh = fresh_mask[:, :, t]  # [1, B, 1, 1]
        nk, nv = randn(L, B, H, D), randn(L, B, H, D)
        k = torch.where(fresh, nk, hist_k[:, arange, src[:, t]] + NOISE * nk)
        v = torch.where(fresh, nv, hist_v[:, arange, src[:, t]] + NOISE * nv)
        hist_k[:, :, t], hist_v[:, :, t] = k, v
        cache.observe_tokens(ids[:, t:t + 1])
        for l, layer in enumerate(cache.layers):
            layer.store.append(k[l, :, :, None], v[l, :, :, None])
        before = tracker.steps_decided
        sync(device)
        t0 = time.perf_counter()
        tracker.after_forward()
        sync(device)
        ms = 1e3 * (time.perf_counter() - t0)
        if tracker.steps_decided > before:
            deciding.append(ms)
            steps_per_call.append(tracker.steps_decided - before)
        else:
            scanning.append(ms)

    sh = cache.report().sharing
    per_step_end = stats(deciding)
    record = {
        "preset": preset, "config": policy.to_config(), "batch": B, "layers": L, "kv_heads": H, "head_dim": D,
        "dtype": str(dtype).removeprefix("torch."), "prompt": P, "steps": N,
        "repeat_share": args.repeat_share, "formula_share": args.formula_share,
        "prefill_ms": prefill_ms,
        "filter_ms_per_step_end": per_step_end,
        "filter_ms_scan_only": stats(scanning),
        "filter_ms_per_forward": float(np.mean(deciding + scanning)),
        "filter_ms_per_decided_step": float(np.sum(deciding) / sh["steps"]) if sh["steps"] else None,
        "steps_per_deciding_call": float(np.mean(steps_per_call)) if steps_per_call else 0.0,
        "share_ms_per_call": float(np.mean(share_ms)) if share_ms else None,
        "share_calls": len(share_ms),
        "steps_decided": sh["steps"], "decisions": sh["decisions"], "shared_blocks": sh["shared_blocks"],
        "shareable_blocks": sh["shareable_blocks"], "shared_entries": sh["shared_entries"],
        "share_rate": sh["share_rate"], "saved_bytes": sh["saved_bytes"],
        "memory_saving_ratio": sh["memory_saving_ratio"],
        "budget_ms_per_step": BUDGET_MS,
        "within_budget": per_step_end["p95"] is not None and per_step_end["p95"] <= BUDGET_MS,
        # A call decides up to one step per row (all rows' buffers flush together here): per step too.
        "within_budget_per_step": bool(sh["steps"] and np.sum(deciding) / sh["steps"] <= BUDGET_MS),
        "tracker_report": {k: sh[k] for k in ("filter_ms_per_step", "filter_ms_per_forward")},
    }
    del cache, hist_k, hist_v
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(result_path("sharing_gpu")), help="history file the run is added to")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--layers", type=int, help="default 32 (smoke: 4)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, help="default 16 (smoke: 2)")
    ap.add_argument("--prompt", type=int, help="default 512 (smoke: 64)")
    ap.add_argument("--steps", type=int, help="decode steps, tokens generated per sequence: default 2048 (smoke: 1024)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeat-share", type=float, default=0.5, help="share of steps that repeat an earlier one")
    ap.add_argument("--formula-share", type=float, default=0.3, help="share of new steps with a formula")
    ap.add_argument("--random-rate", type=float, help="reasoncache-random's rate (default: reasoncache's share rate "
                                                        "of this run, else the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on --device cpu, as is on cuda)")
    ap.add_argument("--smoke", action="store_true", help="4 layers, batch 2, prompt 64, 1024 steps")
    args = ap.parse_args(argv)
    for name, full, smoke in (("layers", 32, 4), ("batch", 16, 2), ("prompt", 512, 64), ("steps", 2048, 1024)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_sharing_gpu: no CUDA GPU; use --device cpu (with --smoke)")
    if args.threads or device.type == "cpu":  # tiny tensors: waking a thread pool costs more than the work
        torch.set_num_threads(args.threads or 1)

    records = []
    rate = args.random_rate
    for preset in args.presets:
        fields = {}
        if preset == "reasoncache-random" and rate is not None:
            fields = {"rate": rate}
        record = run(preset, fields, args, device, dtype)
        if preset == "reasoncache-random":
            record["random_rate"] = record["config"]["filter"]["rate"]
            record["random_rate_source"] = ("--random-rate" if args.random_rate is not None else
                                            "reasoncache's share_rate of this run" if rate is not None else "preset")
        if preset == "reasoncache" and rate is None:
            rate = record["share_rate"]
        records.append(record)
        s = record["filter_ms_per_step_end"]
        print(f"{preset}: {record['steps_decided']} steps, {record['shared_blocks']}/{record['shareable_blocks']} "
              f"blocks shared, step-end p95 {s['p95']} ms", flush=True)

    def f(x, digits=2):
        return None if x is None else f"{x:.{digits}f}"

    headers = ["preset", "steps", "shared/shareable", "rate", "mem saved", "step-end mean", "p50", "p95", "max",
               "steps/call", "ms/step", "scan-only", "share/call", "p95 in budget"]
    body = [[r["preset"], r["steps_decided"], f"{r['shared_blocks']}/{r['shareable_blocks']}",
             f(r["share_rate"], 3), f(r["memory_saving_ratio"], 3)]
            + [f(r["filter_ms_per_step_end"][k]) for k in ("mean", "p50", "p95", "max")]
            + [f(r["steps_per_deciding_call"]), f(r["filter_ms_per_decided_step"])]
            + [f(r["filter_ms_scan_only"]["mean"], 3), f(r["share_ms_per_call"], 3), r["within_budget"]]
            for r in records]
    print(f"\nReasonCache sharing, {device.type}: L={args.layers} B={args.batch} Hkv={args.kv_heads} D={args.head_dim} "
          f"{args.dtype}, prompt {args.prompt}, {args.steps} steps; ms per after_forward call (budget {BUDGET_MS} ms)")
    print(format_table(headers, body))
    result = {
        "benchmark": "sharing_gpu",
        "smoke": args.smoke,
        "timing": "host wall clock of each decode step's SharingTracker.after_forward call (the prefill's is "
                  "prefill_ms), CUDA synchronized before and after; share_ms_per_call: pager.share alone, "
                  "synchronized likewise",
        "results": records,
    }
    print(f"wrote {append_run(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
