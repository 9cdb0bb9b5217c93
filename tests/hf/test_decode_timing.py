"""Timing of decode runs (kvcompose.speed, the static decoder's summary): which steps are timed, how
one-time work (warm-ups, graph captures) is kept out of the steady rate, and fixed-memory batch search."""

import types

import pytest
import torch

from conftest import greedy, left_padded
from kvcompose import Policy
from kvcompose.hf.static import fast_generate
from kvcompose.runtime.schedule import StepPlan


@pytest.mark.gpu
def test_cuda_host_time_leaves_out_the_graph_capture(monkeypatch):
    """The capture is one-time work: a slow one must not show in the host's time per step."""
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompose.hf import static

    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).cuda().eval()
    model.set_attn_implementation("kvcompose")
    capture = static.StaticDecoder._capture
    monkeypatch.setattr(static.StaticDecoder, "_capture", lambda self: time.sleep(0.5) or capture(self))
    _, ids, mask = left_padded([9, 14])
    cache = Policy.from_preset("fullkv").make_cache(model)
    fast_generate(model, cache, ids.cuda(), mask.cuda(), 24, profile=True)
    summary = cache.static_decoder.summary()
    replays = summary["replays"]  # 23 steps less warm-ups, captures and the buffer flushes' own graph
    assert replays >= 10
    assert summary["host_ms_per_replay"] < 250 / replays  # half of what the capture's 500 ms would add
    captures = summary["steps_by_kind"]["capture"]
    assert summary["capture_host_s"] >= 0.5 * captures  # the sleeps, where the GPU events do not see them
    assert {"warm-up plain", "capture plain"} <= set(summary["one_time_ms_by_step"])
    assert sum(summary["one_time_ms_by_step"].values()) == pytest.approx(
        summary["ms_by_kind"]["warm-up"] + summary["ms_by_kind"]["capture"])


def test_speed_times_the_steps_it_says_and_evicts_exactly_past_the_budget(llama):
    from kvcompose import speed

    ids, mask = speed.random_prompts(96, 2, 12, "cpu")
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    short = speed.time_policy(llama, policy, ids, mask, 6)  # 12 + 6 tokens: under the budget all along
    long = speed.time_policy(llama, policy, ids, mask, 40)  # 12 + 40 tokens: past budget + buffer
    eager = policy.make_cache(llama)
    greedy(llama, ids, mask, 40, cache=eager)
    for row, new in ((short, 6), (long, 40)):
        assert row["new_tokens"] == new and row["timed_steps"] == new - 1
        assert row["ms_per_step"] == pytest.approx(1e3 * row["decode_s"] / (new - 1))
        assert row["eviction_call_rate"] == row["eviction_steps"] / (new - 1)
        assert row["eager_steps"] == 0  # R-KV's eviction is graph-safe: none runs outside the schedule
        assert row["fused"] is False  # on CPU the decoder layers run uncompiled
        assert row["pool_layout"] == policy.pool_layout == "head"  # the record says what it ran on
    assert short["eviction_steps"] == 0 and short["kv_live_bytes_at_end"] > short["kv_live_bytes_after_prefill"]
    assert long["eviction_steps"] == eager.report().eviction_steps > 0
    prefilled = policy.make_cache(llama)
    fast_generate(llama, prefilled, ids, mask, 1)
    assert long["kv_live_bytes_after_prefill"] == prefilled.report().held_bytes["in_use"]
    assert long["kv_live_bytes_at_end"] < speed.time_policy(llama, Policy.from_preset("fullkv"), ids, mask, 40)[
        "kv_live_bytes_at_end"]  # evicted: fewer bytes held at the end than a full cache of the same tokens
    assert long["kv_bytes_read_per_step"] == (long["kv_live_bytes_after_prefill"] + long["kv_live_bytes_at_end"]) / 2

    base = speed.time_transformers_static(llama, ids, mask, 6)
    text = llama.config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4
    assert base["cache_len"] == 18 and base["timed_steps"] == 5
    assert base["kv_bytes_read_per_step"] == 2 * 18 * per_token  # the whole reserved cache, every step
    assert base["weight_bytes_per_step"] == short["weight_bytes_per_step"] == speed.weight_bytes_per_step(llama, 2)
    assert llama.config._attn_implementation == "kvcompose"  # both restore the attention implementation


