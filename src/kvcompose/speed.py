"""Decode throughput of a policy against transformers' compiled static cache, on your model.

What ``kvcompose bench`` and ``benchmarks/bench_e2e_gpu.py`` run. Both sides decode the
same prompts greedily with EOS disabled and time the same decode steps (``timed_steps``:
every new token after the first, which the prefill produces). Decode time: for kvcompose
from the first decode step (after the prefill has finished on the device) to the end; for
transformers the run's wall time minus that of a prefill-only run; either over the decode
steps. kvcompose decodes through the static-shape path
(:func:`kvcompose.hf.static.fast_generate`, CUDA graphs on a GPU) after a warm-up that
compiles every kernel the policy uses, eviction and refresh steps included.

Each record carries the bytes a decode step must read at least (``weight_bytes_per_step``,
``kv_bytes_read_per_step``); :func:`add_floor` turns them into ``floor_ms_per_step``, the
time to read them once at the copy bandwidth :func:`copy_tbps` measures on the same device
(see :data:`FLOOR_METHOD`). :func:`add_fullkv_ratios` sets each record's tok/s over fullkv's.

At a fixed memory (:func:`fit_policy`, :func:`fit_transformers_static`) each side runs at
the largest batch whose peak GPU memory, weights included, stays under a cap.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time
import traceback

import torch

from .hf.compat import cache_kwargs
from .hf.static import ONE_TIME_KINDS, fast_generate
from .policies import Policy
from .validation import check_int


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
    """The fields every run reports. ``timed_steps``: the decode steps ``decode_s`` covers, every
    new token after the first (the prefill produces that one); ``ms_per_step`` divides by them."""
    ms = 1e3 * decode_s / max(new - 1, 1)
    return {"batch": batch, "new_tokens": new, "timed_steps": max(new - 1, 0), "ms_per_step": ms,
            "tok_per_s": batch * 1e3 / ms, "peak_gib": _peak_gib(), "kv_bytes": int(kv_bytes),
            "kv_allocated_bytes": int(allocated), "decode_s": decode_s}


# ------------------------------------------------------------------ the floor
#: Bytes :func:`copy_times_ms` copies per call by default (large enough to leave every cache behind).
COPY_BYTES = 2 * 2**30
#: Decode steps of a policy's warm-up at the timed capacity, by device type: on CUDA past the
#: presets' buffer flushes, evictions (buffer triggers of 128) and classifier refreshes (every
#: 128 steps); the CPU path compiles nothing.
WARM_UP_STEPS = {"cuda": 256, "cpu": 4}

#: How ``floor_ms_per_step`` is computed, as stored beside the records that carry it.
FLOOR_METHOD = (
    "floor_ms_per_step = (weight_bytes_per_step + kv_bytes_read_per_step) / copy_tbps. Weights: every parameter "
    "but the input embedding table, of which a step reads B rows (the whole table when tied to the LM head). KV: "
    "kvcompose, the mean of the cache's live bytes (payload, scales, metadata, recent buffer) right after the "
    "prefill and at the end of the timed run; transformers' static cache, its whole reserved cache, which it "
    "attends over at every step. copy_tbps: read plus written bytes of a 2 GiB device copy over its median time."
)


def copy_times_ms(device, nbytes: int = COPY_BYTES, warmup: int = 3, repeats: int = 10) -> tuple[list[float], int]:
    """The copy-bandwidth reference that every "share of copy" and every floor divides by:
    ``dst.copy_(src)`` of ``nbytes`` of bf16 on ``device``, ``10 * warmup`` untimed calls first
    (they bring a GPU's clocks up), then ``max(repeats, 10)`` calls: on CUDA issued back to back
    with CUDA events around each, elsewhere timed one by one with the wall clock. Returns the
    milliseconds of each call and the bytes one call moves (read + written)."""
    src = torch.randn(max(nbytes // 2, 1), device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(10 * warmup):
        dst.copy_(src)
    cuda = torch.device(device).type == "cuda"
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        events = []
        for _ in range(max(repeats, 10)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(max(repeats, 10)):
            began = time.perf_counter()
            dst.copy_(src)
            times.append(1e3 * (time.perf_counter() - began))
    return times, 2 * src.numel() * src.element_size()


def attention_kernels(device) -> str:
    """Which decode attention a run on ``device`` uses, in words: the torch reference on CPU; on
    CUDA the Triton kernel, and for NVFP4, ternary, INT4, INT2 and KIVI pools the CUDA kernel where it is built and
    takes them (else why not)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "torch reference (no CUDA device)"
    from .ops.paged_attention.native import POOLS, native_status

    status = native_status(device)
    kernel = "CUDA" if status["kernel"] == "cuda" else "Triton"
    return f"Triton; {POOLS}: {kernel} ({status['reason']})"


def copy_tbps(device, nbytes: int | None = None) -> float:
    """Copy bandwidth of ``device`` in TB/s: read plus written bytes of :func:`copy_times_ms`
    over its median call. Default size: ``COPY_BYTES`` on a GPU; 1 GiB with one round of
    warm-up on a CPU, which has no clocks to bring up and copies a few GB/s."""
    if torch.device(device).type == "cuda":
        times, moved = copy_times_ms(device, nbytes or COPY_BYTES)
    else:
        times, moved = copy_times_ms(device, nbytes or 2**30, warmup=0)
    return moved / (statistics.median(times) * 1e-3) / 1e12


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of the parameters one decode step of ``batch`` rows reads: every parameter in full
    (a tied LM head counts once), except an input embedding table that is not the LM head's,
    of which the step reads only ``batch`` rows. Under tensor parallelism, the rank's own shards."""
    total = sum(_held(p).numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight is table:
        return total
    held = _held(table)
    return total - held.numel() * held.element_size() + batch * held.shape[1] * held.element_size()


def _held(param: torch.Tensor) -> torch.Tensor:
    """What this process holds of a parameter: a tensor-parallel (DTensor) parameter's local shard."""
    return param.to_local() if hasattr(param, "to_local") else param


def add_floor(row: dict, tbps: float) -> dict:
    """``row`` with ``floor_ms_per_step`` (its bytes read per step at ``tbps`` TB/s, see
    :data:`FLOOR_METHOD`) and ``floor_ratio`` (``ms_per_step`` over it); a row without its
    bytes or its time (an error) is returned as it is."""
    if "weight_bytes_per_step" not in row or "kv_bytes_read_per_step" not in row:
        return row
    floor = 1e3 * (row["weight_bytes_per_step"] + row["kv_bytes_read_per_step"]) / (tbps * 1e12)
    out = dict(row, floor_ms_per_step=floor)
    if row.get("ms_per_step") is not None:
        out["floor_ratio"] = row["ms_per_step"] / floor
    return out


def add_fullkv_ratios(rows: list[dict], key: str = "policy") -> None:
    """Set ``ratio_to_fullkv`` on every row with a ``tok_per_s``: its tok/s over that of the row
    whose ``key`` is ``"fullkv"`` (rows of one run and scenario), or else ``"fullkv@layout"``
    (fullkv on a pool layout named in the benchmark's policy name). Without a fullkv row that
    ran, the rows get no such field."""
    ran = [r for r in rows if str(r.get(key, "")).partition("@")[0] == "fullkv" and r.get("tok_per_s")]
    full = next((r for r in ran if r[key] == "fullkv"), ran[0] if ran else None)
    for r in rows:
        r.pop("ratio_to_fullkv", None)
        if full is not None and r.get("tok_per_s") is not None:
            r["ratio_to_fullkv"] = r["tok_per_s"] / full["tok_per_s"]


def time_transformers_static(model, ids: torch.Tensor, mask: torch.Tensor, new: int,
                             cache_len: int | None = None) -> dict:
    """transformers' static cache with its compiled decode step (sdpa), timed over ``new`` tokens.

    On CUDA the step compiles with mode "reduce-overhead", which records a CUDA graph per
    attention-mask width; a first run of the same length records them all and only the
    second is timed. One cache object serves every call (a new one per call would
    recompile inside the timed run). ``cache_len``: size the cache for a longer generation
    (its step cost does not depend on the step: attention covers the whole cache).

    ``kv_bytes_read_per_step``: the whole reserved cache, K and V of ``cache_len`` tokens per
    row, which its attention spans at every step."""
    from transformers import StaticCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    cache_len = cache_len or ids.shape[1] + new
    cache = StaticCache(config=model.config, max_cache_len=cache_len)

    def generate(n):
        cache.reset()
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None, **cache_kwargs(model, cache))

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
    return dict(record(ids.shape[0], new, total - prefill, kv, kv), cache_len=cache_len,
                weight_bytes_per_step=weight_bytes_per_step(model, ids.shape[0]), kv_bytes_read_per_step=kv)


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
                reserve_new_tokens: int | None = None, warm_up: bool = True, inspect=None,
                profile: bool = True, fold_rotation: bool = True) -> dict:
    """kvcompose's static-shape decode under ``policy``, timed over ``new`` tokens, with its
    eager steps (evictions, refreshes).

    The timed run decodes as a user's call does, the host running ahead of the device. On
    CUDA, with ``profile``, a second run of the same decode splits its time by step kind
    (:func:`decode_time_split`: the eager, eviction and refresh steps' share of decode time,
    the host's own time per step) and gives ``profiled_ms_per_step``, its wall time with the
    device drained before every step.

    ``kv_bytes_read_per_step``: the mean of the cache's live bytes (its report's bytes in use
    as held: payload, scales, metadata, recent buffer) right after the prefill
    (``kv_live_bytes_after_prefill``, from a prefill-only run of the same prompts) and at the end
    of the timed run (``kv_live_bytes_at_end``). ``inspect``: called with the timed run's cache at
    the end; the fields it returns are added to the record. ``warm_up_s``: the wall time of the
    untimed warm-up runs before it (``warm_up``), kernel compilation included. ``pool_layout``:
    the row order of the store's pools (``Policy.pool_layout``). ``fold_rotation``: as
    :func:`~kvcompose.hf.static.fast_generate`'s, for every run here (warm-ups included)."""
    if policy.needs_text:
        raise ValueError(f"policy {policy.name!r}: its {policy.needs_text} reads the generated text, so it decodes "
                         "eagerly; the speed benchmark times the static-shape path only")
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvcompose")
    profile = profile and ids.is_cuda
    decode = functools.partial(fast_generate, fold_rotation=fold_rotation)
    warm_up_s = 0.0
    try:
        if warm_up:
            begun = time.perf_counter()
            decode(model, warm_up_policy(policy).make_cache(model), ids, mask, 40)
            # At the timed run's capacity, long enough to reach the presets' periodic steps: what is
            # specialized on it (split counts of the attention plan) compiles here, not in the timed
            # run. The CPU path compiles nothing: a few steps do.
            steps = min(new, WARM_UP_STEPS.get(ids.device.type, WARM_UP_STEPS["cpu"]))
            decode(model, policy.make_cache(model), ids, mask, steps,
                   reserve_new_tokens=new if reserve_new_tokens is None else reserve_new_tokens)
            warm_up_s = time.perf_counter() - begun
        prefilled = policy.make_cache(model)
        decode(model, prefilled, ids, mask, 1)  # the prefill alone: the cache as decoding starts
        after_prefill = prefilled.report().held_bytes["in_use"]
        del prefilled
        gc.collect()  # nothing of the earlier runs may count in the timed run's peak
        _peak_reset()
        cache = policy.make_cache(model)
        timed(lambda: decode(model, cache, ids, mask, new, reserve_new_tokens=reserve_new_tokens))
        ended = time.perf_counter()
        decoder = cache.static_decoder  # None when no token followed the prefill's
        report = cache.report()
        out = record(ids.shape[0], new, ended - decoder.started if decoder else 0.0, report.peak_kv_bytes,
                     report.allocated_bytes)
        summary = decoder.summary() if decoder is not None else {"eager_steps": 0, "replays": 0}
        if inspect is not None:
            out.update(inspect(cache))
        del cache, decoder
        if profile and new > 1:
            out.update(_profiled_run(model, policy, ids, mask, new, reserve_new_tokens, fold_rotation))
    finally:
        model.set_attn_implementation(previous)
    at_end = report.held_bytes["in_use"]
    out.update(warm_up_s=warm_up_s, weight_bytes_per_step=weight_bytes_per_step(model, ids.shape[0]),
               kv_live_bytes_after_prefill=after_prefill, kv_live_bytes_at_end=at_end,
               kv_bytes_read_per_step=(after_prefill + at_end) / 2)
    evicting = summary["eager_steps"] + summary.get("eviction_steps", 0)
    out.update(eager_steps=summary["eager_steps"], eviction_steps=summary.get("eviction_steps", 0),
               refresh_steps=summary.get("refresh_steps", 0), replays=summary["replays"],
               eviction_call_rate=evicting / max(new - 1, 1), fused=summary.get("fused"),
               rotation_in_weights=summary.get("rotation_in_weights", 0),
               warm_ups=summary.get("warm_ups", 0), pool_layout=policy.pool_layout)
    return out


