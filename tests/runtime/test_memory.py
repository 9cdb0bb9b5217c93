"""Memory accounting (issue 13, items 1 and 2): allocation follows the tokens, one basis for every figure.

Every preset decodes a left-padded batch of two rows on a tiny model, a short run (before
any eviction) and a long one (many eviction cycles at budget 64). After every step, in
every layer:

- free blocks: ``allocated - in_use`` is at most one block per (row, region) (the pools
  grow by what they lack and give back what they do not need);
- against the full cache: ``allocated - metadata`` is at most the full cache's bytes for
  the same tokens plus one block per (row, region) and one buffer block per row (block
  rounding), on the bf16 basis and as held (fp32);

and at the end of the long run every compressing preset holds and allocates less than the
full cache on the bf16 basis.

The runs happen in a child process without ``TRITON_INTERPRET`` (as in ``test_soak``): the
quantized presets' encode kernels would otherwise run through the Triton interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcompose import Policy, presets

#: Every preset that runs on the model alone (those that read the generated text need a tokenizer).
PRESETS = [p for p in presets() if Policy.from_preset(p).needs_text is None]
NOT_COMPRESSING = {"fullkv"}
RUNS = {"short": 8, "long": 300}
BUDGET = 64
OVERRIDES = {  # what makes each compressing preset evict within the long run
    "rpc": {"trigger": {"name": "interval", "period": 64, "ratio": 4, "recent": 32}},
    **{p: {} for p in ("fullkv", "kivi2", "kivi4", "nvfp4", "fp8", "thinkv-tbq")},  # no budget: they never evict
    "thinkv-int": {"budget": BUDGET, "precision": {c: {"name": "int", "bits": 4, "group_size": 16} for c in "RE"}},
}  # thinkv-int: INT4 groups of 16, as the tiny model's head dim of 16 holds
PROMPTS = [20, 13]


def _bounds(store, mem: dict) -> dict:
    """How far one layer is from the two bounds, in units of the allowed slack (<= 1 passes)."""
    rows = store.batch_size
    blocks = sum(rows * r.pool.bytes_per_block for r in store.regions)
    dense_slot = 2 * store.num_kv_heads * store.head_dim * store.buf_k.element_size()
    buffer_block = rows * min(p.block_size for p in store.pools.values()) * dense_slot
    return {"free": (mem["allocated"] - mem["in_use"]) / blocks,
            "over_full": (mem["allocated"] - mem["metadata"] - mem["full"]) / (blocks + buffer_block)}


def measure(preset: str, steps: int) -> dict:
    """Decode ``steps`` greedy tokens; the worst ratio of each bound over steps and layers, and the last report."""
    import kvcompose  # noqa: F401
    from conftest import left_padded, tiny_model
    from kvcompose import Policy

    torch.set_num_threads(1)
    model = tiny_model()
    policy = Policy.from_preset(preset, **OVERRIDES.get(preset, {"budget": BUDGET}))
    _, ids, mask = left_padded(PROMPTS)
    cache = policy.make_cache(model)
    worst = {"free": -1.0, "over_full": -1.0, "free_held": -1.0, "over_full_held": -1.0}
    with torch.inference_mode():
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        pos = pos[:, -1:]
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask, pos = torch.cat([mask, torch.ones_like(nxt)], 1), pos + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            for layer in cache.layers:
                for suffix, basis in (("", torch.bfloat16), ("_held", None)):
                    for name, value in _bounds(layer.store, layer.store.memory(basis)).items():
                        worst[name + suffix] = max(worst[name + suffix], value)
    report = cache.report()
    return {"worst": worst, "report": report.to_dict()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("memory") / "runs.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)], cwd=Path(__file__).parent,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"memory runs failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("preset", PRESETS)
def test_allocation_stays_within_a_block_of_use_and_of_the_full_cache(runs, preset, run):
    worst = runs[preset][run]["worst"]
    for name, value in worst.items():
        assert value <= 1.0, f"{preset} ({run} run): bound {name} exceeded ({value:.2f} x the allowed slack)"


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - NOT_COMPRESSING))
def test_compressing_presets_hold_and_allocate_less_than_a_bf16_full_cache(runs, preset):
    report = runs[preset]["long"]["report"]
    assert report["basis"] == "bfloat16" and report["dtype"] == "float32"
    full = report["full_kv_bytes"]
    assert report["kv_bytes"] < full and report["allocated_bytes"] < full, (
        f"{preset}: in use {report['kv_bytes']}, allocated {report['allocated_bytes']}, full (bf16) {full}")
    held = report["held_bytes"]  # the fp32 bytes of this run, kept beside the basis figures
    assert held["full"] == 2 * full and held["in_use"] >= report["kv_bytes"]


if __name__ == "__main__":  # the child process
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: conftest and its helpers
    results = {p: {run: measure(p, steps) for run, steps in RUNS.items()} for p in PRESETS}
    Path(sys.argv[1]).write_text(json.dumps(results))


def test_memory_basis_names_are_checked_and_the_report_states_both_bases():
    from conftest import left_padded, tiny_model
    from kvcompose import Policy
    from kvcompose.report import memory_dtype

    assert memory_dtype("bf16") is torch.bfloat16 and memory_dtype("model") is None and memory_dtype(None) is None
    with pytest.raises(ValueError, match=r"unknown memory basis 'int8'; accepted: \['bf16', 'bfloat16'"):
        memory_dtype("int8")
    model = tiny_model()
    _, ids, mask = left_padded([9, 5])
    reports = {}
    for basis in ("bfloat16", "model", "float16"):
        cache = Policy.from_preset("fullkv").make_cache(model, memory_basis=basis)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        reports[basis] = cache.report()
    bf16, held = reports["bfloat16"], reports["model"]
    assert held.basis == held.dtype == "float32" and bf16.basis == "bfloat16"
    assert bf16.full_kv_bytes * 2 == held.full_kv_bytes and bf16.buffer_bytes * 2 == held.buffer_bytes
    assert bf16.payload_bytes * 2 == held.payload_bytes and bf16.metadata_bytes == held.metadata_bytes
    assert bf16.held_bytes == {"in_use": held.kv_bytes, "allocated": held.allocated_bytes, "full": held.full_kv_bytes}
    assert reports["float16"].kv_bytes == bf16.kv_bytes  # same width
    text = str(bf16)
    assert "a full bfloat16 cache of the same tokens (this run computes in float32" in text
    assert "a full float32 cache of the same tokens\n" in str(held)


@pytest.mark.parametrize("preset,overrides", [
    ("fullkv", {}), ("rkv", {"budget": 32}), ("kivi2", {}), ("reasoncache", {}),
    ("thinkv", {"budget": 64, "classifier": {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1]}}),
])
def test_a_dropped_cache_is_freed_without_the_cycle_collector(llama, preset, overrides):
    """Its layers, static decoder and sharing tracker refer back to it weakly: once the user
    drops a cache, its memory goes at once (a loop making one cache per request must not
    wait for Python's cycle collector to free GPU stores and graphs)."""
    import gc
    import weakref

    from conftest import char_tokenizer, left_padded
    from kvcompose import Policy
    from kvcompose.hf.static import fast_generate

    policy = Policy.from_preset(preset, **overrides)
    cache = policy.make_cache(llama, tokenizer=char_tokenizer()) if policy.needs_text else policy.make_cache(llama)
    _, ids, mask = left_padded([9, 14])
    if policy.needs_text:
        greedy_ids = llama.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                                    do_sample=False, streamer=cache.token_streamer(mask), pad_token_id=0)
        assert greedy_ids.shape[1] == ids.shape[1] + 6
    else:
        fast_generate(llama, cache, ids, mask, 6)
    layer, ref = cache.layers[0], weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert ref() is None
    finally:
        gc.enable()
    with pytest.raises(ReferenceError, match="no longer exists"):
        layer.cache


