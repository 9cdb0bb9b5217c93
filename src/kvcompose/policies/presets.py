"""Named presets: each is a config dict for :class:`Policy`, built only from registered parts."""

from __future__ import annotations

import copy

from ..registry import UnknownComponentError, load_plugins

# Each entry: (one-line description, config or a function returning it). Configs hold only JSON values so a
# preset round-trips through Policy.to_config / Policy.from_config unchanged.
PRESETS: dict[str, tuple[str, dict]] = {
    "fullkv": (
        "No compression: every token kept in the paged store (the reference).",
        {"name": "fullkv"},
    ),
    "streamingllm": (
        "StreamingLLM: 4 attention sinks + the most recent tokens, fixed budget.",
        {
            "name": "streamingllm",
            "budget": 1024,
            "sinks": 4,
            "evictor": {"name": "window"},
            "trigger": {"name": "over_budget"},
            "pager": {"name": "gather"},
        },
    ),
    "rkv": (
        "R-KV: importance (attention of the last 8 queries) minus key redundancy, compress when a 128-token buffer fills.",
        {
            "name": "rkv",
            "budget": 1024,
            "protect_recent": 8,
            "evictor": {"name": "rkv", "window": 8, "gqa": "max", "window_reduce": "mean", "pool": "max",
                        "pool_width": 7, "head_reduce": "mean", "lam": 0.1, "threshold": 0.5,
                        "keep_recent_similar": 1},
            "trigger": {"name": "buffer", "buffer": 128},
            "pager": {"name": "gather"},
        },
    ),
    "snapkv": (
        "SnapKV at decode time on R-KV's schedule: attention of the last 8 queries, max-pooled; no redundancy term.",
        {
            "name": "snapkv",
            "budget": 1024,
            "protect_recent": 8,
            "evictor": {"name": "attention", "window": 8, "gqa": "max", "window_reduce": "mean", "pool": "max",
                        "pool_width": 7, "head_reduce": "mean"},
            "trigger": {"name": "buffer", "buffer": 128},
            "pager": {"name": "gather"},
        },
    ),
    "rpc": (
        "RPC: every 4096 generated tokens keep the top 1/4 by the attention of the last 32 queries; prompt kept.",
        {
            "name": "rpc",
            "budget": None,
            "protect_prompt": True,
            "protect_recent": 32,
            "evictor": {"name": "attention", "window": 32, "gqa": "mean", "window_reduce": "sum", "pool": "avg",
                        "pool_width": 7, "head_reduce": "mean"},
            "trigger": {"name": "interval", "period": 4096, "ratio": 4, "recent": 32},
            "pager": {"name": "gather"},
        },
    ),
    "h2o": (
        "H2O: heavy hitters by attention accumulated over all steps + a recent window (half the budget each).",
        {
            "name": "h2o",
            "budget": 1024,
            "protect_recent": 0.5,
            "evictor": {"name": "h2o"},
            "trigger": {"name": "over_budget"},
            "pager": {"name": "gather"},
        },
    ),
    "kivi2": (
        "KIVI 2-bit: keys per channel and values per token in INT2, groups of 32, last 128 tokens in full precision.",
        {
            "name": "kivi2",
            "precision": {"all": {"name": "int", "bits": 2, "layout": "kivi", "token_group": 32}},
            "group_size": 32,
            "block_size": 32,
            "residual": 128,
        },
    ),
    "kivi4": (
        "KIVI 4-bit: keys per channel and values per token in INT4, groups of 32, last 128 tokens in full precision.",
        {
            "name": "kivi4",
            "precision": {"all": {"name": "int", "bits": 4, "layout": "kivi", "token_group": 32}},
            "group_size": 32,
            "block_size": 32,
            "residual": 128,
        },
    ),
    "nvfp4": (
        "Uniform NVFP4 (E2M1 + E4M3 scale per 16 channels): every token quantized once its group of 16 completes.",
        {"name": "nvfp4", "precision": {"all": {"name": "nvfp4"}}, "group_size": 16},
    ),
    "fp8": (
        "Uniform FP8 E4M3 with a per-sequence, per-head FP32 scale; groups of 16.",
        {"name": "fp8", "precision": {"all": {"name": "fp8"}}, "group_size": 16},
    ),
    "reasoncache": (
        "ReasonCache: sealed blocks of a reasoning step share near-duplicate earlier blocks (lexical + structural "
        "step match, block distance under the 80th percentile); nothing evicted.",
        {
            "name": "reasoncache",
            "pager": {"name": "share"},
            "filter": {"name": "collaborative", "delimiter": "\n\n", "tau_strict": 0.9, "tau_soft": 0.7,
                       "structural": True, "max_tree_distance": 0, "percentile": 80.0, "warmup": 8},
        },
    ),
    "reasoncache-random": (
        "ReasonCache's random baseline: at each step end, sealed blocks shared with random earlier blocks at a "
        "fixed rate (set rate to match reasoncache's share rate).",
        {
            "name": "reasoncache-random",
            "pager": {"name": "share"},
            "filter": {"name": "random", "delimiter": "\n\n", "rate": 0.2, "seed": 0},
        },
    ),
}


