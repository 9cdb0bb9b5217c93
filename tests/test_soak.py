"""Soak (issue 13, item 7): a tiny model decodes 4,096 steps under rkv, streamingllm and thinkv on CPU.

Each preset is decoded once, step by step (not ``generate``), in a child process that
records, after every step, the kept tokens of every (layer, row), the layers' eviction
counters, the allocated bytes and whether the logits were finite. The tests then check
the record:

- no non-finite logits, and no error flag in the cache at the end;
- kept tokens follow the trigger's rule at every step (what an eviction step must leave,
  what a step without eviction must leave, and the rule's maximum in between);
- allocated bytes never grow once the first eviction cycles have run (the pools reuse
  the blocks that evictions free).

Why a child process: under pytest the Triton kernels are interpreted on CPU
(``TRITON_INTERPRET=1``, set in conftest), and thinkv's NVFP4/ternary encodes, K-means
and sparsity kernels would take minutes through the interpreter. The child runs without
it, as a CPU user does: every op then takes its torch reference. The test runs the same
module as a script (``python tests/test_soak.py PRESET OUT.json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about 80 s on 2 shared CPU cores (three 4,096-step runs)

STEPS = 4096
PROMPTS = [20, 13]  # two rows of different lengths, left padded
SETTLE_CYCLES = 2  # eviction cycles after every row's first cut before allocation must stay flat
THINKV_CLASSIFIER = {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1]}

# Small budgets so that thousands of tokens pass through many eviction cycles. ThinKV's
# retention schedule floors at 4 tokens per thought segment, so a row can never hold less
# than prompt + 4 x (segments so far): with refresh 64 that is 20 + 4 x 64 = 276 tokens
# after 4,096 steps, under the budget of 320, so the budget binds at every segment end
# (with refresh 16 and budget 128 the floors pass the budget after ~430 steps and the
# cache then grows with the length, as ThinKV intends; see _check_thinkv).
CASES = {
    "streamingllm": {"budget": 64},
    "rkv": {"budget": 64, "trigger": {"buffer": 16}},
    "thinkv": {"budget": 320, "refresh": 64, "classifier": THINKV_CLASSIFIER},
}

# ------------------------------------------------------------------ the child: decode and record
def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.2: greedy tokens vary (at the default 0.02 a random model repeats one token),
    # so keys, sparsity and thought classes change along the run.
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=STEPS + 512,
                         initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("kvcompose")
    return model


def soak(preset: str, steps: int = STEPS) -> dict:
    """Decode ``steps`` greedy tokens under ``preset`` and record the cache after every step."""
    import torch

    import kvcompose  # noqa: F401  (registers the kvcompose attention)
    from conftest import left_padded
    from kvcompose import Policy

    torch.set_num_threads(1)  # tiny matmuls; the machine's cores are shared
    model = _model()
    policy = Policy.from_preset(preset, **CASES[preset])
    _, ids, mask = left_padded(PROMPTS)
    cache = policy.make_cache(model)
    layers = cache.layers

    def live():
        return [layer.store.live_tokens().tolist() for layer in layers]

    def allocated():
        return sum(layer.store.memory()["allocated"] for layer in layers)

    rec = {"live": [], "evictions": [], "allocated": [], "classes": [], "nonfinite_steps": []}
    start = time.perf_counter()
    with torch.inference_mode():
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        rec["prefill_live"] = live()
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = positions[:, -1:]
        for step in range(1, steps + 1):
            if cache.thoughts.current is not None:  # the class of this step's tokens, per row
                rec["classes"].append(cache.thoughts.current.tolist())
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = pos + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            if not bool(torch.isfinite(logits).all()):
                rec["nonfinite_steps"].append(step)
            nxt = logits.argmax(-1, keepdim=True)
            rec["live"].append(live())
            rec["evictions"].append([layer.store.evictions for layer in layers])
            rec["allocated"].append(allocated())
    rec["seconds"] = time.perf_counter() - start
    # Blocks a store of several regions (thought classes) may trade between them as the class mix
    # drifts: one per (row, layer, region).
    rec["class_slack"] = sum(layer.store.batch_size * region.pool.bytes_per_block
                             for layer in layers if len(layer.store.regions) > 1 for region in layer.store.regions)
    try:
        cache.check_errors()
        rec["cache_error"] = None
    except ValueError as e:
        rec["cache_error"] = str(e)
    rec["final_positions"] = []
    for view in cache.views():
        rec["final_positions"].append([sorted(view.positions[r][view.valid[r]].tolist()) for r in range(len(PROMPTS))])
    rec["prompt_columns"] = layers[0].store.prompt_columns
    rec["class_names"] = policy.classes
    rec["report"] = str(cache.report())
    return rec


# ------------------------------------------------------------------ the tests: read the record
def test_the_soaks_share_one_worker(request):
    """Under ``pytest -n --dist loadgroup`` this module's tests carry its xdist group, so one
    worker runs each soak once (pytest 9 with pytest-xdist 3.8 dropped the group silently)."""
    if request.config.getoption("loadgroup", default=False):
        assert request.node.nodeid.endswith("@test_soak.py"), request.node.nodeid



@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """``record(preset)``: the soak of that preset, run once per test module in a child process."""
    runs: dict[str, dict] = {}

    def get(preset: str) -> dict:
        if preset not in runs:
            out = tmp_path_factory.mktemp(f"soak-{preset}") / "record.json"
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["OMP_NUM_THREADS"] = "1"
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), preset, str(out)],
                                  cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"soak of {preset} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            runs[preset] = json.loads(out.read_text())
            runs[preset]["wall_seconds"] = time.perf_counter() - start
            print(f"\nsoak {preset}: {STEPS} steps in {runs[preset]['seconds']:.1f} s "
                  f"({runs[preset]['wall_seconds']:.1f} s with the child's start)\n{runs[preset]['report']}")
        return runs[preset]

    return get


def _check_exact(rec: dict, rule, bound: int, name: str) -> int:
    """Triggers whose plan is exact (over_budget, buffer): every step leaves ``rule(stored)``
    tokens per row, where ``stored`` = kept before the step + the step's token; a layer's
    eviction counter moves exactly at the steps where some row is cut; never above ``bound``."""
    prev = rec["prefill_live"]
    layers, rows = len(prev), len(prev[0])
    cuts = 0
    for step, (now, ev) in enumerate(zip(rec["live"], rec["evictions"]), start=1):
        before = rec["evictions"][step - 2] if step > 1 else [0] * layers
        for i in range(layers):
            expected = [rule(prev[i][r] + 1) for r in range(rows)]
            assert now[i] == expected, (
                f"{name} step {step} layer {i}: kept {now[i]} tokens per row, the rule says {expected} "
                f"(kept before the step: {prev[i]})")
            cut = any(e < p + 1 for e, p in zip(expected, prev[i]))
            assert ev[i] - before[i] == cut, (  # one compaction per layer and step where some row is cut
                f"{name} step {step} layer {i}: eviction counter {before[i]} -> {ev[i]}, rows cut: {cut}")
            assert max(now[i]) <= bound, f"{name} step {step} layer {i}: kept {now[i]} > the rule's maximum {bound}"
            cuts += cut
        prev = now
    return cuts


def _check_thinkv(rec: dict, budget: int, refresh: int, retention, floor_bound: int) -> int:
    """ThinKV (segment_end trigger + tbe evictor, no protected tokens in the preset).

    The trigger acts only when a segment of ``refresh`` generated tokens completes (all rows
    together: each generates one token per step). There the evictor steps completed segments
    down the retention schedule: every earlier one when the segment that ended is a transition
    (T), and, while a row holds more than the budget, the least important oldest one, one level
    at a time, until the row is at or under the budget; a segment at the schedule's floor stays.
    So, while the floors fit in the budget (``floor_bound`` <= budget, checked here):

    - between segment ends nothing is evicted: kept = kept before + 1;
    - at a segment end kept <= min(stored, budget), and a row that was over the budget with a
      non-T segment ending stops within one step-down of the budget: kept > budget - largest step;
    - so kept never exceeds budget + refresh - 1 after a step.
    """
    assert floor_bound <= budget, "the soak's ThinKV parameters must keep the retention floors under the budget"
    levels = [refresh] + [r for r in retention if r < refresh]
    step_down = max(a - b for a, b in zip(levels, levels[1:]))
    transition = rec["class_names"].index("T")
    prev = rec["prefill_live"]
    layers, rows = len(prev), len(prev[0])
    cuts = near_budget = transitions = 0
    for step, (now, ev, cls) in enumerate(zip(rec["live"], rec["evictions"], rec["classes"]), start=1):
        before = rec["evictions"][step - 2] if step > 1 else [0] * layers
        segment_end = step % refresh == 0
        for i in range(layers):
            for r in range(rows):
                stored, kept = prev[i][r] + 1, now[i][r]
                where = f"thinkv step {step} layer {i} row {r}: kept {kept} of {stored}"
                if not segment_end:
                    assert kept == stored, f"{where}, but no segment ended"
                    continue
                assert kept <= min(stored, budget), f"{where}, above min(stored, budget={budget})"
                if stored > budget and cls[r] != transition:
                    assert kept > budget - step_down, f"{where}: more than one step-down ({step_down}) under {budget}"
                    near_budget += 1
                transitions += cls[r] == transition and kept < stored
            assert max(now[i]) <= budget + refresh - 1, f"thinkv step {step} layer {i}: kept {now[i]}"
            cut = any(now[i][r] < prev[i][r] + 1 for r in range(rows))
            assert ev[i] - before[i] == cut, f"thinkv step {step} layer {i}: counter {before[i]} -> {ev[i]}, cut {cut}"
            cuts += cut
        prev = now
    assert near_budget >= 10 and transitions >= 1, (near_budget, transitions)  # both kinds of step-down happened
    return cuts


PRESETS = sorted(CASES)


@pytest.mark.parametrize("preset", PRESETS)
def test_soak_output_stays_finite(record, preset):
    """Finite logits at all 4,096 steps, and no NaN/inf flag in any layer's store at the end."""
    rec = record(preset)
    assert len(rec["live"]) == STEPS
    assert rec["nonfinite_steps"] == [], f"{preset}: non-finite logits at steps {rec['nonfinite_steps'][:10]}"
    assert rec["cache_error"] is None, f"{preset}: {rec['cache_error']}"