def test_the_warm_up_compiles_at_the_timed_runs_capacity(llama, monkeypatch):
    """Kernels and graphs specialized on the stores' capacity compile before the timed run, for
    every policy alike: the first policy of a benchmark must not pay the compiles the later ones reuse."""
    from kvcompose import speed

    calls = []
    monkeypatch.setattr(speed, "WARM_UP_STEPS", {"cpu": 256})  # as long as on a GPU
    real = speed.fast_generate
    monkeypatch.setattr(speed, "fast_generate", lambda model, cache, ids, mask, new, **kw: calls.append(
        (cache.policy.budget, new, kw.get("reserve_new_tokens"))) or real(model, cache, ids, mask, new, **kw))
    ids, mask = speed.random_prompts(96, 2, 12, "cpu")
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    row = speed.time_policy(llama, policy, ids, mask, 20)
    assert calls[1] == (32, 20, 20) and calls[-1] == (32, 20, None)  # the policy's warm-up reserves the timed 20
    assert row["warm_up_s"] > 0
    calls.clear()
    assert speed.time_policy(llama, policy, ids, mask, 20, reserve_new_tokens=30)["warm_up_s"] > 0
    assert calls[1] == (32, 20, 30) and calls[-1] == (32, 20, 30)
    monkeypatch.setattr(speed, "WARM_UP_STEPS", {"cpu": 8})
    calls.clear()
    speed.time_policy(llama, policy, ids, mask, 20)
    assert calls[1] == (32, 8, 20)


def test_fixed_memory_runs_back_off_from_out_of_memory_and_the_cap():
    from kvcompose.speed import largest_batch, run_backing_off

    assert largest_batch(10, 3, 100) == 30 and largest_batch(200, 3, 100) == 1 and largest_batch(0, 1, 1e9) == 1024
    assert largest_batch(10, 0, 100, limit=64) == 64
    tried = []

    def run_at(batch):
        tried.append(batch)
        if batch > 150:
            raise torch.OutOfMemoryError("no room")
        return {"batch": batch, "peak_gib": batch / 2}  # over a 70 GiB cap above 140 rows

    row = run_backing_off(run_at, 200, cap_gib=70.0, retries=4)
    assert tried == [200, 180, 162, 145, 130] and row["batch"] == 130
    assert row["over_cap_at"] == [200, 180, 162, 145] and not row["over_cap"]
    with pytest.raises(torch.OutOfMemoryError):
        run_backing_off(run_at, 200, cap_gib=70.0, retries=2)
    assert run_backing_off(run_at, 100, cap_gib=70.0, retries=2) == {
        "batch": 100, "peak_gib": 50.0, "over_cap": False, "over_cap_at": []}
    tried.clear()
    row = run_backing_off(run_at, 145, cap_gib=70.0, retries=0)  # no retry left: kept, and flagged
    assert tried == [145] and row["over_cap"] and row["over_cap_at"] == []
    tried.clear()
    row = run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 99.0}, 2, 70.0, 5)
    assert tried == [2, 1] and row["over_cap"]  # never below one row

    # Knowing the memory that does not grow with the batch, a peak over the cap gives the batch
    # that fits at once: 16 GiB fixed and 0.132 GiB per row measured at 518 rows -> 400 rows (2% under).
    tried.clear()
    row = run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 16 + 0.132 * b}, 518, 70.0, 4,
                          fixed_gib=16.0)
    assert tried == [518, 400] and row["peak_gib"] <= 70.0 and row["over_cap_at"] == [518]
    tried.clear()  # a peak barely over the cap: 2% fewer rows
    row = run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 70.01 if b == 100 else 69.0}, 100,
                          70.0, 4, fixed_gib=16.0)
    assert tried == [100, 97]
    with pytest.raises(ValueError, match="fixed_gib=17179869184"):  # bytes where GiB are meant
        run_backing_off(lambda b: {"batch": b, "peak_gib": 1.0}, 8, 70.0, 4, fixed_gib=17179869184)


