"""What ships for the embedded SmolLM2-135M-Instruct: its calibration file and the prompts it was fitted on.

The ``thinkv`` presets read that file; ``kvcompose calibrate`` uses the prompts by default.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..models import EMBEDDED_MODEL_NAME

__all__ = [
    "CALIBRATION_FILE",
    "EMBEDDED_MODEL_NAME",
    "EXTRA_PROMPTS_FILE",
    "calibration_prompts",
    "default_calibration_path",
]

CALIBRATION_FILE = "calibration_smollm2.json"
EXTRA_PROMPTS_FILE = "calibration_prompts.json"


def default_calibration_path() -> Path:
    """Path of the calibration shipped for the embedded SmolLM2-135M-Instruct.

    Pass it as ``{"name": "sparsity_kde", "calibration": str(path)}``. It is valid for
    that model only: thresholds and layers are properties of one model's attention.
    """
    ref = resources.files("kvcompose").joinpath("data", CALIBRATION_FILE)
    return Path(str(ref))


def calibration_prompts(limit: int | None = None) -> list[str]:
    """The prompts the shipped calibration was fitted on: the packaged reasoning prompts, then the extra ones.

    The extra prompts (``data/calibration_prompts.json``) add code, logic and
    self-checking tasks, so the decode steps cover more than arithmetic.
    """
    from ..eval.prompts import load_prompts

    extra = resources.files("kvcompose").joinpath("data", EXTRA_PROMPTS_FILE).read_text(encoding="utf-8")
    prompts = load_prompts() + _prompt_texts(json.loads(extra))
    if limit is not None:
        if limit < 1:
            raise ValueError(f"the number of prompts must be >= 1, got {limit}")
        prompts = prompts[:limit]
    return prompts


def _prompt_texts(data) -> list[str]:
    """The prompt strings of a prompts file, which may be a bare list or ``{"prompts": [...]}`` of strings or dicts."""
    items = data["prompts"] if isinstance(data, dict) else data
    return [item["prompt"] if isinstance(item, dict) else item for item in items]