@pytest.mark.parametrize("preset", PRESETS)
def test_soak_kept_tokens_follow_the_budget_rule(record, preset):
    """Kept tokens per (layer, row) after every step are what the preset's trigger and evictor
    promise (see _check_exact and _check_thinkv), and the tokens kept at the end are the right ones."""
    from kvcompose import Policy

    rec = record(preset)
    policy = Policy.from_preset(preset, **CASES[preset])
    budget = policy.budget
    assert rec["prefill_live"] == [PROMPTS] * len(rec["prefill_live"])  # the prompts fit: nothing cut at prefill
    if preset == "streamingllm":  # over_budget: trimmed to the budget at every step once over it
        cuts = _check_exact(rec, lambda stored: min(stored, budget), budget, preset)
    elif preset == "rkv":  # buffer: back to the budget once budget + buffer tokens are held
        buffer = policy.trigger.buffer
        cuts = _check_exact(rec, lambda stored: budget if stored >= budget + buffer else stored,
                            budget + buffer - 1, preset)
    else:
        retention = policy.evictor.retention
        floor_bound = max(PROMPTS) + (STEPS // policy.refresh) * min(retention)
        cuts = _check_thinkv(rec, budget, policy.refresh, retention, floor_bound)
        mix = {rec["class_names"][c] for row in rec["classes"] for c in row}
        assert mix == {"R", "E", "T"}, f"every thought class should occur (transitions included); got {mix}"
    assert cuts >= 30, f"{preset}: only {cuts} (layer, step) evictions in {STEPS} steps"

    # What is kept at the end, beyond the count.
    columns = rec["prompt_columns"]
    last = columns + STEPS - 1  # position of the last token fed
    for i, layer in enumerate(rec["final_positions"]):
        for r, kept in enumerate(layer):
            first = columns - PROMPTS[r]  # the row's first real position (left padding before it)
            if preset == "streamingllm":  # 4 sinks + the most recent tokens
                window = list(range(last - (budget - policy.sinks) + 1, last + 1))
                assert kept == list(range(first, first + policy.sinks)) + window, f"layer {i} row {r}"
            elif preset == "rkv":  # the most recent protect_recent tokens always survive
                recent = list(range(last - policy.recent_tokens + 1, last + 1))
                assert kept[-policy.recent_tokens:] == recent, f"layer {i} row {r}"
            else:  # tbe never evicts the prompt
                assert kept[:PROMPTS[r]] == list(range(first, columns)), f"layer {i} row {r}"


def _cycle(policy) -> int:
    """Steps of one eviction cycle once a row is at its budget: what it takes for the blocks of
    that row to go through one round of (buffer flush, eviction)."""
    name = policy.trigger.name
    if name == "over_budget":  # one token cut per step; blocks change when the buffer flushes a group
        return policy.group_size
    if name == "buffer":  # a cut every `buffer` steps, flushes every group_size
        return max(policy.trigger.buffer, policy.group_size)
    return policy.refresh  # segment_end


@pytest.mark.parametrize("preset", PRESETS)
def test_soak_allocation_is_flat_after_the_first_eviction_cycles(record, preset):
    """Allocated bytes (all layers) never rise above their peak over the last settling cycle once the
    first eviction cycles are over (plus, for a store of several classes, one block per row, layer and
    class: a class may take a block while another's holes are below the ``ct`` pager's limit)."""
    from kvcompose import Policy

    rec = record(preset)
    policy = Policy.from_preset(preset, **CASES[preset])
    layers, rows = len(rec["prefill_live"]), len(PROMPTS)
    # Settled: every (layer, row) has been cut, and SETTLE_CYCLES eviction cycles have passed since the last
    # of them was (a cycle includes the buffer flush whose group an eviction then has to make room for).
    history = [rec["prefill_live"]] + rec["live"]
    first_cut = max(next(s for s in range(1, len(history)) if history[s][i][r] <= history[s - 1][i][r])
                    for i in range(layers) for r in range(rows))
    settle = first_cut + SETTLE_CYCLES * _cycle(policy)
    assert settle < STEPS // 4
    alloc = rec["allocated"]
    peak = max(alloc[settle - _cycle(policy):settle])
    base = peak + rec["class_slack"]
    grown = [(s, a) for s, a in enumerate(alloc[settle:], start=settle + 1) if a > base]
    assert not grown, (
        f"{preset}: {peak} bytes allocated at most in the cycle to step {settle} (settled; limit {base}), then more: "
        f"{[(s, a) for i, (s, a) in enumerate(grown) if i == 0 or a != grown[i - 1][1]][:8]}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    Path(sys.argv[2]).write_text(json.dumps(soak(sys.argv[1])))
