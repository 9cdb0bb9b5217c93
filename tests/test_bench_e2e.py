"""The end-to-end benchmark's bookkeeping (scenario c's batch search, merging records), on CPU."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))  # restored after
    sys.modules.pop("bench_e2e_gpu", None)
    import bench_e2e_gpu

    return bench_e2e_gpu


def test_scenario_c_backs_off_from_out_of_memory_and_the_cap(bench):
    tried = []

    def run_at(batch):
        tried.append(batch)
        if batch > 150:
            raise torch.OutOfMemoryError("no room")
        return {"batch": batch, "peak_gib": batch / 2}  # over a 70 GiB cap above 140 rows

    row = bench.run_backing_off(run_at, 200, cap_gib=70.0, retries=4)
    assert tried == [200, 180, 162, 145, 130] and row["batch"] == 130
    assert row["over_cap_at"] == [200, 180, 162, 145] and not row["over_cap"]
    with pytest.raises(torch.OutOfMemoryError):
        bench.run_backing_off(run_at, 200, cap_gib=70.0, retries=2)
    assert bench.run_backing_off(run_at, 100, cap_gib=70.0, retries=2) == {
        "batch": 100, "peak_gib": 50.0, "over_cap": False, "over_cap_at": []}
    tried.clear()
    row = bench.run_backing_off(run_at, 145, cap_gib=70.0, retries=0)  # no retry left: kept, and flagged
    assert tried == [145] and row["over_cap"] and row["over_cap_at"] == []
    tried.clear()
    row = bench.run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 99.0}, 2, 70.0, 5)
    assert tried == [2, 1] and row["over_cap"]  # never below one row


def test_records_replace_their_policy_and_scenario_and_keep_referenced_baselines(bench, tmp_path):
    path = tmp_path / "e2e.json"
    old = [{"policy": "transformers-static", "scenario": "b", "run": "b4"},
           {"policy": "rkv", "scenario": "b", "run": "b4"},
           {"policy": "transformers-static", "scenario": "b", "run": "b5"},
           {"policy": "snapkv", "scenario": "b", "run": "b5"},
           {"policy": "rkv", "scenario": "a", "run": "a2"}]
    path.write_text(json.dumps({"environment": {"runs": {"b4": "x"}}, "notes": "kept", "records": old}))
    new = [{"policy": "transformers-static", "scenario": "b"}, {"policy": "rkv", "scenario": "b"}]
    bench.merge_into(path, new, "b7")
    data = json.loads(path.read_text())
    got = {(r["policy"], r["scenario"], r["run"]) for r in data["records"]}
    # b4's baseline goes with its last record (rkv, now b7); b5's stays for snapkv
    assert got == {("transformers-static", "b", "b5"), ("snapkv", "b", "b5"), ("rkv", "a", "a2"),
                   ("transformers-static", "b", "b7"), ("rkv", "b", "b7")}
    assert data["notes"] == "kept" and set(data["environment"]["runs"]) == {"b4", "b7"}
    assert data["environment"]["runs"]["b4"] == "x" and "allocator" in data["environment"]["runs"]["b7"]
    assert all("date" in r for r in data["records"] if r["run"] == "b7")
