"""Fidelity evaluation: replay a full-KV greedy trajectory under policies and measure what changes.

See :mod:`kvcompose.eval.fidelity` for the protocol; ``kvcompose compare`` is its command line.
"""

from .fidelity import DEFAULT_PRESETS, compare, compare_presets
from .match import match_memory
from .overrides import build_policies, parse_overrides, policy_label
from .plot import plot_fidelity
from .prompts import load_prompts
from .replays import Replay, evaluate, replay
from .result import FidelityResult
from .trajectory import Trajectory, greedy_trajectory

__all__ = [
    "DEFAULT_PRESETS", "FidelityResult", "Replay", "Trajectory", "build_policies", "compare", "compare_presets",
    "evaluate", "greedy_trajectory", "load_prompts", "match_memory", "parse_overrides", "plot_fidelity",
    "policy_label", "replay",
]