def _profiled_run(model, policy: Policy, ids: torch.Tensor, mask: torch.Tensor, new: int,
                  reserve_new_tokens: int | None, fold_rotation: bool = True) -> dict:
    """The timed run again with its steps profiled (:func:`decode_time_split`). Profiling waits
    for the device before every step, to time the host's own work, so its wall time
    (``profiled_ms_per_step``) is above the timed run's, where the host runs ahead."""
    gc.collect()
    cache = policy.make_cache(model)
    timed(lambda: fast_generate(model, cache, ids, mask, new, profile=True, reserve_new_tokens=reserve_new_tokens,
                                fold_rotation=fold_rotation))
    ended = time.perf_counter()
    summary = cache.static_decoder.summary()
    split = decode_time_split(summary) if summary.get("ms_by_kind") else {}
    return dict(split, profiled_ms_per_step=1e3 * (ended - cache.static_decoder.started) / max(new - 1, 1))


def decode_time_split(summary: dict) -> dict:
    """What a profiled static decode's step times (``StaticDecoder.summary`` with
    ``ms_by_kind``, CUDA-event milliseconds per step kind) say about the run.

    ``one_time_s``: each graph variant's eager first run and its first replay, which a fresh
    cache pays once (the capture's own host work falls between the events: it shows in the
    wall time only, and in ``capture_host_s``); ``one_time_ms_by_step`` splits it by kind and
    graph variant. ``steady_ms_per_step``: GPU time per step without those (None if no
    other step ran). ``eviction_share``: the eager, eviction and refresh steps' time beyond a
    plain replayed step's, over the steady steps' time; ``replay_gpu_ms``: a plain replay."""
    ms, steps = summary["ms_by_kind"], summary["steps_by_kind"]
    one_time, special = ONE_TIME_KINDS, ("eager", "evict", "refresh")
    step_ms = ms.get("replay", 0.0) / max(summary["replays"], 1)
    decode_ms = max(sum(ms.values()) - sum(ms.get(k, 0.0) for k in one_time), 1e-9)
    decode_steps = sum(steps.values()) - sum(steps.get(k, 0) for k in one_time)
    beyond = sum(ms.get(k, 0.0) for k in special) - sum(steps.get(k, 0) for k in special) * step_ms
    return dict(
        eviction_share=max(0.0, beyond) / decode_ms,
        eager_share=ms.get("eager", 0.0) / decode_ms,
        evict_ms_per_step=ms.get("evict", 0.0) / max(steps.get("evict", 0), 1),
        replay_gpu_ms=step_ms, host_ms_per_replay=summary["host_ms_per_replay"],
        one_time_s=sum(ms.get(k, 0.0) for k in one_time) / 1e3,
        one_time_ms_by_step=summary.get("one_time_ms_by_step", {}),
        capture_host_s=summary.get("capture_host_s"),
        steady_ms_per_step=decode_ms / decode_steps if decode_steps else None,
        host_share=summary["host_ms_per_replay"] / max(step_ms, 1e-9),
    )


