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
    """The newest record of each (kind, policy, TP) over the non-smoke runs of ``tp_gpu.json``."""
    newest = {}
    for run in (r for r in read_runs(RESULTS_DIR / "tp_gpu.json") if not r.get("smoke")):
        for rec in run["records"]:
            newest[(rec["kind"], rec["policy"], rec["tp"])] = dict(rec, run=run["run"])
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
        recs = [r for (k, _, _), r in newest.items() if k == kind]
        if not recs:
            continue
        shape = (f"prompt {recs[0]['prompt']:,}, {recs[0]['new_tokens']:,} new tokens timed" +
                 (f", cap {recs[0]['memory_cap_gib']:g} GiB per GPU, room reserved for "
                  f"{recs[0]['reserved_new_tokens']:,} new tokens" if kind == "fixed_memory" else ""))
        rows = [[r["run"], run_gpu({"gpu": r.get("gpu")}), r["tp"], r["policy"], _batch(r),
                 *(f"{r[c]:.2f}" if r.get(c) is not None else NONE for c in ("ms_per_step", "steady_ms_per_step",
                                                                            "floor_ms_per_step")),
                 f"{r['tok_per_s']:,.0f}" if r.get("tok_per_s") else NONE,
                 f"{r['scaling_vs_tp1']:.2f}" if r.get("scaling_vs_tp1") else NONE, r.get("ranks_agree", NONE),
                 f"{r['peak_gib']:.1f}" if r.get("peak_gib") else NONE]
                for r in sorted(recs, key=lambda r: (r["policy"] != "fullkv", r["policy"], r["tp"]))]
        lines += [f"{method} {shape[0].upper() + shape[1:]}.", ""]
        lines += markdown_table(["run", "GPU", "TP", "policy", "batch", "ms/step", "steady ms/step", "floor ms/step", "tok/s",
                         "x TP=1", "ranks agree", "peak GiB"], rows) + [""]



def _batch(record: dict):
    """The batch, marked where the fixed-memory search stopped at its limit (more rows would fit)."""
    at_limit = record.get("kind") == "fixed_memory" and (record.get("batch_limit_reached")
                                                        or record.get("batch", 0) >= BATCH_LIMIT)
    return f"{record.get('batch')} (search limit)" if at_limit else record.get("batch")
