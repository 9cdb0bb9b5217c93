"""pytest-benchmark glue for the CPU benchmarks (not collected by the main test run: testpaths = tests).

- torch runs on ``KVCOMPOSE_BENCH_THREADS`` threads (default 1: steadier on shared machines);
- the environment (versions, host, date, commit) goes into the JSON's ``machine_info``;
- with ``--benchmark-json PATH``, a compact summary (median ms per preset, batch and
  candidate count) is added as a run to the history ``PATH`` stem + ``_summary.json``
  beside it, and printed as a table.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness import eviction
from harness.environment import environment
from harness.results import append_run
from harness.table import format_table

SUMMARY_TABLE = pytest.StashKey[str]()
SHAPE_KEYS = ("q_heads", "kv_heads", "head_dim", "dtype", "prompt")


def pytest_configure(config):
    torch.set_num_threads(int(os.environ.get("KVCOMPOSE_BENCH_THREADS", "1")))
    out = config.getoption("benchmark_json", None)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["kvcompose_environment"] = environment()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    rows = [summary_row(b) for b in output_json["benchmarks"]]
    summary = {
        "benchmark": "eviction_cpu",
        "measured": "one eviction step of one layer: context (protected, slot channels) + evictor.select + "
        "pager.compact; keep = candidates - 128; fresh copy of the state each round (untimed)",
        "shape": {k: output_json["benchmarks"][0]["extra_info"][k] for k in SHAPE_KEYS} if rows else None,
        "results": rows,
    }
    path = Path(config.getoption("benchmark_json"))
    append_run(path.with_name(path.stem + "_summary.json"), summary)
    config.stash[SUMMARY_TABLE] = summary_table(rows)


def pytest_terminal_summary(terminalreporter, config):
    table = config.stash.get(SUMMARY_TABLE, None)
    if table:
        terminalreporter.write_sep("-", "median ms per eviction step (one layer)")
        terminalreporter.write_line(table)


def summary_row(bench: dict) -> dict:
    info, stats = bench["extra_info"], bench["stats"]
    return {
        "preset": info["preset"],
        "batch": info["batch"],
        "candidates": info["candidates"],
        "keep": info["keep"],
        "median_ms": round(stats["median"] * 1e3, 3),
        "iqr_ms": round(stats["iqr"] * 1e3, 3),
        "min_ms": round(stats["min"] * 1e3, 3),
        "rounds": stats["rounds"],
        "matches_policy_compress": info.get("matches_policy_compress"),
    }


def summary_table(rows: list[dict]) -> str:
    """Preset rows by (batch, candidates) columns of median ms."""
    columns = sorted({(r["batch"], r["candidates"]) for r in rows})
    median = {(r["preset"], r["batch"], r["candidates"]): r["median_ms"] for r in rows}
    presets = [p for p in eviction.PRESETS if any(r["preset"] == p for r in rows)]
    body = [[p] + [_ms(median.get((p, b, n))) for b, n in columns] for p in presets]
    return format_table(["preset"] + [f"B{b} L{n}" for b, n in columns], body)


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"
