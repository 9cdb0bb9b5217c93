"""The eviction-step operator counter on CPU: a ``--smoke`` run counts the operators and kernel
launches of every scheduled compression and every buffer flush by call site, and leaves nothing
patched behind."""

import re
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"


def test_a_smoke_run_counts_operators_and_launches_by_call_site(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(TOOLS.parent))
    monkeypatch.syspath_prepend(str(TOOLS))
    sys.modules.pop("count_eviction_ops", None)
    import count_eviction_ops as tool
    from kvcompose.ops import compact_rows, dispatch, scatter_slots
    from kvcompose.runtime import compression, layer

    from kvcompose.paging.store import LayerStore
    from kvcompose.paging.store_static import StoreStatic

    run, init, flushing = type(scatter_slots._copy_kernel).run, LayerStore.__init__, StoreStatic._flush_full_rows
    assert tool.main(["--smoke", "--policies", "rkv", "--top", "60"]) == 0
    out = capsys.readouterr().out
    head = re.match(r"rkv: (\d+) eviction steps, ([\d.]+) operators and launches per layer", out)
    assert head and int(head.group(1)) >= 1 and float(head.group(2)) > 20
    sites = re.findall(r"^\s+([\d.]+)\s+(\S+\.py):\d+ \w+", out, flags=re.M)
    assert any(path == "paging/store_static.py" for _, path in sites)  # the compaction is counted where it runs
    assert "triton _compact_rows_kernel" in out and "triton _copy_kernel" in out  # launches, as on a GPU
    flush = re.search(r"^rkv: (\d+) buffer flushes, ([\d.]+) operators and launches per layer and buffer flush$"
                      r"(.*)", out, flags=re.M | re.S)
    assert flush and int(flush.group(1)) >= 1 and float(flush.group(2)) > 0
    assert "triton _copy_kernel" in flush.group(3)  # the pool write: one launch
    assert "decoded_slots" not in flush.group(3)  # no decoded copy, as on a GPU
    assert layer.compress is compression.compress  # nothing stays patched
    assert type(scatter_slots._copy_kernel).run is run
    assert compact_rows.step_kernel_runs is dispatch.step_kernel_runs
    assert LayerStore.__init__ is init and StoreStatic._flush_full_rows is flushing
