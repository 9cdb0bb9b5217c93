"""The tensor-parallel benchmark on CPU: ``--smoke`` at TP 1, then TP 2 added to the same run by a
second command (``--resume``), its ranks over gloo, writes records with the fields the results
page reads, and its ranks agree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tp_gpu.py"


def test_a_cpu_smoke_run_records_every_degree_with_agreeing_ranks(tmp_path):
    out = tmp_path / "tp_gpu.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}  # torch references on both sides
    common = [sys.executable, str(BENCH), "--smoke", "--kinds", "same_batch", "--policies", "rkv",
              "--checkpoint", str(tmp_path / "model"), "--out", str(out), "--run", "smoke-tp"]
    for degrees in (["--tp", "1"], ["--tp", "2", "--resume"]):
        done = subprocess.run(common + degrees, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1  # the second command continued the first one's run
    run = runs[0]
    assert run["smoke"] and run["environment"]["git_commit"]
    records = {(r["tp"], r["policy"]): r for r in run["records"]}
    assert set(records) == {(1, "rkv"), (2, "rkv")}
    for r in records.values():
        assert "error" not in r, r
        assert r["ranks_agree"] is True and r["kind"] == "same_batch" and r["batch"] == 4
        assert r["ms_per_step"] > 0 and r["tok_per_s"] > 0 and r["floor_ms_per_step"] > 0
    assert records[(1, "rkv")]["scaling_vs_tp1"] == 1.0
    assert records[(2, "rkv")]["scaling_vs_tp1"] == records[(2, "rkv")]["tok_per_s"] / records[(1, "rkv")]["tok_per_s"]
    assert records[(2, "rkv")]["eviction_steps"] > 0  # the ranks agreed through evictions


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would start the full run")
def test_without_a_gpu_only_the_smoke_check_runs(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--tp", "1"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2 and "only --smoke --kinds same_batch runs" in done.stderr
