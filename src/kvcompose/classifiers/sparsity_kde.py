"""ThinKV's thought classifier: bin the mean attention sparsity of a few calibrated layers.

ThinKV, "ThinKV: Thought-Adaptive KV Cache Compression for Efficient Reasoning Models"
(Ramachandran et al., arXiv:2510.01290), §3.1.2, Observation 1, finds that, in
suitable layers, the attention sparsity of a reasoning model's decode steps clusters
into one mode per thought type: execution attends broadly (lowest sparsity), reasoning
less so, transitions are the sparsest. An offline calibration
(:mod:`kvcompose.calibration`) places thresholds at the density minima between those
modes and picks the layers ``L*`` where the modes are clear. At each refresh step the
classifier averages the sparsity of the current query over ``L*`` and looks up its
bin:

    mean < thresholds[0]                 -> types[0]   ("E" with three types)
    thresholds[i-1] <= mean < thresholds[i] -> types[i]   ("R")
    mean >= thresholds[-1]               -> types[-1]  ("T")

A value exactly on a threshold goes to the sparser bin. With fewer types (a
calibration that fell back, appendix E.9) the same rule applies to fewer bins.

Where the numbers come from. Fields given explicitly always win. ``calibration``
names a JSON file written by :func:`kvcompose.calibration.save_calibration`; it is
read only when ``thresholds`` or ``layers`` is missing, and fills whatever is
missing (``types`` is taken from the file only together with its thresholds, so
they stay consistent). After construction the fields hold the values in use, so
:func:`kvcompose.registry.to_config` records exactly what classified, and a config
rebuilt from it does not need the file any more.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..device_constants import device_constant
from ..registry import register
from .base import SPARSITY_BIN_TYPES, Classifier, ClassifierInput, check_type


class CalibrationWarning(UserWarning):
    """A calibration had to fall back to fewer thought types than requested."""


def check_thresholds(owner: str, thresholds) -> tuple[float, ...]:
    """Strictly ascending numbers in [0, 1] (sparsity is a share), or a ValueError naming the offending value."""
    if isinstance(thresholds, (str, bytes)) or not hasattr(thresholds, "__iter__"):
        raise ValueError(f"{owner}: thresholds must be a list of numbers, got {thresholds!r}")
    out = []
    for t in thresholds:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"{owner}: threshold {t!r} is not a finite number (thresholds={list(thresholds)!r})")
        if not 0 <= t <= 1:
            raise ValueError(f"{owner}: threshold {t!r} lies outside [0, 1], the range of attention sparsity "
                             f"(a share of negligible weights); thresholds={list(thresholds)!r}")
        if out and t <= out[-1]:
            raise ValueError(
                f"{owner}: thresholds must be strictly ascending, got {t!r} after {out[-1]!r} "
                f"(thresholds={list(thresholds)!r})"
            )
        out.append(float(t))
    return tuple(out)


def check_layers(owner: str, layers) -> tuple[int, ...]:
    """Distinct layer indices >= 0, or a ValueError naming the offending value."""
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"{owner}: layers must be a list of layer indices, got {layers!r}")
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{owner}: layer {layer!r} is not a layer index (an int >= 0); layers={list(layers)!r}")
        if layer in out:
            raise ValueError(f"{owner}: layer {layer} is listed twice; layers={list(layers)!r}")
        out.append(layer)
    return tuple(out)


def check_bin_types(owner: str, types, num_bins: int) -> tuple[str, ...]:
    """One distinct type letter per sparsity bin; defaults to the paper's order for ``num_bins``."""
    if types is None:
        if num_bins not in SPARSITY_BIN_TYPES:
            raise ValueError(
                f"{owner}: {num_bins - 1} thresholds make {num_bins} bins, but there are at most "
                f"{max(SPARSITY_BIN_TYPES)} thought types; give at most {max(SPARSITY_BIN_TYPES) - 1} thresholds"
            )
        return SPARSITY_BIN_TYPES[num_bins]
    if isinstance(types, str):
        types = list(types)
    types = tuple(check_type(owner, "types entry", t) for t in types)
    if len(set(types)) != len(types):
        raise ValueError(f"{owner}: types {list(types)} repeat a type; each bin needs its own")
    if len(types) != num_bins:
        raise ValueError(
            f"{owner}: {len(types)} types {list(types)} for {num_bins} sparsity bins "
            f"({num_bins - 1} thresholds); give one type per bin, lowest sparsity first"
        )
    return types


