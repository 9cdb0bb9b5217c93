"""The first-runs comparison runs end to end in its smoke setting (tiny model, CPU)."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_first_runs_smoke_times_both_ways_and_restores_the_signature(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(BENCH / "tools"))
    sys.modules.pop("first_runs_gpu", None)
    import first_runs_gpu
    from kvcompose.hf import static

    signature = static.decode_signature
    out = tmp_path / "first_runs.json"
    assert first_runs_gpu.main(["--smoke", "--device", "cpu", "--policies", "fullkv", "--repeats", "1",
                                "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][-1]
    assert run["smoke"] and run["environment"]["versions"]["torch"]
    assert [r["eager_first_runs"] for r in run["records"]] == [False, True]
    assert all(r["policy"] == "fullkv" and r["ms_per_step"] > 0 for r in run["records"])
    assert static.decode_signature is signature