#: Formats per thought class: ThinKV's R4E4T2 in NVFP4 and ternary, and ``thinkv-int``'s, picked by
#: ``benchmarks/tools/measure_format_grid.py`` (docs/thinkv.md says why): per-token INT4 in groups of
#: 32 for R and E (with the Hadamard rotation, its keys disturb attention less than NVFP4's:
#: 12.5% against 16.1% on the embedded model), ternary kept for T (rotated, 60% against INT2's 66%).
THINKV_FORMATS = {"R": {"name": "nvfp4"}, "E": {"name": "nvfp4"}, "T": {"name": "ternary"}}
THINKV_INT_FORMATS = {"R": {"name": "int", "bits": 4, "group_size": 32},
                      "E": {"name": "int", "bits": 4, "group_size": 32}, "T": {"name": "ternary"}}


#: Share of the budget that ``thinkv-int``'s eviction never touches: each row's newest tokens
#: (``protect_recent``; 64 at a budget of 96). Measured with ``kvcompose compare`` at the fidelity
#: page's settings (budget 96, refresh 32, retention 16/8/4): top-1 agreement 76.7% without, 92.2%
#: with it at 34.8% memory (thinkv: 26.9%); docs/presets/thinkv.md.
THINKV_INT_RECENT = 2 / 3


def _thinkv(description: str, quantize: bool, evict: bool, formats: dict = THINKV_FORMATS,
            rotation: str | None = None, protect_recent: float = 0) -> tuple[str, dict]:
    """ThinKV and its variants, with the embedded model's shipped sparsity calibration."""
    from ..classifiers.sparsity_kde import load_calibration

    calib = load_calibration(_data_path("calibration_smollm2.json"))
    config = {
        "precision": formats if quantize else {"R": None, "E": None, "T": None},
        "classifier": {"name": "sparsity_kde", "thresholds": calib["thresholds"], "layers": calib["layers"],
                       "types": calib["types"], "model": calib["model"]},
        "refresh": 128,
        "group_size": 16,
        "block_size": 16,
    }
    if rotation is not None:
        config["rotation"] = {"name": rotation}
    if evict:
        config.update(budget=1024, evictor={"name": "tbe", "retention": [64, 32, 16, 8, 4]},
                      trigger={"name": "segment_end"}, pager={"name": "ct"})
        if protect_recent:
            config["protect_recent"] = protect_recent
    return description, config


def _data_path(name: str) -> str:
    from importlib.resources import files

    return str(files("kvcompose") / "data" / name)


for _name, _desc, _q, _e, _f, _r, _p in [
    ("thinkv", "ThinKV: sparsity-classified thoughts, R4E4T2 quantization, segment step-downs, in-place CT pager.",
     True, True, THINKV_FORMATS, None, 0),
    ("thinkv-tbq", "ThinKV ablation: thought-based quantization only (R4E4T2), no eviction.", True, False,
     THINKV_FORMATS, None, 0),
    ("thinkv-tbe", "ThinKV ablation: thought-based eviction only (full precision), CT pager.", False, True,
     THINKV_FORMATS, None, 0),
    ("thinkv-int", "ThinKV with measured formats: Hadamard-rotated keys and values, INT4 (groups of 32) for R and E "
     "thoughts, ternary for T; its classifier, TBE and CT pager, and the newest two thirds of the budget kept.",
     True, True,
     THINKV_INT_FORMATS, "hadamard", THINKV_INT_RECENT),
]:
    # Built on first use: the config reads the packaged calibration file.
    PRESETS[_name] = (_desc, lambda n=_name, d=_desc, q=_q, e=_e, f=_f, r=_r, p=_p: {
        "name": n, **_thinkv(d, q, e, f, r, p)[1]})


def register_preset(name: str, description: str, config: dict) -> None:
    """Add a preset (used by kvcompose itself and by plugins)."""
    if name in PRESETS:
        raise ValueError(f"preset {name!r} already exists")
    PRESETS[name] = (description, {"name": name, **config})


def preset_config(name: str) -> dict:
    """A fresh copy of the preset's config; the error lists the known presets."""
    load_plugins()  # plugins may add presets
    if name not in PRESETS:
        raise UnknownComponentError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    config = PRESETS[name][1]
    return copy.deepcopy(config() if callable(config) else config)


def presets() -> dict[str, str]:
    """``{preset name: one-line description}``."""
    load_plugins()
    return {name: desc for name, (desc, _) in sorted(PRESETS.items())}
