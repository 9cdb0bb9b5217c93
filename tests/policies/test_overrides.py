"""The one override function and the integration hook of kvcompose.policies."""

import pytest

from kvcompose import Policy
from kvcompose.policies import integration as hook
from kvcompose.policies.overrides import apply_overrides


def test_a_dict_merges_a_named_component_replaces_and_inputs_stay_untouched():
    config = {"budget": 64, "trigger": {"name": "interval", "period": 8, "ratio": 4}}
    merged = apply_overrides(config, {"trigger": {"period": 16}, "budget": 32})
    assert merged == {"budget": 32, "trigger": {"name": "interval", "period": 16, "ratio": 4}}
    replaced = apply_overrides(config, {"trigger": {"name": "over_budget"}})
    assert replaced["trigger"] == {"name": "over_budget"}
    assert config == {"budget": 64, "trigger": {"name": "interval", "period": 8, "ratio": 4}}


def test_a_new_calibration_drops_the_calibrated_values():
    config = {"classifier": {"name": "sparsity_kde", "thresholds": [0.1, 0.2], "calibration": "a.json"}}
    out = apply_overrides(config, {"classifier": {"calibration": "b.json"}})
    assert out["classifier"] == {"name": "sparsity_kde", "calibration": "b.json"}


def test_from_preset_and_compare_resolve_the_same_way():
    from kvcompose.eval.overrides import preset_policy

    direct = Policy.from_preset("rkv", budget=48, trigger={"buffer": 32})
    via_compare = preset_policy("rkv", {"rkv": {"trigger": {"buffer": 32}}}, budget=48)
    assert direct.to_config() == via_compare.to_config()


def test_without_a_registered_integration_the_policy_says_what_to_import(monkeypatch):
    monkeypatch.setattr(hook, "_registered", None)
    with pytest.raises(RuntimeError, match="import kvcompose"):
        Policy.from_preset("fullkv").make_cache(object())