@pytest.mark.gpu
def test_cuda_fixed_memory_finds_a_batch_under_the_cap():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompose import speed

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="kvcompose")
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    cap = (torch.cuda.memory_allocated() + 512 * 2**20) / 2**30  # 512 MiB beyond the weights
    row = speed.fit_policy(model, Policy.from_preset("rkv", budget=64), 32, 256, cap, window=40)
    assert row["batch"] > 4 and row["reserved_new_tokens"] == 256 and not row["over_cap"]
    base = speed.fit_transformers_static(model, 32, 256, cap, window=8, headroom_gib=0.1)
    assert base["batch"] > 4 and base["cache_len"] == 288 and not base["over_cap"]
    with pytest.raises(ValueError, match="window=300"):
        speed.fit_policy(model, Policy.from_preset("rkv", budget=64), 32, 256, cap, window=300)


def test_warm_up_policy_reaches_every_step_kind_quickly():
    from kvcompose.speed import warm_up_policy

    rkv = warm_up_policy(Policy.from_preset("rkv"))
    assert (rkv.budget, rkv.trigger.buffer, rkv.evictor.name) == (64, 16, "rkv")
    rpc = warm_up_policy(Policy.from_preset("rpc"))
    assert rpc.trigger.period == 32 and rpc.recent_tokens <= 8
    assert warm_up_policy(Policy.from_preset("thinkv")).refresh == 16


