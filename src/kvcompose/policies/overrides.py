"""The one way options are laid over a preset: :meth:`Policy.from_preset`, the command
line's ``--budget`` and ``--set``, and ``kvcompose compare`` all resolve through
:func:`apply_overrides`, so a field means the same wherever it is given."""

from __future__ import annotations

import copy


def apply_overrides(config: dict, overrides: dict) -> dict:
    """``config`` with ``overrides`` laid over it (neither input is modified).

    A dict laid over a dict merges key by key (``{"trigger": {"period": 64}}`` keeps the
    trigger's other fields), unless it names a component (``"name"`` in it), which then
    replaces the old one whole. A new ``calibration`` for a classifier drops the values the
    preset had calibrated. Anything else replaces the old value."""
    out = copy.deepcopy(config)
    for key, value in overrides.items():
        base = out.get(key)
        if isinstance(value, dict) and isinstance(base, dict) and "name" not in value:
            if "calibration" in value and "name" in base:
                base = {"name": base["name"]}
            out[key] = apply_overrides(base, value)
        else:
            out[key] = copy.deepcopy(value)
    return out