def test_the_query_window_holds_only_its_own_queries(llama):
    """After a long prefill, a policy that records queries keeps the window, not the prompt's."""
    from conftest import left_padded
    from kvcompose import Policy

    policy = Policy.from_preset("rkv", budget=32)
    cache = policy.make_cache(llama)
    _, ids, mask = left_padded([40, 40])
    llama(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        assert layer.queries.shape[2] == policy.query_window
        assert layer.queries.untyped_storage().nbytes() == layer.queries.numel() * layer.queries.element_size()
        assert layer.query_positions.untyped_storage().nbytes() == layer.query_positions.numel() * 8


def test_a_deep_copy_of_a_cache_owns_its_parts(llama):
    """copy.deepcopy of a prompt's cache (to reuse the prompt) gives a cache whose layers refer
    to the copy, which decodes on alone exactly as the original would."""
    import copy
    import gc

    from conftest import left_padded
    from kvcompose import Policy

    cache = Policy.from_preset("rkv", budget=32).make_cache(llama)
    _, ids, mask = left_padded([9, 14])
    with torch.no_grad():
        out = llama(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        twin = copy.deepcopy(cache)
        assert all(layer.cache is twin for layer in twin.layers)
        step = dict(input_ids=out.logits[:, -1].argmax(-1, keepdim=True),
                    attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1), use_cache=True)
        want = llama(past_key_values=cache, **step).logits
        del cache
        gc.collect()
        assert torch.equal(llama(past_key_values=twin, **step).logits, want)
