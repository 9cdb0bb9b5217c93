"""One instance of every registered component, by kind, for the tests that every component must pass.

``params(kind)`` lists the registered names of a kind as pytest parameters, so a component
is covered by ``test_components.py`` as soon as it is registered. ``default(kind, name)``
builds it with its defaults, or with :data:`FIELDS` where it has none that work.
:data:`BAD` holds one bad field value per built-in component that has fields, with the
exact message it must give; :data:`PAPERS` the arXiv id each method's module cites.
"""

from __future__ import annotations

import pytest

import kvcompose  # noqa: F401  (registers the built-in components)
from kvcompose import registry
from kvcompose.classifiers import Classifier
from kvcompose.evictors import Evictor
from kvcompose.filters import SharingFilter
from kvcompose.pagers import Pager
from kvcompose.quantizers import Quantizer
from kvcompose.rotations import Rotation
from kvcompose.triggers import Trigger

#: The base class every component of a kind derives from.
BASES = {"quantizer": Quantizer, "classifier": Classifier, "evictor": Evictor, "pager": Pager, "trigger": Trigger,
         "filter": SharingFilter, "rotation": Rotation}

#: Fields for components whose defaults alone cannot build them.
FIELDS = {
    ("classifier", "sparsity_kde"): {"thresholds": [0.5], "layers": [0], "types": ["R", "T"]},
}

#: One bad value per built-in component with fields: ``(fields, exact message)``.
BAD = {
    ("quantizer", "int"): ({"bits": 3}, "int quantizer: bits=3; accepted: 2, 4, 8"),
    ("classifier", "constant"): (
        {"type": "X"},
        "constant classifier: type 'X' is not a thought type; accepted: 'R' (reasoning), 'E' (execution), "
        "'T' (transition)"),
    ("classifier", "keyword"): (
        {"default": "X"},
        "keyword classifier: default 'X' is not a thought type; accepted: 'R' (reasoning), 'E' (execution), "
        "'T' (transition)"),
    ("classifier", "sparsity_kde"): (
        {"thresholds": [0.5], "layers": [-1], "types": ["R", "T"]},
        "sparsity_kde classifier: layer -1 is not a layer index (an int >= 0); layers=[-1]"),
    ("evictor", "attention"): ({"window": 0}, "attention evictor: window must be an int >= 1, got 0"),
    ("evictor", "rkv"): ({"lam": 1.5}, "rkv evictor: lam must be a number in [0, 1], got 1.5"),
    ("evictor", "tbe"): ({"retention": [4, 8]},
                         "tbe evictor: retention must be strictly decreasing positive ints, got [4, 8]"),
    ("pager", "ct"): ({"max_hole_blocks": 0},
                      "ct pager: max_hole_blocks=0; accepted: an integer >= 1, or None to never move tokens"),
    ("trigger", "buffer"): ({"buffer": -1}, "buffer trigger: buffer must be an int >= 0, got -1"),
    ("trigger", "interval"): ({"period": 0}, "interval trigger: period must be an int >= 1, got 0"),
    ("filter", "collaborative"): ({"warmup": -1}, "collaborative filter: warmup=-1; accepted: an integer >= 0"),
    ("filter", "random"): ({"rate": 2}, "random filter: rate=2; accepted: a number in [0, 1]"),
    ("rotation", "hadamard"): ({"seed": -1}, "hadamard rotation: seed must be an integer >= 0, got -1"),
}

_STREAMINGLLM, _H2O, _SNAPKV, _KIVI = "2309.17453", "2306.14048", "2404.14469", "2402.02750"
_RKV, _RPC, _THINKV, _REASONCACHE, _FP8 = "2505.24133", "2505.13866", "2510.01290", "2507.21433", "2209.05433"
_QUAROT = "2404.00456"

#: The arXiv ids each built-in method's module docstring cites (components of no paper are absent).
PAPERS = {
    ("quantizer", "fp8"): [_FP8, _THINKV],
    ("quantizer", "nvfp4"): [_THINKV],
    ("quantizer", "ternary"): [_THINKV],
    ("quantizer", "int"): [_KIVI],
    ("classifier", "sparsity_kde"): [_THINKV],
    ("classifier", "keyword"): [_THINKV],
    ("evictor", "window"): [_STREAMINGLLM],
    ("evictor", "h2o"): [_H2O],
    ("evictor", "attention"): [_SNAPKV, _RKV, _RPC],
    ("evictor", "rkv"): [_RKV],
    ("evictor", "tbe"): [_THINKV],
    ("pager", "ct"): [_THINKV],
    ("pager", "share"): [_REASONCACHE],
    ("trigger", "over_budget"): [_STREAMINGLLM, _H2O],
    ("trigger", "buffer"): [_RKV],
    ("trigger", "interval"): [_RPC],
    ("trigger", "segment_end"): [_THINKV],
    ("filter", "collaborative"): [_REASONCACHE],
    ("filter", "random"): [_REASONCACHE],
    ("rotation", "hadamard"): [_QUAROT],
}


def names(kind: str) -> list[str]:
    """Registered names of one kind."""
    return registry.names(kind)


def params(*kinds: str) -> list:
    """``(kind, name)`` pytest parameters for every registered component of ``kinds`` (default: all)."""
    return [pytest.param(kind, name, id=f"{kind}:{name}") for kind in (kinds or registry.KINDS)
            for name in registry.names(kind)]


def default(kind: str, name: str):
    """An instance of the registered component with its default fields."""
    return registry.build(kind, {"name": name, **FIELDS.get((kind, name), {})})


def builtin(kind: str, name: str) -> bool:
    """Whether the component ships with kvcompose (plugins are not held to :data:`BAD` and :data:`PAPERS`)."""
    return registry.get(kind, name).__module__.startswith("kvcompose.")