# ------------------------------------------------------------------ fixed memory
def largest_batch(fixed: float, per_row: float, cap_bytes: float, limit: int = 1024) -> int:
    """Rows that fit under ``cap_bytes`` given ``fixed`` bytes and ``per_row`` bytes each (1 to
    ``limit``; ``limit`` when the rows measured no cost, as a tiny model's may)."""
    if cap_bytes <= fixed:
        return 1
    if per_row <= 0:
        return limit
    return max(1, min(limit, math.floor((cap_bytes - fixed) / per_row)))


def run_backing_off(run_at, batch: int, cap_gib: float, retries: int, fixed_gib: float | None = None) -> dict:
    """``run_at(batch)``, repeated with fewer rows while it runs out of GPU memory or its peak
    passes ``cap_gib`` (``retries`` times at most, never below one row). After a peak over the
    cap, and given the memory that does not grow with the batch (``fixed_gib``: weights and the
    like), the next batch is the one the measured peak per row says fits, less 2%; otherwise
    (out of memory, or no ``fixed_gib``) it is 90% of the last. The record lists the batches
    that did not fit (``over_cap_at``); ``over_cap`` says whether its own peak is over the cap
    (retries used up)."""
    if fixed_gib is not None and not 0 <= fixed_gib < cap_gib:
        raise ValueError(f"fixed_gib={fixed_gib!r}: the memory that does not grow with the batch must be in GiB, "
                         f"at least 0 and under the cap ({cap_gib} GiB)")
    too_big = []
    while True:
        peak = None
        try:
            row = run_at(batch)
            peak = row["peak_gib"]
            if peak <= cap_gib or len(too_big) == retries or batch == 1:
                break
            print(f"batch {batch} peaked at {peak:.1f} GiB, over the cap", flush=True)
        except torch.OutOfMemoryError:
            if len(too_big) == retries or batch == 1:
                raise
            traceback.print_exc(limit=1)
            print(f"out of memory at batch {batch}", flush=True)
        too_big.append(batch)
        gc.collect()  # the exception's frames held the failed run's cache: free what they kept before the retry
        torch.cuda.empty_cache()
        batch = max(1, _next_batch(batch, peak, cap_gib, fixed_gib))
    return dict(row, over_cap=row["peak_gib"] > cap_gib, over_cap_at=too_big)


