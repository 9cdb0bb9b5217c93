"""Offline calibration of the ``sparsity_kde`` classifier (ThinKV §3.1.3, appendix D.1).

Calibration finds, for one model, the sparsity thresholds between thought types and
the layers ``L*`` whose sparsity separates them. It runs in two halves so the
statistics can be redone without the model:

- :mod:`~kvcompose.calibration.record`: decode prompts under ``fullkv`` and record
  per-layer attention sparsity (needs the model), then fit;
- :mod:`~kvcompose.calibration.fit`: the statistics on recorded arrays (KDE modes,
  thresholds, ``L*``, the fallback to fewer types);
- :mod:`~kvcompose.calibration.result`: save, load and describe the resulting dict;
- :mod:`~kvcompose.calibration.shipped`: the calibration and prompts shipped for the
  embedded SmolLM2 model.

Every public name is importable from this package.
"""

from ..classifiers.sparsity_kde import CalibrationWarning
from .fit import KDEModes, calibrate, count_modes, find_modes
from .record import collect_sparsity, run_calibration
from .result import describe, load_calibration, save_calibration
from .shipped import (
    CALIBRATION_FILE,
    EMBEDDED_MODEL_NAME,
    EXTRA_PROMPTS_FILE,
    calibration_prompts,
    default_calibration_path,
)

__all__ = [
    "CALIBRATION_FILE",
    "EMBEDDED_MODEL_NAME",
    "EXTRA_PROMPTS_FILE",
    "CalibrationWarning",
    "KDEModes",
    "calibrate",
    "calibration_prompts",
    "collect_sparsity",
    "count_modes",
    "default_calibration_path",
    "describe",
    "find_modes",
    "load_calibration",
    "run_calibration",
    "save_calibration",
]
