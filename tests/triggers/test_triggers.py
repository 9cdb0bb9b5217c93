"""Trigger schedules on scripted token counts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompose import registry
from kvcompose.triggers import Buffer, Interval, OverBudget, TriggerInput


def counts(stored, prompt, generated, budget=None) -> TriggerInput:
    t = lambda xs: torch.as_tensor(xs, dtype=torch.long)  # noqa: E731
    return TriggerInput(stored=t(stored), prompt=t(prompt), generated=t(generated), budget=budget)


def decode(trigger, prompt: int, steps: list[int], budget=None):
    """Run a trigger over a scripted decode of one row; ``steps`` are tokens appended per step.

    Returns ``(generated, stored before, kept)`` for every step where the trigger compressed.
    """
    stored, generated, events = prompt, 0, []
    for n in steps:
        stored += n
        generated += n
        keep = int(trigger.plan(counts([stored], [prompt], [generated], budget))[0])
        assert prompt <= keep <= stored or budget is not None
        if keep < stored:
            events.append((generated, stored, keep))
        stored = keep
    return events


def test_over_budget_still_trims_every_step():
    plan = OverBudget().plan(counts([5, 12, 20], [2, 2, 2], [3, 10, 18], budget=10))
    assert plan.tolist() == [5, 10, 10]
    assert OverBudget().plan(counts([50], [2], [48])).tolist() == [50]


# ---------------------------------------------------------------------- buffer
def test_buffer_compresses_back_to_budget_once_the_buffer_is_full():
    events = decode(Buffer(buffer=4), prompt=3, steps=[1] * 30, budget=10)
    # Stored climbs 4..14, drops to 10 at 14, then again every 4 tokens.
    assert events == [(11, 14, 10), (15, 14, 10), (19, 14, 10), (23, 14, 10), (27, 14, 10)]


def test_buffer_rows_are_independent_and_a_long_prefill_compresses_at_once():
    c = counts([900, 1151, 1152, 5000], [900, 30, 30, 5000], [0, 1121, 1122, 0], budget=1024)
    plan = Buffer(buffer=128).plan(c)
    assert plan.tolist() == [900, 1151, 1024, 1024]


def test_buffer_zero_is_over_budget():
    c = counts([5, 10, 11], [1, 1, 1], [4, 9, 10], budget=10)
    assert Buffer(buffer=0).plan(c).tolist() == OverBudget().plan(c).tolist()


def test_buffer_needs_a_budget():
    assert Buffer().needs_budget
    with pytest.raises(ValueError, match="budget"):
        Buffer().plan(counts([10], [1], [9]))


# -------------------------------------------------------------------- interval
def test_interval_follows_rpc_schedule():
    P, c, R, prompt = 16, 4, 3, 5
    events = decode(Interval(period=P, ratio=c, recent=R), prompt=prompt, steps=[1] * 70)
    # Compress at P, 2P, 3P, 4P generated tokens; after the k-th: prompt + k·P/c + R.
    assert events == [
        (16, prompt + 16, prompt + 4 + R),
        (32, prompt + 4 + R + 16, prompt + 8 + R),
        (48, prompt + 8 + R + 16, prompt + 12 + R),
        (64, prompt + 12 + R + 16, prompt + 16 + R),
    ]


def test_interval_paper_defaults():
    t = Interval()
    assert (t.period, t.ratio, t.recent) == (4096, 4, 32) and not t.needs_budget
    plan = t.plan(counts([100 + 4095, 100 + 4096, 100 + 1024 + 32 + 1], [100] * 3, [4095, 4096, 4097]))
    assert plan.tolist() == [100 + 4095, 100 + 1024 + 32, 100 + 1024 + 32 + 1]


def test_interval_catches_a_multiple_crossed_by_a_multi_token_step():
    events = decode(Interval(period=10, ratio=2, recent=1), prompt=0, steps=[4, 4, 4, 4, 4, 4])
    # generated 12 crosses 10: keep 5 + 1, plus the 2 tokens past the multiple; 20 is hit exactly.
    assert events == [(12, 12, 8), (20, 16, 11)]


def test_interval_rows_progress_independently():
    t = Interval(period=8, ratio=4, recent=2)
    c = counts(stored=[3 + 8, 3 + 6, 4 + 4 + 8, 4 + 4 + 1], prompt=[3, 3, 4, 4], generated=[8, 6, 16, 9])
    assert t.plan(c).tolist() == [3 + 4, 3 + 6, 4 + 6, 4 + 4 + 1]


@settings(max_examples=60, deadline=None)
@given(
    period=st.integers(1, 40),
    ratio=st.integers(1, 8),
    recent=st.integers(0, 10),
    prompt=st.integers(0, 20),
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=40),
)
def test_interval_bounds_memory(period, ratio, recent, prompt, steps):
    if period < ratio:
        return
    t = Interval(period=period, ratio=ratio, recent=recent)
    stored, generated = prompt, 0
    for n in steps:
        stored += n
        generated += n
        keep = int(t.plan(counts([stored], [prompt], [generated]))[0])
        assert prompt <= keep <= stored
        k = generated // period
        assert keep - prompt <= k * (period // ratio) + recent + (generated - k * period)
        stored = keep


# ------------------------------------------------------------ config and errors
@pytest.mark.parametrize(
    "cls, fields, words",
    [
        (Buffer, {"buffer": -1}, "buffer must be an int >= 0, got -1"),
        (Buffer, {"buffer": 1.5}, "buffer must be an int >= 0, got 1.5"),
        (Interval, {"period": 0}, "period must be an int >= 1, got 0"),
        (Interval, {"ratio": 0}, "ratio must be an int >= 1, got 0"),
        (Interval, {"ratio": True}, "ratio must be an int >= 1, got True"),
        (Interval, {"recent": -2}, "recent must be an int >= 0, got -2"),
        (Interval, {"period": 3, "ratio": 4}, r"period \(3\) must be >= ratio \(4\)"),
    ],
)
def test_field_validation_names_value_and_range(cls, fields, words):
    with pytest.raises(ValueError, match=words):
        cls(**fields)


def test_registry_round_trip():
    for spec in ({"name": "buffer", "buffer": 64}, {"name": "interval", "period": 1024, "ratio": 4, "recent": 32}):
        trigger = registry.build("trigger", spec)
        assert registry.to_config(trigger) == spec
        assert registry.build("trigger", registry.to_config(trigger)) == trigger
