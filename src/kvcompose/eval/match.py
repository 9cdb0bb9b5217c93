"""Comparing presets at equal memory: each one's knob bisected until its measured memory meets a target."""

from __future__ import annotations

import math
import warnings
from typing import Iterable

from ..policies.overrides import apply_overrides
from .overrides import check_overrides, policy_label, preset_policy
from .replays import replay
from .trajectory import Trajectory

MATCH_TOLERANCE = 5.0  # percentage points: a calibrated memory farther than this from the target is reported


def match_memory(model, trajectory: Trajectory, presets: Iterable[str], target_pct: float, *,
                 overrides: dict | None = None, max_evals: int = 6, progress=None):
    """Per compressing preset, the knob value whose *measured* mean KV memory is closest to ``target_pct``.

    Nominal budgets are not comparable across presets (R-KV's buffer holds up to 128
    extra tokens, RPC has no budget at all), so each preset is calibrated by
    measurement. Method: replay ``trajectory`` (one prompt; the CLI uses the first)
    with memory accounting only, and run a geometric bisection on the knob, assuming
    memory grows with it: ``budget`` over ``[policy.min_budget(), prompt + steps]``
    for budgeted presets, ``trigger.period`` over ``[ratio, steps]`` for RPC's
    interval trigger. At most ``max_evals`` replays (+1 to probe the range's end when
    the target lies outside what was measured); the measured value closest to the
    target wins. A target the knob cannot reach (e.g. RPC keeps its prompt and 32
    recent tokens) is warned about and marked ``reached: False`` in the record.
    Returns ``({label: Policy}, calibration records)``.
    """
    presets = list(presets)
    check_overrides(presets, overrides)
    if trajectory.tokens.shape[0] != 1:
        raise ValueError("calibrate on a one-prompt trajectory (Trajectory.select(0))")
    prompt_len, steps = int(trajectory.attention_mask.sum()), trajectory.num_steps
    chosen, records = {}, []
    for name in presets:
        base = preset_policy(name, overrides)
        if base.evictor is None:
            chosen.setdefault(policy_label(base), base)
            continue
        if base.trigger.needs_budget:
            knob, lo, hi = "budget", base.min_budget(), prompt_len + steps

            def make(k, name=name):
                return preset_policy(name, overrides, budget=k)
        elif hasattr(base.trigger, "period"):
            knob, lo, hi = "trigger.period", max(base.trigger.ratio, 1), max(steps, base.trigger.ratio)

            def make(k, name=name):
                return preset_policy(name, apply_overrides(overrides or {}, {name: {"trigger": {"period": k}}}))
        else:
            warnings.warn(f"{name}: no budget or period to calibrate; it runs as configured")
            chosen.setdefault(policy_label(base), base)
            continue
        measured: dict[int, float] = {}

        def measure(k):
            if progress is not None:
                progress.set_postfix_str(f"calibrating {name} {knob}={k}")
            r = replay(model, trajectory, make(k), metrics=False, progress=progress)
            measured[k] = float(r.memory_pct.mean())
            return measured[k]

        a, b = lo, hi
        for _ in range(max_evals):
            if b - a <= 1:
                break
            mid = min(max(int(round(math.sqrt(a * b))), a + 1), b - 1)
            if measure(mid) < target_pct:
                a = mid
            else:
                b = mid
        if measured and all(m > target_pct for m in measured.values()) and lo not in measured:
            measure(lo)
        if measured and all(m < target_pct for m in measured.values()) and hi not in measured:
            measure(hi)
        if not measured:
            measure(lo)
        best = min(measured, key=lambda k: (abs(measured[k] - target_pct), k))
        reached = abs(measured[best] - target_pct) <= MATCH_TOLERANCE
        if not reached:
            warnings.warn(
                f"{name}: no {knob} in [{lo}, {hi}] brings the measured memory within {MATCH_TOLERANCE:g} points of "
                f"{target_pct:g}% on this trajectory (closest: {measured[best]:.1f}% at {knob}={best}); tokens the "
                "policy protects (prompt, sinks, recent window, buffer) set a floor that short runs cannot go below"
            )
        policy = make(best)
        chosen.setdefault(policy_label(policy), policy)
        records.append({"preset": name, "knob": knob, "value": best, "measured_pct": measured[best],
                        "target_pct": target_pct, "reached": reached,
                        "tried": {str(k): v for k, v in sorted(measured.items())}})
    return chosen, records


def match_share_rate(model, trajectory: Trajectory, policies: dict, *, overrides: dict | None = None,
                     tokenizer=None, progress=None) -> dict | None:
    """ReasonCache's random baseline at ReasonCache's memory saving: replay ``reasoncache`` on
    ``trajectory`` (memory only), and give ``reasoncache-random`` (in ``policies``, replaced in
    place) the share rate it measured, so both share the same fraction of sealed step blocks.
    Skipped (None) unless both presets are compared and ``--set`` leaves the random rate alone."""
    labels = {p.name: label for label, p in policies.items()}
    if not {"reasoncache", "reasoncache-random"} <= set(labels):
        return None
    if "rate" in (overrides or {}).get("reasoncache-random", {}).get("filter", {}):
        return None
    if progress is not None:
        progress.set_postfix_str("matching reasoncache-random's share rate")
    measured = replay(model, trajectory, policies[labels["reasoncache"]], metrics=False, tokenizer=tokenizer,
                      progress=progress).sharing
    rate = measured["share_rate"]
    policies[labels["reasoncache-random"]] = preset_policy("reasoncache-random", overrides, filter={"rate": rate})
    return {"preset": "reasoncache-random", "knob": "filter.rate", "value": rate,
            "matched_to": "reasoncache share_rate", "shared_blocks": measured["shared_blocks"],
            "shareable_blocks": measured["shareable_blocks"]}
