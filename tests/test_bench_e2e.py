"""The end-to-end benchmark's bookkeeping (merging records into its JSON), on CPU. Scenario c's
batch search is :mod:`kvcompose.speed`'s (tests/test_static_decode.py)."""

import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))  # restored after
    sys.modules.pop("bench_e2e_gpu", None)
    import bench_e2e_gpu

    return bench_e2e_gpu


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
