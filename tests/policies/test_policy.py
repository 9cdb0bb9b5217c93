"""Registry lookups, Policy construction, validation and config round-trips."""

import json
from dataclasses import dataclass

import pytest

import kvcompose
from kvcompose import Policy, registry
from kvcompose.evictors import WindowEvictor
from kvcompose.policies import presets
from kvcompose.triggers import OverBudget


def test_unknown_component_lists_known_names():
    with pytest.raises(KeyError, match=r"unknown evictor 'nope'; known evictors: .*window"):
        registry.get("evictor", "nope")
    with pytest.raises(KeyError, match="known kinds: quantizer, classifier, evictor, pager, trigger, filter, rotation"):
        registry.get("gizmo", "x")


def test_available_lists_builtins_with_descriptions():
    av = kvcompose.available()
    assert "window" in av["evictor"] and av["evictor"]["window"]
    assert "gather" in av["pager"] and "over_budget" in av["trigger"]


def test_register_rejects_non_dataclass_and_duplicates():
    with pytest.raises(TypeError, match="must be a dataclass"):
        registry.register("evictor", "bad")(type("Bad", (), {}))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("evictor", "window")(dataclass(type("Other", (), {})))


def test_entry_point_plugins_are_loaded(monkeypatch):
    calls = []

    class FakeEP:
        def load(self):
            def plugin():
                calls.append(1)
                registry.register("evictor", "plugin_test")(dataclass(type("PluginEvictor", (WindowEvictor,), {})))
            return plugin

    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [FakeEP()] if group == "kvcompose.components" else [])
    try:
        assert "plugin_test" in registry.names("evictor")
        assert calls == [1]
    finally:
        registry._REGISTRY["evictor"].pop("plugin_test", None)


@pytest.mark.parametrize("name", presets())
def test_every_preset_round_trips(name):
    policy = Policy.from_preset(name)
    config = policy.to_config()
    again = Policy.from_config(json.loads(json.dumps(config)))
    assert again == policy
    assert again.to_config() == config
    assert config["name"] == name


def test_unknown_preset_lists_names():
    with pytest.raises(KeyError, match="unknown preset 'thinkvv'; known presets: .*fullkv.*streamingllm"):
        Policy.from_preset("thinkvv")


def test_overrides_and_component_field_merge():
    p = Policy.from_preset("streamingllm", budget=300, sinks=8)
    assert (p.budget, p.sinks) == (300, 8)
    with pytest.raises(ValueError, match=r"evictor 'window' has no field\(s\) \['width'\]"):
        Policy.from_preset("streamingllm", evictor={"width": 3})


def test_budget_smaller_than_policy_needs_is_rejected():
    with pytest.raises(ValueError, match="budget=4 is smaller than this policy needs \\(5"):
        Policy.from_preset("streamingllm", budget=4, sinks=4)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"budget": 0}, "budget must be an integer >= 1, got 0"),
        ({"block_size": 0}, "block_size must be an integer >= 1"),
        ({"sinks": -1}, "sinks must be an integer >= 0"),
        ({"protect_prompt": "yes"}, "protect_prompt must be true or false"),
        ({"colour": 1}, r"unknown policy field\(s\) \['colour'\]"),
        ({"evictor": {"name": "nope"}}, "known evictors"),
        ({"trigger": None}, "needs both an evictor and a trigger"),
        ({"budget": None}, "needs a budget"),
    ],
)
def test_bad_fields_are_named(bad, match):
    with pytest.raises((ValueError, KeyError), match=match):
        Policy.from_preset("streamingllm", **bad)


def test_custom_composition_from_components():
    p = Policy(name="mine", budget=64, sinks=2, evictor=WindowEvictor(), trigger=OverBudget())
    assert Policy.from_config(p.to_config()) == p
    assert p.to_config()["evictor"] == {"name": "window"}


def test_plugin_presets_are_found_without_a_prior_component_lookup(monkeypatch):
    from kvcompose.policies import PRESETS, register_preset

    class FakeEP:
        def load(self):
            return lambda: register_preset("plugin_preset", "from a plugin",
                                           {"budget": 64, "evictor": "window", "trigger": "over_budget"})

    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [FakeEP()])
    try:
        assert Policy.from_preset("plugin_preset").budget == 64
    finally:
        PRESETS.pop("plugin_preset", None)
