"""The end-to-end benchmark on CPU: its bookkeeping (adding its run to the JSON history), its
scenarios, and a ``--smoke --device cpu`` run whose records carry the floor and the ratios.
Scenario c's batch search is :mod:`kvcompose.speed`'s (tests/hf/test_decode_timing.py)."""

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

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
    args = argparse.Namespace(run="b7", smoke=False, attention_kernels="Triton; INT4 pools: CUDA")
    log = bench.open_log(str(path))
    rows = [{"policy": "transformers-static", "scenario": "b"}]
    bench.save(log, rows, args, 3.9)
    rows.append({"policy": "rkv", "scenario": "b"})
    bench.save(log, rows, args, 3.9)  # saved after every record: the run's own entry grows

    runs = json.loads(path.read_text())["runs"]
    assert runs[0] == old and len(runs) == 2
    new = runs[1]
    assert new["run"] == "b7" and [r["policy"] for r in new["records"]] == ["transformers-static", "rkv"]
    assert new["copy_tbps"] == 3.9 and "kv_bytes_read_per_step" in new["floor_method"]
    assert new["attention_kernels"] == "Triton; INT4 pools: CUDA"  # which kernels the run used
    assert all(r["run"] == "b7" and r["date"] == new["environment"]["date"] for r in new["records"])
    assert {"allocator", "gpu", "versions", "git_commit", "git_dirty"} <= set(new["environment"])

    bench.save(bench.open_log(str(path)), [{"policy": "fp8", "scenario": "a"}], argparse.Namespace(run=None, smoke=False))
    later = json.loads(path.read_text())["runs"]
    assert later[:2] == runs and later[2]["run"] == "a"  # unlabelled: the first scenario