def _next_batch(batch: int, peak: float | None, cap_gib: float, fixed_gib: float | None) -> int:
    """The batch to try after ``batch`` did not fit (see :func:`run_backing_off`)."""
    if peak is None or fixed_gib is None:
        return math.floor(batch * 0.9)
    return min(batch - 1, math.floor(0.98 * batch * (cap_gib - fixed_gib) / (peak - fixed_gib)))


def fit_policy(model, policy: Policy, prompt: int, new_tokens: int, cap_gib: float, window: int,
               retries: int = 4, start_batch: int | None = None) -> dict:
    """``policy`` at the largest batch whose peak GPU memory (weights included) stays under
    ``cap_gib`` for ``prompt`` + ``new_tokens`` tokens, timed over ``window`` decode steps.

    The stores reserve their capacity for ``new_tokens`` at the prefill, so two short runs at
    batch 2 and 4 give the bytes per row; they do not see everything (an eviction step's
    scratch, a large prefill's activations), so the run backs off (:func:`run_backing_off`) to
    the batch its measured peak per row allows. ``start_batch``: the first batch tried instead
    of that estimate (a batch an earlier search found, which saves the runs over the cap); the
    search still only backs off, so the record keeps both (``batch_start``, ``batch_estimate``)."""
    _check_fit(window, new_tokens)
    if start_batch is not None:
        check_int("start_batch (None: start from the estimate)", start_batch, 1, noun="a number of rows")
    vocab = model.config.get_text_config().vocab_size

    def run(batch: int, steps: int, profile: bool = True) -> dict:
        ids, mask = random_prompts(vocab, batch, prompt, model.device)
        return time_policy(model, policy, ids, mask, steps, reserve_new_tokens=new_tokens, profile=profile)

    peaks, kv = {}, {}
    for b in (2, 4):
        gc.collect()  # whatever earlier runs left in reference cycles: free it first
        torch.cuda.empty_cache()
        kv[b] = run(b, 2, profile=False)["kv_allocated_bytes"]
        peaks[b] = torch.cuda.max_memory_allocated()  # time_policy resets it before its timed run
    per_row = (peaks[4] - peaks[2]) / 2
    fixed = peaks[2] - 2 * per_row
    estimate = largest_batch(fixed, per_row, cap_gib * 2**30)
    batch = estimate if start_batch is None else start_batch
    row = run_backing_off(lambda b: run(b, window), batch, cap_gib, retries, fixed_gib=fixed / 2**30)
    return dict(row, memory_cap_gib=cap_gib, reserved_new_tokens=new_tokens,
                kv_bytes_per_row_reserved=(kv[4] - kv[2]) / 2, batch_estimate=estimate, batch_start=batch)


