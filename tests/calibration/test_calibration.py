"""KDE calibration of the sparsity classifier on synthetic sparsity traces with known structure."""

import json
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from scipy.stats import norm

from kvcompose import registry
from kvcompose.calibration import (
    CalibrationWarning,
    calibrate,
    count_modes,
    find_modes,
    load_calibration,
    save_calibration,
)
from kvcompose.classifiers import ClassifierInput, SparsityKDEClassifier

# Three thought types as a Gaussian mixture of sparsity: E (dense), R, T (sparsest).
# Unequal weights and widths, so the density minima are not the midpoints.
TRI = dict(means=(0.30, 0.55, 0.80), sds=(0.04, 0.05, 0.03), weights=(0.3, 0.5, 0.2))
BI = dict(means=(0.35, 0.70), sds=(0.05, 0.05), weights=(0.6, 0.4))
UNI = dict(means=(0.5,), sds=(0.08,), weights=(1.0,))
QUAD = dict(means=(0.1, 0.35, 0.6, 0.85), sds=(0.03,) * 4, weights=(0.25,) * 4)


def sample(rng, n, means, sds, weights):
    c = rng.choice(len(means), size=n, p=weights)
    return rng.normal(np.asarray(means)[c], np.asarray(sds)[c])


def true_minima(means, sds, weights):
    """Minima of the mixture density between adjacent means, found numerically."""

    def pdf(x):
        return sum(w * norm.pdf(x, m, s) for m, s, w in zip(means, sds, weights))

    return [
        minimize_scalar(pdf, bounds=(means[i], means[i + 1]), method="bounded", options={"xatol": 1e-7}).x
        for i in range(len(means) - 1)
    ]


def traces(layer_mixtures, prompts=4, steps=2000, seed=0):
    """One [steps, n_layers] array per prompt; column l drawn from layer_mixtures[l]."""
    rng = np.random.default_rng(seed)
    return [np.stack([sample(rng, steps, **mix) for mix in layer_mixtures], axis=1) for _ in range(prompts)]


def test_find_modes_recovers_true_density_minima():
    rng = np.random.default_rng(1)
    fit = find_modes(sample(rng, 4000, **TRI))
    assert fit.count == 3
    np.testing.assert_allclose(fit.modes, TRI["means"], atol=0.02)
    np.testing.assert_allclose(fit.minima, true_minima(**TRI), atol=0.015)
    assert np.all((fit.dips > 0) & (fit.dips < 1))


@pytest.mark.parametrize("mix,expected", [(UNI, 1), (BI, 2), (TRI, 3), (QUAD, 4)])
def test_count_modes_of_mixtures(mix, expected):
    assert count_modes(sample(np.random.default_rng(2), 3000, **mix)) == expected


def test_count_modes_degenerate_inputs():
    assert count_modes(np.full(50, 0.4)) == 1  # a point mass
    assert count_modes(np.array([0.3])) == 0  # nothing to estimate
    assert count_modes(np.array([np.nan, np.nan, 0.2])) == 0  # NaNs are dropped first
    v = sample(np.random.default_rng(3), 2000, **BI)
    assert count_modes(np.concatenate([v, [np.nan] * 10])) == 2
    with pytest.raises(ValueError, match="bandwidth must be"):
        count_modes(v, bandwidth="wide")


def test_calibrate_picks_trimodal_layers_and_averages_minima():
    # layer: 0 uni, 1 tri, 2 tri, 3 bi, 4 tri, 5 four modes
    calib = calibrate(traces([UNI, TRI, TRI, BI, TRI, QUAD]), num_types=3, num_layers=4, model="toy")
    assert calib["fallback"] is None
    assert calib["num_types"] == 3 and calib["types"] == ["E", "R", "T"]
    assert calib["layers"] == [1, 2, 4]  # fewer than num_layers qualify: the paper allows |L*| smaller
    np.testing.assert_allclose(calib["thresholds"], true_minima(**TRI), atol=0.015)
    assert calib["mode_counts"][1] == [3, 3, 3, 3] and calib["mode_counts"][0] == [1, 1, 1, 1]
    assert calib["mode_counts"][5] == [4, 4, 4, 4]
    assert calib["model"] == "toy" and calib["num_prompts"] == 4


def test_calibrate_prefers_the_clearest_layers():
    blurred = dict(TRI, sds=tuple(s * 1.4 for s in TRI["sds"]))  # still three modes, shallower dips
    calib = calibrate(traces([TRI, blurred, TRI, TRI, TRI]), num_types=3, num_layers=4)
    assert calib["mode_counts"][1] == [3, 3, 3, 3]
    assert calib["layers"] == [0, 2, 3, 4]


