"""One eviction step of one layer on CPU, per preset, against the candidate count.

Run (from the repository root)::

    pytest benchmarks/bench_eviction_cpu.py --benchmark-json benchmarks/results/eviction_cpu.json

Each benchmark builds one layer holding ``candidates`` live tokens per sequence
(random keys and values, random recorded queries) and times what
``kvcompose.runtime.compression.compress`` does once its trigger fires: build the eviction context
(protected tokens, slot channels), score + select (``evictor.select``) and compact
the store (``pager.compact``), keeping ``candidates - 128`` tokens (R-KV's buffer).
Every round starts from a fresh copy of the same state (``benchmark.pedantic``
setup, not timed). ``conftest.py`` adds the environment to the JSON and writes a
compact summary beside it.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from harness import eviction

CANDIDATES = (256, 512, 1024, 2048)
BATCHES = (1, 4)
SHAPE = dict(q_heads=8, kv_heads=2, head_dim=64, dtype=torch.float32, prompt=32)  # GQA 4, like Llama 3
TARGET_S = 2.0  # timed seconds aimed at per benchmark (rounds are chosen from one untimed run)
ROUNDS = (5, 50)  # at least, at most

CASES = list(itertools.product(eviction.PRESETS, BATCHES, CANDIDATES))


def scenario(preset: str, batch: int, candidates: int) -> eviction.Scenario:
    return eviction.Scenario(preset, batch, keep=candidates - eviction.BUFFER, candidates=candidates, **SHAPE)


def rounds_for(seconds_per_eviction: float) -> int:
    return max(ROUNDS[0], min(ROUNDS[1], int(TARGET_S / max(seconds_per_eviction, 1e-6))))


@pytest.mark.parametrize(("preset", "batch", "candidates"), CASES, ids=[f"{p}-B{b}-L{n}" for p, b, n in CASES])
def test_eviction_step(benchmark, preset, batch, candidates):
    s = scenario(preset, batch, candidates)
    state = eviction.build_state(s, "cpu")
    start = time.perf_counter()
    matches = eviction.check_eviction(state)  # two evictions (ours and the library's compression), untimed
    per_eviction = (time.perf_counter() - start) / 2
    assert matches is not False, "the benchmark's eviction context differs from the library's compression"

    benchmark.group = f"batch {batch}"
    benchmark.extra_info.update(s.describe(), matches_policy_compress=matches)
    benchmark.pedantic(
        eviction.evict, setup=lambda: ((state.fresh(),), {}), rounds=rounds_for(per_eviction), warmup_rounds=1
    )
