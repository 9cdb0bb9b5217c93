"""The eviction-step profiler on CPU: a ``--smoke`` run profiles every scheduled compression of
a tiny model and records its operators per eviction step."""

import json
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"


def test_a_smoke_run_records_the_eviction_steps_and_their_operators(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(TOOLS.parent))
    monkeypatch.syspath_prepend(str(TOOLS))
    sys.modules.pop("profile_eviction_step", None)
    import profile_eviction_step as tool

    out = tmp_path / "eviction.json"
    assert tool.main(["--smoke", "--policies", "rkv", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][-1]
    assert run["smoke"] and run["environment"]["git_commit"]
    (record,) = run["records"]
    assert record["policy"] == "rkv" and record["eviction_steps"] >= 1 and record["time_unit"] == "CPU ms"
    kernels = record["kernels"]
    assert 0 < len(kernels) <= 20 and record["refresh_ms"] == 0  # R-KV has no thought classes to refresh
    assert sum(k["ms_per_step"] for k in kernels) <= record["ms_per_eviction_step"] + 1e-9
    assert [k["ms_per_step"] for k in kernels] == sorted((k["ms_per_step"] for k in kernels), reverse=True)
    from kvcompose.runtime import compression, layer, thoughts

    assert layer.compress is compression.compress  # the profiling hooks are gone
    assert thoughts.ThoughtTracker.observe.__name__ == "observe"
