"""The end-to-end benchmark's bookkeeping (adding its run to the JSON history), on CPU. Scenario c's
batch search is :mod:`kvcompose.speed`'s (tests/test_static_decode.py)."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))  # restored after
    sys.modules.pop("bench_e2e_gpu", None)
    import bench_e2e_gpu

    return bench_e2e_gpu


def test_a_run_is_added_to_the_history_and_earlier_runs_stay_as_they_were(bench, tmp_path):
    path = tmp_path / "e2e_gpu.json"
    old = {"environment": {"runs": {"b4": "2026-01-01"}}, "notes": "kept",
           "records": [{"policy": "transformers-static", "scenario": "b", "run": "b4"},
                       {"policy": "rkv", "scenario": "b", "run": "b4"}]}
    path.write_text(json.dumps(old))
    args = argparse.Namespace(run="b7", smoke=False)
    log = bench.open_log(str(path))
    rows = [{"policy": "transformers-static", "scenario": "b"}]
    bench.save(log, rows, args)
    rows.append({"policy": "rkv", "scenario": "b"})
    bench.save(log, rows, args)  # saved after every record: the run's own entry grows

    runs = json.loads(path.read_text())["runs"]
    assert runs[0] == old and len(runs) == 2
    new = runs[1]
    assert new["run"] == "b7" and [r["policy"] for r in new["records"]] == ["transformers-static", "rkv"]
    assert all(r["run"] == "b7" and r["date"] == new["environment"]["date"] for r in new["records"])
    assert {"allocator", "gpu", "versions", "git_commit", "git_dirty"} <= set(new["environment"])

    bench.save(bench.open_log(str(path)), [{"policy": "fp8", "scenario": "a"}], argparse.Namespace(run=None, smoke=False))
    later = json.loads(path.read_text())["runs"]
    assert later[:2] == runs and later[2]["run"] == "a"  # unlabelled: the first scenario


def test_without_out_nothing_is_written(bench, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench.save(bench.open_log(None), [{"policy": "fullkv", "scenario": "a"}], argparse.Namespace(run=None, smoke=False))
    assert list(tmp_path.iterdir()) == []