def fit_transformers_static(model, prompt: int, new_tokens: int, cap_gib: float, window: int,
                            headroom_gib: float = 2.0, retries: int = 2) -> dict:
    """transformers' compiled static cache at the largest batch under ``cap_gib``, timed over
    ``window`` steps of a cache sized for ``prompt`` + ``new_tokens``. It recompiles per batch
    size, so its batch is counted rather than probed: the cache's bytes per row plus the
    prefill's MLP activations per row, over the weights and other memory in use now and
    ``headroom_gib`` for workspace; a run over the cap backs off like :func:`fit_policy`'s."""
    _check_fit(window, new_tokens)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    size = model.dtype.itemsize
    per_row = (2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * size * (prompt + new_tokens)
               + 3 * prompt * getattr(text, "intermediate_size", 4 * text.hidden_size) * size)  # gate, up, product
    fixed = torch.cuda.memory_allocated()  # the weights and whatever else stays
    batch = largest_batch(fixed + headroom_gib * 2**30, per_row, cap_gib * 2**30)

    def run(b: int) -> dict:
        ids, mask = random_prompts(text.vocab_size, b, prompt, model.device)
        return time_transformers_static(model, ids, mask, window, cache_len=prompt + new_tokens)

    return dict(run_backing_off(run, batch, cap_gib, retries, fixed_gib=fixed / 2**30), memory_cap_gib=cap_gib)


def _check_fit(window: int, new_tokens: int) -> None:
    if not torch.cuda.is_available():
        raise ValueError("a fixed-memory run measures GPU memory and needs a CUDA device")
    if not 1 <= window <= new_tokens:
        raise ValueError(f"window={window} decode steps are timed out of new_tokens={new_tokens}; give 1 <= window "
                         "<= new_tokens")


def random_prompts(vocab_size: int, batch: int, prompt: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random token ids ``[batch, prompt]`` (ids 10 and up) and an all-ones mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab_size, (batch, prompt), generator=g).to(device)
    return ids, torch.ones_like(ids)
