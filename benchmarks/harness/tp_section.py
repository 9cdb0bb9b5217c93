"""The results page's section on tensor-parallel decode (``tp_gpu.json``)."""

from __future__ import annotations

from .results import RESULTS_DIR, read_runs
from .table import NONE, markdown_table, run_gpu

BATCH_LIMIT = 1024  # where bench_tp_gpu.py's fixed-memory search stops

TP_KINDS = {
    "same_batch": "**Same batch.** Every degree decodes the same batch; *x TP=1* is tok/s over the same policy's at TP = 1.",
    "fixed_memory": "**Fixed memory per GPU.** The largest batch whose peak on every GPU stays under the cap "
                    "(weights included), timed over the run's window; *x TP=1* compares tok/s across batches. The "
                    f"search stops at {BATCH_LIMIT:,} rows (*search limit*: more would fit).",
}


def tensor_parallel(lines: list[str]) -> None:
    """The newest record of each (kind, policy, TP, workload) over the non-smoke runs of ``tp_gpu.json``: a
    run at another batch or length adds rows instead of replacing those it does not measure."""
    newest = {}
    for run in (r for r in read_runs(RESULTS_DIR / "tp_gpu.json") if not r.get("smoke")):
        for rec in run["records"]:
            rec = dict(_workload(run, rec), **rec, run=run["run"])
            key = ("prompt", "new_tokens", "batch") if rec["kind"] == "same_batch" else ("prompt", "memory_cap_gib")
            newest[(rec["kind"], rec["policy"], rec["tp"], *(rec.get(k) for k in key))] = rec
    if not newest:
        return
    lines += ["## Tensor-parallel decode", "",
              "`benchmarks/bench_tp_gpu.py`: a Llama-3-8B-shaped model with random bf16 weights, loaded by "
              "transformers with its tensor-parallel plan, one torchrun per degree; each rank's cache holds its KV "
              "heads and all-reduces the decisions that combine heads. *ms/step* is rank 0's decode wall time with "
              "the one-time work of its CUDA graphs, *steady* its GPU time per step without it, *floor* the rank's "
              "weight shards and KV bytes over the copy bandwidth of its GPU. *ranks agree*: every layer of every "
              "rank held the positions rank 0 held at the end.", ""]
    for kind, method in TP_KINDS.items():
        recs = [r for (k, *_), r in newest.items() if k == kind]
        if not recs:
            continue
        rows = [[r["run"], run_gpu({"gpu": r.get("gpu")}), r["tp"], r["policy"], _batch(r), _tokens(r),
                 *(f"{r[c]:.2f}" if r.get(c) is not None else NONE for c in ("ms_per_step", "steady_ms_per_step",
                                                                            "floor_ms_per_step")),
                 f"{r['tok_per_s']:,.0f}" if r.get("tok_per_s") else NONE,
                 f"{r['scaling_vs_tp1']:.2f}" if r.get("scaling_vs_tp1") else NONE, r.get("ranks_agree", NONE),
                 f"{r['peak_gib']:.1f}" if r.get("peak_gib") else NONE, _error(r)]
                for r in sorted(recs, key=lambda r: (r.get("batch", 0), r.get("prompt", 0), r["policy"] != "fullkv",
                                                     r["policy"], r["tp"]))]
        cap = next((r for r in recs if "memory_cap_gib" in r), None)
        lines += [method + (f" Cap {cap['memory_cap_gib']:g} GiB per GPU, room reserved for "
                            f"{cap['reserved_new_tokens']:,} new tokens." if cap else ""), ""]
        lines += markdown_table(["run", "GPU", "TP", "policy", "batch", "prompt + new (timed)", "ms/step",
                                 "steady ms/step", "floor ms/step", "tok/s", "x TP=1", "ranks agree", "peak GiB",
                                 "error"], rows) + [""]


def _workload(run: dict, record: dict) -> dict:
    """What a record measured, from the run's settings where the record lacks it (a failed one)."""
    settings = run.get("settings") or {}
    if record["kind"] == "same_batch":
        return {"prompt": settings.get("prompt"), "new_tokens": settings.get("new")}
    return {"prompt": settings.get("fixed_prompt"), "new_tokens": settings.get("window"),
            "memory_cap_gib": settings.get("memory_gib"), "reserved_new_tokens": settings.get("fixed_new")}


def _tokens(record: dict) -> str:
    """The prompt and the decode steps timed (a failed record has only its run's error)."""
    if record.get("prompt") is None:
        return NONE
    return f"{record['prompt']:,} + {record['new_tokens']:,}"


def _error(record: dict) -> str:
    """The kind of failure of a record that has no time (the whole message stays in the JSON)."""
    return record["error"].split(":")[0] if record.get("error") else ""


def _batch(record: dict):
    """The batch, marked where the fixed-memory search stopped at its limit (more rows would fit)."""
    at_limit = record.get("kind") == "fixed_memory" and (record.get("batch_limit_reached")
                                                        or record.get("batch", 0) >= BATCH_LIMIT)
    return f"{record.get('batch')} (search limit)" if at_limit else record.get("batch")