def load_calibration(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Read and check a calibration (a JSON path or an already loaded dict).

    Returns a new dict with ``thresholds``/``layers``/``types`` as lists, the
    ``mode_counts`` keys as ints, and ``types`` filled in when the file lacks it.
    """
    if isinstance(source, dict):
        data, where = dict(source), "calibration"
    else:
        where = f"calibration {str(source)!r}"
        try:
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{where} does not exist") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(data).__name__}")
    missing = [k for k in ("num_types", "thresholds", "layers") if k not in data]
    if missing:
        raise ValueError(f"{where} lacks {missing}; expected the output of kvcompose.calibration.calibrate")
    n = data["num_types"]
    if isinstance(n, bool) or not isinstance(n, int) or n not in SPARSITY_BIN_TYPES:
        raise ValueError(f"{where}: num_types must be one of {sorted(SPARSITY_BIN_TYPES)}, got {n!r}")
    thresholds = check_thresholds(where, data["thresholds"])
    if len(thresholds) != n - 1:
        raise ValueError(f"{where}: {n} types need {n - 1} thresholds, got {list(thresholds)}")
    data["thresholds"] = list(thresholds)
    data["layers"] = list(check_layers(where, data["layers"]))
    data["types"] = list(check_bin_types(where, data.get("types"), n))
    if data.get("mode_counts") is not None:
        data["mode_counts"] = {int(k): list(v) for k, v in data["mode_counts"].items()}
    data.setdefault("model", None)
    data.setdefault("fallback", None)
    return data


@register("classifier", "sparsity_kde")
@dataclass
class SparsityKDEClassifier(Classifier):
    """ThinKV: mean attention sparsity over calibrated layers, binned by KDE-derived thresholds."""

    thresholds: list[float] | None = None  # ascending sparsity cut points, one fewer than types
    layers: list[int] | None = None  # L*: the layers whose sparsity is averaged
    types: list[str] | None = None  # type of each bin, lowest sparsity first (default E, R, T)
    calibration: str | None = None  # JSON from kvcompose.calibration; fills the fields left unset
    model: str | None = None  # model the thresholds were calibrated on (checked against the file)

    def __post_init__(self) -> None:
        owner = f"{self.name} classifier"
        thresholds, types, layers = self.thresholds, self.types, self.layers
        if self.calibration is not None:
            if isinstance(self.calibration, Path):
                self.calibration = str(self.calibration)
            if thresholds is None or layers is None:
                data = load_calibration(self.calibration)
                if self.model is not None and data["model"] is not None and self.model != data["model"]:
                    raise ValueError(
                        f"{owner}: calibration {self.calibration!r} is for model {data['model']!r}, "
                        f"not {self.model!r}; calibrate this model or drop the model field"
                    )
                if self.model is None:
                    self.model = data["model"]
                if thresholds is None:
                    thresholds = data["thresholds"]
                    types = data["types"] if types is None else types
                if layers is None:
                    layers = data["layers"]
                if data["fallback"]:
                    warnings.warn(
                        f"calibration {self.calibration!r} fell back: {data['fallback']}", CalibrationWarning, 3
                    )
        if thresholds is None:
            raise ValueError(
                f"{owner}: needs thresholds (ascending sparsity cut points) or a calibration file; "
                "fit one with kvcompose.calibration.calibrate and save it with save_calibration"
            )
        self.thresholds = check_thresholds(owner, thresholds)
        self.types = check_bin_types(owner, types, len(self.thresholds) + 1)
        if layers is None and len(self.types) == 1:
            layers = ()
        if layers is None:
            raise ValueError(f"{owner}: needs layers (the calibrated layer subset L*) or a calibration file")
        self.layers = check_layers(owner, layers)
        if len(self.types) > 1 and not self.layers:
            raise ValueError(
                f"{owner}: layers is empty; sparsity from at least one layer is needed to separate {list(self.types)}"
            )

    @classmethod
    def from_calibration(cls, source: str | Path | dict[str, Any], **overrides) -> SparsityKDEClassifier:
        """Build from a calibration file or dict; ``overrides`` are field values that take precedence."""
        if isinstance(source, dict):
            data = load_calibration(source)
            if data["fallback"]:
                warnings.warn(f"calibration fell back: {data['fallback']}", CalibrationWarning, 2)
            fields = {k: data[k] for k in ("thresholds", "layers", "types", "model")}
            if "thresholds" in overrides and "types" not in overrides:
                fields.pop("types")
            return cls(**{**fields, **overrides})
        return cls(calibration=str(source), **overrides)

    graph_safe = True

    @property
    def needs(self) -> str | None:
        return "sparsity" if len(self.types) > 1 else None

    def score(self, signal: ClassifierInput) -> torch.Tensor:
        """Mean sparsity over :attr:`layers` per sequence, ``[B]`` float64 (what gets binned)."""
        s = signal.sparsity
        if s is None:
            raise ValueError("sparsity_kde classifier needs ClassifierInput.sparsity ([batch, n_layers])")
        if max(self.layers) >= s.shape[1]:
            raise ValueError(
                f"sparsity_kde classifier reads layers {list(self.layers)}, but the sparsity has only "
                f"{s.shape[1]} layers; was it calibrated for another model ({self.model!r})?"
            )
        picked = s.index_select(1, device_constant(tuple(self.layers), s.device)).to(torch.float64)
        if signal.check and not bool(torch.isfinite(picked).all()):
            bad = (~torch.isfinite(picked)).any(1).nonzero().flatten().tolist()
            raise ValueError(
                f"sparsity_kde classifier: non-finite sparsity in layers {list(self.layers)} for rows {bad}"
            )
        return picked.mean(dim=1)

    def classify(self, signal: ClassifierInput) -> torch.Tensor:
        if len(self.types) == 1:
            return torch.zeros(signal.batch_size, dtype=torch.int64, device=signal.device)
        score = self.score(signal)
        cuts = device_constant(tuple(self.thresholds), score.device, torch.float64)
        return torch.bucketize(score, cuts, right=True).to(device=signal.device, dtype=torch.int64)