def test_bimodal_data_falls_back_to_two_types_with_a_warning():
    with pytest.warns(CalibrationWarning, match=r"no layer has 3 sparsity modes.*fell back to 2 thought types"):
        calib = calibrate(traces([BI, BI, UNI]), num_types=3)
    assert calib["num_types"] == 2 and calib["requested_num_types"] == 3
    assert calib["types"] == ["E", "R"] and calib["layers"] == [0, 1]
    assert "fell back to 2 thought types ['E', 'R']" in calib["fallback"]
    np.testing.assert_allclose(calib["thresholds"], true_minima(**BI), atol=0.02)


def test_unimodal_data_falls_back_to_a_single_type():
    with pytest.warns(CalibrationWarning, match="one type for every sequence"):
        calib = calibrate(traces([UNI, UNI], prompts=2, steps=500))
    assert (calib["num_types"], calib["thresholds"], calib["layers"], calib["types"]) == (1, [], [], ["R"])


def test_no_warning_when_the_requested_types_are_found():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate(traces([BI], prompts=2, steps=1000), num_types=2)


def test_calibrate_rejects_bad_input():
    with pytest.raises(ValueError, match="same layers"):
        calibrate([np.zeros((10, 3)), np.zeros((10, 4))])
    with pytest.raises(ValueError, match=r"\[steps, n_layers\]"):
        calibrate([np.zeros(10)])
    with pytest.raises(ValueError, match=r"num_types must be one of \[1, 2, 3\], got 4"):
        calibrate(traces([TRI], prompts=1, steps=100), num_types=4)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got 0"):
        calibrate(traces([TRI], prompts=1, steps=100), num_layers=0)


def test_save_load_and_build_the_classifier(tmp_path):
    calib = calibrate(traces([UNI, TRI, TRI, BI, TRI, QUAD]), model="toy")
    path = save_calibration(calib, tmp_path / "calib" / "toy.json")
    raw = json.loads(path.read_text())
    assert raw["mode_counts"]["1"] == [3, 3, 3, 3]  # JSON keys are strings on disk
    loaded = load_calibration(path)
    assert loaded["mode_counts"][1] == [3, 3, 3, 3] and loaded["thresholds"] == calib["thresholds"]

    clf = SparsityKDEClassifier(calibration=str(path))
    assert clf.layers == (1, 2, 4) and clf.thresholds == tuple(calib["thresholds"]) and clf.model == "toy"
    lo, hi = calib["thresholds"]
    sparsity = torch.full((3, 6), float("nan"))
    sparsity[:, [1, 2, 4]] = torch.tensor([[lo - 0.05], [(lo + hi) / 2], [hi + 0.05]], dtype=torch.float32)
    assert clf.labels(clf.classify(ClassifierInput(sparsity=sparsity))) == ["E", "R", "T"]

    # The config carries the values in use, so it rebuilds without the file.
    config = json.loads(json.dumps(registry.to_config(clf)))
    path.unlink()
    assert registry.build("classifier", config) == clf

    # An explicit field beats the file; a model mismatch is an error.
    path = save_calibration(calib, tmp_path / "toy.json")
    assert SparsityKDEClassifier(calibration=str(path), layers=[2]).layers == (2,)
    with pytest.raises(ValueError, match="is for model 'toy', not 'other'"):
        SparsityKDEClassifier(calibration=str(path), model="other")
    assert SparsityKDEClassifier.from_calibration(calib, layers=[4]).layers == (4,)


def test_fallback_calibration_warns_when_a_classifier_is_built(tmp_path):
    with pytest.warns(CalibrationWarning):
        calib = calibrate(traces([BI, BI], prompts=2, steps=1000))
    path = save_calibration(calib, tmp_path / "bi.json")
    with pytest.warns(CalibrationWarning, match="fell back"):
        clf = SparsityKDEClassifier(calibration=str(path))
    assert clf.types == ("E", "R") and len(clf.thresholds) == 1


def test_load_calibration_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"lacks \['layers'\]"):
        load_calibration({"num_types": 3, "thresholds": [0.4, 0.7]})
    with pytest.raises(ValueError, match=r"3 types need 2 thresholds, got \[0.4\]"):
        load_calibration({"num_types": 3, "thresholds": [0.4], "layers": [1]})