def test_bench_command_names_an_unknown_preset_before_loading(capsys):
    from kvcompose.cli import main

    assert main(["bench", "--presets", "fullkv,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_graph_variants_eager_first_run_is_filed_as_one_time_work():
    """The first run of an eviction or refresh graph is eager warm-up, not an eviction step's cost."""
    from kvcompose.hf.static import step_kind

    evict, refresh, plain = StepPlan(False, False, evict=True), StepPlan(False, False, refresh=True), StepPlan(True, False)
    assert [step_kind(p, False, False, True) for p in (evict, refresh, plain)] == ["warm-up"] * 3
    assert [step_kind(p, True, True, True) for p in (evict, refresh, plain)] == ["capture"] * 3
    assert [step_kind(p, True, False, True) for p in (evict, refresh, plain)] == ["evict", "refresh", "replay"]
    assert step_kind(StepPlan(False, True), False, False, True) == "eager"
    assert [step_kind(p, False, False, False) for p in (evict, refresh, plain)] == ["evict", "refresh", "plain"]


def test_one_time_work_is_named_by_graph_variant():
    from kvcompose.hf.static import _variant

    assert _variant(StepPlan(False, False)) == "plain"
    assert _variant(StepPlan(True, False, evict=True)) == "flush+evict"
    assert _variant(StepPlan(False, False, refresh=True)) == "refresh"


def test_decode_time_split_leaves_one_time_work_out_of_the_steady_rate():
    from kvcompose.speed import decode_time_split

    by_step = {"warm-up plain": 100.0, "warm-up evict": 200.0, "capture plain": 10.0, "capture evict": 20.0}
    summary = {"ms_by_kind": {"warm-up": 300.0, "capture": 30.0, "replay": 900.0, "evict": 60.0},
               "steps_by_kind": {"warm-up": 2, "capture": 2, "replay": 90, "evict": 2},
               "replays": 90, "host_ms_per_replay": 0.5, "one_time_ms_by_step": by_step, "capture_host_s": 0.2}
    split = decode_time_split(summary)
    assert split["one_time_s"] == pytest.approx(0.33) == sum(by_step.values()) / 1e3
    assert split["one_time_ms_by_step"] == by_step and split["capture_host_s"] == 0.2
    assert split["steady_ms_per_step"] == pytest.approx(960.0 / 92)
    assert split["replay_gpu_ms"] == pytest.approx(10.0)
    assert split["eviction_share"] == pytest.approx((60.0 - 2 * 10.0) / 960.0)
    assert split["evict_ms_per_step"] == pytest.approx(30.0) and split["host_share"] == pytest.approx(0.05)
    only_one_time = dict(summary, ms_by_kind={"warm-up": 5.0}, steps_by_kind={"warm-up": 1}, replays=0)
    assert decode_time_split(only_one_time)["steady_ms_per_step"] is None


@pytest.mark.gpu
def test_a_capture_leaves_the_queued_work_running():
    """Capturing records and runs nothing, so it must not wait for the device: the steps queued
    before it keep running while the host captures (torch.cuda.graph synchronizes first)."""
    from kvcompose.hf.static import capture_overlapped

    x = torch.arange(8.0, device="cuda")
    busy_until = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of a busy device
    busy_until.record()
    graph = torch.cuda.CUDAGraph()
    out = capture_overlapped(graph, torch.cuda.graph_pool_handle(), lambda: x * 2 + 1)
    assert not busy_until.query()  # the capture returned while the queued work still ran
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((8,), 7.0, device="cuda"))


@pytest.mark.gpu
def test_the_timed_run_is_not_profiled_and_a_second_run_splits_its_time(monkeypatch):
    """The timed run decodes as a user's call does (no wait for the device before each step); a
    profiled run of the same decode gives the split by step kind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompose import speed

    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).cuda().eval()
    profiled = []
    real = speed.fast_generate
    monkeypatch.setattr(speed, "fast_generate", lambda model, cache, ids, mask, new, **kw: profiled.append(
        (new, kw.get("profile", False))) or real(model, cache, ids, mask, new, **kw))
    ids, mask = speed.random_prompts(96, 2, 12, "cuda")
    row = speed.time_policy(model, Policy.from_preset("rkv", budget=32, trigger={"buffer": 8}), ids, mask, 40)
    assert profiled[-2:] == [(40, False), (40, True)]
    assert row["eviction_steps"] > 0 and row["steady_ms_per_step"] > 0 and row["profiled_ms_per_step"] > 0
    assert row["ms_per_step"] == pytest.approx(1e3 * row["decode_s"] / 39)
    profiled.clear()
    speed.time_policy(model, Policy.from_preset("fullkv"), ids, mask, 8, profile=False)
    assert not any(on for _, on in profiled)


def test_fit_policy_starts_at_a_given_batch_and_still_backs_off(monkeypatch):
    """``start_batch`` replaces the estimate as the first batch tried (saving the runs over the
    cap that an earlier search already made); the search backs off from it as from the estimate,
    and the record keeps both."""
    from kvcompose import speed

    gib = 2 ** 30
    peak_of = {2: 20 * gib, 4: 20.5 * gib}  # 0.25 GiB per row over 19.5: the estimate is 202 rows under 70 GiB
    tried = []

    def time_policy(model, policy, ids, mask, steps, reserve_new_tokens=None, profile=True):
        batch = ids.shape[0]
        tried.append(batch)
        peak_of.setdefault(batch, 19.5 * gib + 0.3 * gib * batch)  # the full runs need 0.3 GiB per row
        return {"batch": batch, "peak_gib": peak_of[batch] / gib, "kv_allocated_bytes": 1000 * batch}

    monkeypatch.setattr(speed, "_check_fit", lambda window, new: None)
    monkeypatch.setattr(speed, "time_policy", time_policy)
    monkeypatch.setattr(speed.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(speed.torch.cuda, "max_memory_allocated", lambda: peak_of[tried[-1]])
    model = types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(
        vocab_size=100)), device="cpu")
    row = speed.fit_policy(model, None, 8, 16, 70.0, 4)
    assert row["batch_estimate"] == row["batch_start"] == 202 and row["over_cap_at"] == [202]
    tried.clear()
    row = speed.fit_policy(model, None, 8, 16, 70.0, 4, start_batch=160)
    assert tried == [2, 4, 160] and row["batch"] == 160 and row["batch_start"] == 160
    assert row["batch_estimate"] == 202 and row["over_cap_at"] == [] and not row["over_cap"]
    with pytest.raises(ValueError, match=r"start_batch .* must be a number of rows >= 1, got 0"):
        speed.fit_policy(model, None, 8, 16, 70.0, 4, start_batch=0)
