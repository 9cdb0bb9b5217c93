"""The compaction benchmark on CPU: a ``--smoke`` run adds its records to the history, and the
shared row reserve allocates less than a reservation per class."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_smoke_run_records_every_variant_and_the_reserve_saves_memory(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_compaction_gpu", None)
    import bench_compaction_gpu as bench

    out = tmp_path / "compaction.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][-1]
    assert run["smoke"] and run["environment"]["git_commit"]
    rows = {(r["reserve"], r["writes"]): r for r in run["records"]}
    assert set(rows) == {("per_class", "torch"), ("shared", "torch"), ("shared", "kernels")}
    assert all(r["ms_per_layer"] > 0 and r["kernel_ms_per_layer"] is None for r in rows.values())  # no GPU
    per_class, shared = rows["per_class", "torch"], rows["shared", "torch"]
    assert shared["allocated_bytes_per_layer"] < per_class["allocated_bytes_per_layer"]
    assert shared["allocated_bytes_per_layer"] == rows["shared", "kernels"]["allocated_bytes_per_layer"]
