"""The statistics of the ``sparsity_kde`` calibration: KDE modes, thresholds and the layers ``L*``.

Input: for each calibration prompt, the attention sparsity of every layer at every
decode step, as an array ``[steps, n_layers]``. Collecting it needs a model
(:mod:`kvcompose.calibration.record`); the statistics do not, so they run on recorded
arrays. Output: a plain dict, saved as JSON (:mod:`kvcompose.calibration.result`),
from which :class:`~kvcompose.classifiers.SparsityKDEClassifier` is built.

Steps:

1. For each prompt and layer, fit a Gaussian KDE (:class:`scipy.stats.gaussian_kde`)
   to that layer's sparsity over the decode steps, evaluate it on a grid and find
   its modes (local maxima). Bumps whose prominence is below ``min_prominence``
   times the highest density are sampling ripple, not modes.
2. A layer is a candidate for ``L*`` when ``num_types`` modes is its most frequent
   mode count across prompts (layers with more regimes or blurred boundaries, which
   the paper reports in §3.1 and E.4, are thereby excluded).
3. Candidates are ranked by how often they show exactly ``num_types`` modes, then
   by how deep the density dips between modes (a clearer separation first), then by
   index; the first ``num_layers`` form ``L*`` (the paper uses |L*| = 4, found by an
   accuracy ablation we cannot run offline; these two criteria are our proxy for
   "clear tri-modal layers"). There may be fewer than ``num_layers`` candidates.
4. The thresholds are the density minima between adjacent modes, averaged over
   every (prompt, layer in ``L*``) pair that shows exactly ``num_types`` modes; pairs
   with another mode count have minima that separate different bins, so they are
   left out.
5. If no layer qualifies, the calibration retries with one type fewer, down to a
   single type (appendix E.9), records why in ``"fallback"`` and emits a
   :class:`~kvcompose.classifiers.CalibrationWarning`.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.signal import find_peaks
from scipy.stats import gaussian_kde

from ..classifiers.base import SPARSITY_BIN_TYPES
from ..classifiers.sparsity_kde import CalibrationWarning

__all__ = ["KDEModes", "calibrate", "count_modes", "find_modes"]


@dataclass(frozen=True)
class KDEModes:
    """The modes of one KDE and the minima that separate them (positions in sparsity units)."""

    modes: np.ndarray  # [k] ascending mode positions
    minima: np.ndarray  # [k-1] lowest density point between consecutive modes
    dips: np.ndarray  # [k-1] density at each minimum / density of the lower neighbouring mode (0 = clean gap)

    @property
    def count(self) -> int:
        return len(self.modes)


def _check_bandwidth(bandwidth) -> None:
    if isinstance(bandwidth, str):
        if bandwidth not in ("scott", "silverman"):
            raise ValueError(f"bandwidth must be 'scott', 'silverman' or a positive number, got {bandwidth!r}")
    elif isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
        raise ValueError(f"bandwidth must be 'scott', 'silverman' or a positive number, got {bandwidth!r}")


def _vertex(x: np.ndarray, d: np.ndarray, i: int) -> float:
    """Refine a grid extremum at ``i`` by the parabola through it and its two neighbours."""
    if 0 < i < len(d) - 1:
        denom = d[i - 1] - 2 * d[i] + d[i + 1]
        if denom != 0:
            shift = 0.5 * (d[i - 1] - d[i + 1]) / denom
            if abs(shift) <= 1:
                return float(x[i] + shift * (x[1] - x[0]))
    return float(x[i])


def _evaluate(kde: gaussian_kde, grid: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """``kde(grid)`` for a 1-D KDE, computed in vectorized chunks (several times faster than scipy's loop)."""
    width = math.sqrt(float(kde.covariance[0, 0]))
    data, weights = kde.dataset[0], kde.weights
    density = np.zeros_like(grid)
    for start in range(0, data.size, chunk):
        z = (grid[:, None] - data[None, start : start + chunk]) / width
        density += np.exp(-0.5 * z * z) @ weights[start : start + chunk]
    return density / (width * math.sqrt(2 * math.pi))


def find_modes(
    values: np.ndarray, *, bandwidth: str | float = "scott", grid_size: int = 512, min_prominence: float = 0.02
) -> KDEModes:
    """Fit a Gaussian KDE to 1-D ``values`` and return its modes and the minima between them.

    NaNs are ignored. Fewer than two values give no modes (nothing to estimate);
    values that are all equal give one mode at that value (a point mass).
    ``bandwidth`` is scipy's ``bw_method``. The grid spans the data plus three kernel
    widths on each side, so tails do not produce edge maxima.
    """
    _check_bandwidth(bandwidth)
    if isinstance(grid_size, bool) or not isinstance(grid_size, int) or grid_size < 16:
        raise ValueError(f"grid_size must be an int >= 16, got {grid_size!r}")
    if not 0 <= min_prominence < 1:
        raise ValueError(f"min_prominence must be in [0, 1), got {min_prominence!r}")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    empty = np.zeros(0)
    if v.size < 2:
        return KDEModes(empty, empty, empty)
    if v.min() == v.max():
        return KDEModes(np.array([v[0]]), empty, empty)
    try:
        kde = gaussian_kde(v, bw_method=bandwidth)
    except np.linalg.LinAlgError:  # variance too small for a kernel: effectively one point
        return KDEModes(np.array([float(np.median(v))]), empty, empty)
    width = math.sqrt(float(kde.covariance[0, 0]))
    grid = np.linspace(v.min() - 3 * width, v.max() + 3 * width, grid_size)
    density = _evaluate(kde, grid)
    peaks, _ = find_peaks(density, prominence=min_prominence * float(density.max()))
    if peaks.size == 0:  # a flat top (plateau at the edge); the global maximum is the mode
        peaks = np.array([int(np.argmax(density))])
    modes = np.array([_vertex(grid, density, int(p)) for p in peaks])
    minima, dips = [], []
    for a, b in zip(peaks[:-1], peaks[1:]):
        i = int(a + np.argmin(density[a : b + 1]))
        minima.append(_vertex(grid, density, i))
        dips.append(float(density[i] / min(density[a], density[b])))
    return KDEModes(modes, np.array(minima), np.array(dips))


def count_modes(values: np.ndarray, **kde_options) -> int:
    """Number of KDE modes of 1-D ``values`` (see :func:`find_modes` for the options)."""
    return find_modes(values, **kde_options).count


def _check_inputs(sparsity: Sequence[np.ndarray]) -> list[np.ndarray]:
    if isinstance(sparsity, np.ndarray) or not isinstance(sparsity, Sequence) or len(sparsity) == 0:
        raise ValueError("sparsity must be a non-empty list of [steps, n_layers] arrays, one per prompt")
    arrays = [np.asarray(a, dtype=np.float64) for a in sparsity]
    for i, a in enumerate(arrays):
        if a.ndim != 2:
            raise ValueError(f"sparsity[{i}] must be [steps, n_layers], got shape {a.shape}")
    widths = {a.shape[1] for a in arrays}
    if len(widths) != 1:
        raise ValueError(f"every prompt must record the same layers; got n_layers {sorted(widths)}")
    return arrays


def calibrate(
    sparsity: Sequence[np.ndarray],
    num_types: int = 3,
    num_layers: int = 4,
    *,
    model: str | None = None,
    bandwidth: str | float = "scott",
    grid_size: int = 512,
    min_prominence: float = 0.02,
) -> dict[str, Any]:
    """Fit thresholds and pick the layer subset ``L*`` from recorded sparsity (one array per prompt).

    ``sparsity[p][s, l]`` is the attention sparsity of layer ``l`` at decode step
    ``s`` of prompt ``p``; prompts may have different numbers of steps. Returns a
    JSON-ready dict: ``model``, ``num_types`` (after any fallback), ``types``,
    ``thresholds``, ``layers``, ``mode_counts`` (``{layer: [count per prompt]}``),
    ``fallback`` (``None`` or why fewer types were used), ``requested_num_types``,
    ``num_prompts`` and ``settings`` (the KDE options used).
    """
    if isinstance(num_types, bool) or num_types not in SPARSITY_BIN_TYPES:
        raise ValueError(f"num_types must be one of {sorted(SPARSITY_BIN_TYPES)}, got {num_types!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    arrays = _check_inputs(sparsity)
    n_layers = arrays[0].shape[1]
    options = dict(bandwidth=bandwidth, grid_size=grid_size, min_prominence=min_prominence)
    fits = [[find_modes(a[:, layer], **options) for layer in range(n_layers)] for a in arrays]
    counts = {layer: [fits[p][layer].count for p in range(len(arrays))] for layer in range(n_layers)}

    def share(layer: int, k: int) -> float:
        return counts[layer].count(k) / len(arrays)

    def typical(layer: int) -> set[int]:
        tally = Counter(counts[layer])
        top = max(tally.values())
        return {c for c, n in tally.items() if n == top}

    def worst_dip(layer: int, k: int) -> float:
        dips = [float(fits[p][layer].dips.max()) for p in range(len(arrays)) if fits[p][layer].count == k]
        return float(np.mean(dips))

    k, layers, thresholds = num_types, [], []
    while k > 1:
        candidates = [layer for layer in range(n_layers) if k in typical(layer)]
        if candidates:
            ranked = sorted(candidates, key=lambda layer: (-share(layer, k), worst_dip(layer, k), layer))
            layers = sorted(ranked[:num_layers])
            minima = [
                fits[p][layer].minima for layer in layers for p in range(len(arrays)) if fits[p][layer].count == k
            ]
            thresholds = [float(t) for t in np.mean(np.stack(minima), axis=0)]
            break
        k -= 1

    fallback = None
    if k < num_types:
        closest = max(range(n_layers), key=lambda layer: (share(layer, num_types), -layer))
        fallback = (
            f"no layer has {num_types} sparsity modes as its most frequent count over {len(arrays)} prompts "
            f"(closest: layer {closest}, {num_types} modes in {share(closest, num_types):.0%} of prompts); "
            f"fell back to {k} thought type{'s' if k > 1 else ''} {list(SPARSITY_BIN_TYPES[k])}"
            + (f" using layers {layers}" if k > 1 else ", one type for every sequence")
        )
        warnings.warn(fallback, CalibrationWarning, stacklevel=2)

    return {
        "model": model,
        "num_types": k,
        "types": list(SPARSITY_BIN_TYPES[k]),
        "thresholds": thresholds,
        "layers": layers,
        "mode_counts": counts,
        "fallback": fallback,
        "requested_num_types": num_types,
        "num_prompts": len(arrays),
        "settings": {**options, "num_layers": num_layers},
    }