def test_without_out_nothing_is_written(bench, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench.save(bench.open_log(None), [{"policy": "fullkv", "scenario": "a"}], argparse.Namespace(run=None, smoke=False))
    assert list(tmp_path.iterdir()) == []


def test_scenarios_keep_a_b_and_c_and_add_a_long_prompt(bench):
    assert bench.SCENARIOS["long"] == dict(batch=16, prompt=8192, new=512, budget=1024)
    assert [bench.SCENARIOS[s]["new"] for s in ("a", "b", "c")] == [2048, 8192, 8192]
    assert bench.SMOKE_LONG["prompt"] > bench.SMOKE_LONG["budget"]  # its smoke check also prefills past the budget
    with pytest.raises(SystemExit):
        bench.main(["--scenarios", "a,d"])  # refused before any model is built


def test_smoke_on_cpu_times_the_same_steps_on_both_sides_with_floors_and_ratios(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "copy_tbps", lambda device: 0.02)  # a 2 GiB copy on a CPU takes half a minute
    out = tmp_path / "e2e.json"
    assert bench.main(["--smoke", "--device", "cpu", "--scenarios", "a,long", "--policies", "fullkv,rkv",
                       "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][-1]
    assert run["smoke"] and run["copy_tbps"] == 0.02 and run["floor_method"]
    assert {"gpu", "versions", "git_commit", "git_dirty"} <= set(run["environment"])
    records = run["records"]
    assert [(r["scenario"], r["policy"]) for r in records] == [
        (s, p) for s in ("a", "long") for p in ("transformers-static", "fullkv", "rkv")]
    for r in records:
        shape = bench.SMOKE_LONG if r["scenario"] == "long" else bench.SMOKE
        assert r["timed_steps"] == shape["new"] - 1 and r["batch"] == shape["batch"]  # every new token, both sides
        assert r["floor_ms_per_step"] == pytest.approx(
            1e3 * (r["weight_bytes_per_step"] + r["kv_bytes_read_per_step"]) / 0.02e12)
        assert r["floor_ratio"] == pytest.approx(r["ms_per_step"] / r["floor_ms_per_step"])
        same = [x for x in records if x["scenario"] == r["scenario"]]
        fullkv = next(x for x in same if x["policy"] == "fullkv")
        assert r["ratio_to_fullkv"] == pytest.approx(r["tok_per_s"] / fullkv["tok_per_s"])
        if r["policy"] == "transformers-static":
            assert r["cache_len"] == shape["prompt"] + shape["new"]
            assert r["kv_bytes_read_per_step"] == r["kv_bytes"]  # its whole reserved cache
        else:
            assert r["kv_bytes_read_per_step"] == (r["kv_live_bytes_after_prefill"] + r["kv_live_bytes_at_end"]) / 2
            assert r["pool_layout"] == "head"  # what the preset ran on: the results page names the others
    rkv_long = next(r for r in records if r["scenario"] == "long" and r["policy"] == "rkv")
    full_long = next(r for r in records if r["scenario"] == "long" and r["policy"] == "fullkv")
    assert rkv_long["kv_live_bytes_after_prefill"] < full_long["kv_live_bytes_after_prefill"]  # prompt over budget


def test_fixed_memory_times_the_same_window_on_both_sides(bench, monkeypatch):
    given = {}

    def fit_baseline(model, prompt, new, cap, window):
        given["baseline"] = (prompt, new, window)
        return {"batch": 48, "new_tokens": window, "timed_steps": window - 1, "tok_per_s": 100.0, "ms_per_step": 480.0,
                "weight_bytes_per_step": 1, "kv_bytes_read_per_step": 1}

    def fit_policy(model, policy, prompt, new, cap, window, retries, start_batch=None):
        given.setdefault("policies", []).append((prompt, new, window))
        given.setdefault("starts", []).append(start_batch)
        return {"batch": 400, "new_tokens": window, "timed_steps": window - 1, "tok_per_s": 1000.0,
                "ms_per_step": 400.0, "weight_bytes_per_step": 1, "kv_bytes_read_per_step": 1}

    monkeypatch.setattr(bench, "fit_transformers_static", fit_baseline)
    monkeypatch.setattr(bench, "fit_policy", fit_policy)
    monkeypatch.setattr(bench, "make_policy", lambda name, budget, smoke: SimpleNamespace(pool_layout="head"))
    args = argparse.Namespace(smoke=False, memory_gib=70.0, window=768, oom_retries=4, start_batch={"rkv": 331})
    rows = bench.run_scenario(None, "c", dict(bench.SCENARIOS["c"]), ["rkv", "fullkv"], args, 4.0)
    assert given["baseline"] == (512, 8192, 768) and given["policies"] == [(512, 8192, 768)] * 2
    assert given["starts"] == [None, 331]  # --start-batch rkv=331: fullkv from the estimate
    assert [r["policy"] for r in rows] == ["transformers-static", "fullkv", "rkv"]  # the reference first
    assert [r["timed_steps"] for r in rows] == [767] * 3
    assert [r["ratio_to_fullkv"] for r in rows] == [0.1, 1.0, 1.0] and rows[2]["ratio_to_baseline"] == 10.0


def test_start_batches_are_parsed_per_policy_and_bad_ones_are_named(bench):
    assert bench.start_batches("thinkv=683,fullkv=51") == {"thinkv": 683, "fullkv": 51}
    assert bench.start_batches("") == {}
    for bad in ("thinkv", "thinkv=0", "=5", "thinkv=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="give policy=rows"):
            bench.start_batches(bad)


def test_policy_names_add_a_rotation_and_a_pool_layout(bench):
    policy = bench.make_policy("nvfp4+hadamard@head", 64, False)
    assert policy.rotation.name == "hadamard" and policy.pool_layout == "head" and policy.precision["all"].name == "nvfp4"
    assert bench.make_policy("rkv@slot", 64, False).pool_layout == "slot"
    assert bench.make_policy("rkv", 64, False).pool_layout == "head"  # the Policy default
    with pytest.raises(ValueError, match="accepted: 'slot', 'head'"):
        bench.make_policy("rkv@heads", 64, False)
