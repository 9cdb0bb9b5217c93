"""Decode throughput of a policy against transformers' compiled static cache, on your model.

What ``kvcompose bench`` and ``benchmarks/bench_e2e_gpu.py`` run. Both sides decode the
same prompts greedily with EOS disabled; a run's decode time is its wall time minus that
of a prefill-only run, over the decode steps. kvcompose decodes through the static-shape
path (:func:`kvcompose.hf.static.fast_generate`, CUDA graphs on a GPU) after a warm-up
that compiles every kernel the policy uses, eviction and refresh steps included.
"""

from __future__ import annotations

import time

import torch

from .hf.static import fast_generate
from .policies import Policy


def timed(fn) -> float:
    """Wall seconds of ``fn()``, with the GPU idle before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def record(batch: int, new: int, decode_s: float, kv_bytes: int, allocated: int) -> dict:
    """The fields every run reports."""
    ms = 1e3 * decode_s / max(new - 1, 1)
    return {"batch": batch, "new_tokens": new, "ms_per_step": ms, "tok_per_s": batch * 1e3 / ms,
            "peak_gib": _peak_gib(), "kv_bytes": int(kv_bytes), "kv_allocated_bytes": int(allocated),
            "decode_s": decode_s}


def time_transformers_static(model, ids: torch.Tensor, mask: torch.Tensor, new: int,
                             cache_len: int | None = None) -> dict:
    """transformers' static cache with its compiled decode step (sdpa), timed over ``new`` tokens.

    On CUDA the step compiles with mode "reduce-overhead", which records a CUDA graph per
    attention-mask width; a first run of the same length records them all and only the
    second is timed. One cache object serves every call (a new one per call would
    recompile inside the timed run). ``cache_len``: size the cache for a longer generation
    (its step cost does not depend on the step: attention covers the whole cache)."""
    from transformers import StaticCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    cache_len = cache_len or ids.shape[1] + new
    cache = StaticCache(config=model.config, max_cache_len=cache_len)

    def generate(n):
        cache.reset()
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None)

    try:
        generate(new)
        prefill = timed(lambda: generate(1))
        _peak_reset()
        total = timed(lambda: generate(new))
    finally:
        model.set_attn_implementation(previous)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * model.dtype.itemsize * ids.shape[0] * cache_len
    return dict(record(ids.shape[0], new, total - prefill, kv, kv), cache_len=cache_len)


def warm_up_policy(policy: Policy, budget: int = 64) -> Policy:
    """The same components with a small budget and short periods, so that a short run reaches
    every kind of step (flush, eviction, refresh) and compiles its kernels."""
    config = policy.to_config()
    if config.get("budget") is not None:
        config["budget"] = max(budget, policy.min_budget())
    trigger = config.get("trigger") or {}
    if trigger.get("name") == "buffer":
        config["trigger"] = dict(trigger, buffer=16)
    if trigger.get("name") == "interval":
        config["trigger"] = dict(trigger, period=32, recent=min(trigger.get("recent", 8), 8))
        config["protect_recent"] = min(policy.recent_tokens, 8)
    config["refresh"] = 16
    return Policy.from_config(config)


def time_policy(model, policy: Policy, ids: torch.Tensor, mask: torch.Tensor, new: int,
                reserve_new_tokens: int | None = None, warm_up: bool = True) -> dict:
    """kvcompose's static-shape decode under ``policy``, timed over ``new`` tokens, with its
    eager steps (evictions, refreshes) and their share of decode time (CUDA)."""
    if policy.needs_text:
        raise ValueError(f"policy {policy.name!r}: its {policy.needs_text} reads the generated text, so it decodes "
                         "eagerly; the speed benchmark times the static-shape path only")
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvcompose")
    profile = ids.is_cuda
    try:
        if warm_up:
            fast_generate(model, warm_up_policy(policy).make_cache(model), ids, mask, 40)
            fast_generate(model, policy.make_cache(model), ids, mask, 4)
        prefill = timed(lambda: fast_generate(model, policy.make_cache(model), ids, mask, 1))
        _peak_reset()
        cache = policy.make_cache(model)
        total = timed(lambda: fast_generate(model, cache, ids, mask, new, profile=profile,
                                            reserve_new_tokens=reserve_new_tokens))
    finally:
        model.set_attn_implementation(previous)
    report = cache.report()
    out = record(ids.shape[0], new, total - prefill, report.peak_kv_bytes, report.allocated_bytes)
    summary = cache.static_decoder.summary() if cache.static_decoder is not None else {"eager_steps": 0, "replays": 0}
    evicting = summary["eager_steps"] + summary.get("eviction_steps", 0)
    special = evicting + summary.get("refresh_steps", 0)
    out.update(eager_steps=summary["eager_steps"], eviction_steps=summary.get("eviction_steps", 0),
               refresh_steps=summary.get("refresh_steps", 0), replays=summary["replays"],
               eviction_call_rate=evicting / max(new - 1, 1))
    ms = summary.get("ms_by_kind")
    if ms:
        step_ms = ms.get("replay", 0.0) / max(summary["replays"], 1)
        decode_ms = max(sum(ms.values()), 1e-9)
        special_ms = ms.get("eager", 0.0) + ms.get("evict", 0.0) + ms.get("refresh", 0.0)
        out.update(
            # decode time of the eager, eviction and refresh steps beyond what a plain replayed
            # step costs: evictions + refreshes
            eviction_share=max(0.0, special_ms - special * step_ms) / decode_ms,
            eager_share=ms.get("eager", 0.0) / decode_ms,
            evict_ms_per_step=ms.get("evict", 0.0) / max(summary.get("eviction_steps", 0), 1),
            replay_gpu_ms=step_ms, host_ms_per_replay=summary["host_ms_per_replay"],
            host_share=summary["host_ms_per_replay"] / max(step_ms, 1e-9),
        )
    return out


def random_prompts(vocab_size: int, batch: int, prompt: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random token ids ``[batch, prompt]`` (ids 10 and up) and an all-ones mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab_size, (batch, prompt), generator=g).to(device)
    return ids, torch.ones_like(ids)
