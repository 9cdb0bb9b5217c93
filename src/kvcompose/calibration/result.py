"""The calibration result, a plain dict: write it as JSON, read it back, summarize it for a person.

Reading lives with the classifier (:func:`kvcompose.classifiers.load_calibration`),
which must check a file without this package; it is re-exported here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..classifiers.sparsity_kde import load_calibration

__all__ = ["describe", "load_calibration", "save_calibration"]


def save_calibration(calibration: dict[str, Any], path: str | Path) -> Path:
    """Check a calibration dict and write it as JSON; returns the path written."""
    checked = load_calibration(calibration)
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(checked, indent=2) + "\n", encoding="utf-8")
    return path


def describe(calibration: dict[str, Any]) -> str:
    """A human-readable summary: types, thresholds, ``L*``, mode counts per layer, fallback."""
    counts = calibration.get("mode_counts") or {}
    chosen = set(calibration["layers"])
    wanted = calibration.get("requested_num_types", calibration["num_types"])
    lines = [
        f"model: {calibration.get('model')}",
        f"thought types: {calibration['num_types']} {calibration['types']}"
        + (f" (requested {wanted})" if wanted != calibration["num_types"] else ""),
        f"thresholds: {[round(t, 4) for t in calibration['thresholds']]}",
        f"layers (L*): {calibration['layers']}",
    ]
    if counts:
        n_prompts = len(next(iter(counts.values())))
        typical = [layer for layer, c in counts.items() if c and _is_typical(c, wanted)]
        lines.append(
            f"layers whose most frequent mode count is {wanted}: {len(typical)} of {len(counts)} {typical}"
        )
        lines.append(f"KDE mode counts per layer over {n_prompts} prompts (count:prompts; * = in L*):")
        for layer in sorted(counts):
            tally = sorted(_tally(counts[layer]).items())
            text = "  ".join(f"{k}:{n}" for k, n in tally)
            lines.append(f"  {'*' if layer in chosen else ' '} layer {layer:>3}  {text}")
    collection = calibration.get("collection")
    if collection:
        lines.append(
            f"data: {collection['num_prompts_used']} of {collection['num_prompts']} prompts, "
            f"{collection['total_steps']} decode steps (max {collection['max_new_tokens']} new tokens each)"
        )
    lines.append(f"fallback: {calibration['fallback']}" if calibration.get("fallback") else "fallback: none")
    return "\n".join(lines)


def _tally(values) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _is_typical(values, k: int) -> bool:
    tally = _tally(values)
    return tally.get(k, 0) == max(tally.values())
