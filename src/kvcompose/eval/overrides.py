"""Which policies a comparison runs: presets, ``--set`` overrides on them, budgets, and their labels.

The command line names presets and patches them field by field; this module turns
those words into :class:`~kvcompose.policies.Policy` objects, and fails on a bad
name or override before any model is loaded.
"""

from __future__ import annotations

import json
from typing import Iterable


def policy_label(policy) -> str:
    """Short name for tables and plots: ``h2o@64`` (budget) or ``rpc@P64`` (RPC period)."""
    if policy.evictor is None:
        return policy.name
    if policy.trigger.needs_budget and policy.budget is not None:
        return f"{policy.name}@{policy.budget}"
    period = getattr(policy.trigger, "period", None)
    return f"{policy.name}@P{period}" if period is not None else policy.name


def _parse_value(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_overrides(items: Iterable[str] | None) -> dict[str, dict]:
    """``["rpc.trigger.period=64", "h2o.protect_recent=16"]`` → ``{"rpc": {"trigger": {"period": 64}}, ...}``.

    Values are JSON (numbers, ``true``, ``null``, ``{...}``), else plain strings.
    """
    out: dict[str, dict] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ValueError(f"--set expects PRESET.FIELD[.SUBFIELD]=VALUE (e.g. rpc.trigger.period=64), got {item!r}")
        node = out.setdefault(parts[0], {})
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r} conflicts with an earlier --set of {p!r}")
        node[parts[-1]] = _parse_value(raw.strip())
    return out


def preset_policy(name: str, overrides: dict | None = None, **fields):
    """A preset with its ``--set`` overrides and then ``fields`` applied, the way
    :meth:`Policy.from_preset` applies any override."""
    from ..policies import Policy
    from ..policies.overrides import apply_overrides

    return Policy.from_preset(name, **apply_overrides((overrides or {}).get(name, {}), fields))


def check_overrides(presets: list[str], overrides: dict | None) -> None:
    """Refuse overrides for presets that are not compared: a typo would otherwise be ignored silently."""
    stray = sorted(set(overrides or {}) - set(presets))
    if stray:
        raise ValueError(f"--set names preset(s) {stray} that are not being compared ({', '.join(presets)})")


def at_budgets(name: str, budgets: Iterable[int] | None = None, overrides: dict | None = None) -> list:
    """The preset once per budget where its trigger keeps a budget; once, budgets left out,
    where it has none to keep (``fullkv`` and the quantize-only presets never evict; ``rpc``'s
    memory follows its period)."""
    base = preset_policy(name, overrides)
    if base.evictor is None or not base.trigger.needs_budget or not budgets:
        return [base]
    return [preset_policy(name, overrides, budget=int(b)) for b in budgets]


def build_policies(presets: Iterable[str], budgets: Iterable[int] | None = None,
                   overrides: dict | None = None) -> dict:
    """``{label: Policy}``: each preset at each budget it can keep (see :func:`at_budgets`)."""
    presets = list(presets)
    check_overrides(presets, overrides)
    out = {}
    for name in presets:
        for policy in at_budgets(name, budgets, overrides):
            out.setdefault(policy_label(policy), policy)
    return out
